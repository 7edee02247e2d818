"""The entry: the Dynamo backend, `torch.compile(model, backend="ferrocore")`.

`torch.compile` finds `ferrocore_backend` through the `torch_dynamo_backends` entry point. This
module takes the modes and options, looks the graph up in the compiled-graph cache, starts the
Triton compile workers, and hands the graph to the tracing layer (`tracing.compile_traced`); a
graph the exchange format cannot express runs eagerly (a logged, counted graph fallback); an
error raised by Rust is a bug and propagates. `compile_graph` compiles an ATen graph without
Dynamo.

The top layer of the front (entry -> tracing -> dynamic-shape dispatch -> static compile ->
runtime): it may import every layer; none imports it (tests/test_front_imports.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
from typing import Any, Callable

import torch

from . import dispatch, graph_names, static_compile, torch_logs, tracing
from . import options as _options
from .metrics import metrics
from .runtime import aliasing, aot_runtime, graph_cache, kernel_binaries, triton_launch
from .tracing import collector_spared, gpu_of


def _start_compile_workers_early() -> None:
    """Starts the Triton compile workers as `torch.compile` imports this backend, when the
    process already uses a GPU (its CUDA context exists) and the env's options compile with
    workers; FERROCORE_EARLY_WORKERS=0 waits for the first GPU graph instead."""
    if os.environ.get("FERROCORE_EARLY_WORKERS", "1") == "0" or not torch.cuda.is_initialized():
        return
    try:
        opts = _options.build_options({})
    except Exception:  # noqa: BLE001 - a bad env option is reported when a graph compiles
        return
    if not opts["compile_workers"] or opts["backend"] == "cpp" or importlib.util.find_spec("triton") is None:
        return
    arch = triton_launch.cuda_arch(torch.device("cuda", torch.cuda.current_device()))
    if arch is not None:
        kernel_binaries.start_early(opts["compile_workers"], arch)


# torch.compile modes that record CUDA graphs, and those that autotune kernels, as Inductor's do.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
MODES = (None, "default", *CUDAGRAPH_MODES, *AUTOTUNE_MODES[1:])


def ferrocore_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs) -> Callable:
    """Dynamo backend. `options=` (a dict) overrides env options; `mode="reduce-overhead"`
    records GPU graphs (inference, forward and backward) as CUDA graphs,
    "max-autotune-no-cudagraphs" times each Triton kernel's candidate configurations and each
    GEMM as a template with its epilogue against the library call (`gemm_choice`),
    "max-autotune" does both; another mode, or an unknown option, raises OptionError."""
    with collector_spared():
        try:
            return _compile_dynamo_graph(gm, example_inputs, kwargs)
        except _options.OptionError as e:
            raise _options.through_dynamo(e) from None


def _compile_dynamo_graph(gm: torch.fx.GraphModule, example_inputs, kwargs: dict) -> Callable:
    facts: dict = {}
    with graph_names.naming(graph_names.base_for(gm)):
        compiled = _compile_named_dynamo_graph(gm, example_inputs, kwargs, facts)
        name = graph_names.current_base()

    def compile_for(args):
        # the same graph for inputs that overlap otherwise (`aliasing`), compiled at a call
        with collector_spared(), graph_names.naming(graph_names.base_for(gm)):
            return _compile_named_dynamo_graph(gm, args, kwargs, {})

    return aliasing.guarded(compiled, example_inputs, facts.get("written"), compile_for, name,
                            "recompiles" in facts.get("logs", ()), isinstance(gm, getattr(torch._dynamo.utils, "GmWrapper", ())))


def _compile_named_dynamo_graph(gm: torch.fx.GraphModule, example_inputs, kwargs: dict, facts: dict) -> Callable:
    """Compiles one Dynamo graph; sets `facts["written"]` to the positions of the inputs the
    graph writes into (None where not known) and `facts["logs"]` to the log channels."""
    if kwargs.get("mode") not in MODES:
        raise _options.OptionError(f"ferrocore: unknown mode {kwargs['mode']!r}; the modes are "
                                   f"{', '.join(m for m in MODES if m)}")
    overrides = dict(kwargs.get("options") or {})
    if kwargs.get("mode") in CUDAGRAPH_MODES:
        overrides.setdefault("cudagraphs", True)
    if kwargs.get("mode") in AUTOTUNE_MODES:
        overrides.setdefault("autotune", True)
        # each GEMM as a template with its epilogue where measured faster (FERROCORE_GEMM_TEMPLATE
        # still says otherwise)
        if not os.environ.get("FERROCORE_GEMM_TEMPLATE"):
            overrides.setdefault("gemm_template", "measured")
    opts = _options.build_options(overrides)
    facts["logs"] = opts["logs"]
    _announce_dynamo_recompile(opts)
    boxed = isinstance(gm, getattr(torch._dynamo.utils, "GmWrapper", ()))
    cache_key = _graph_cache_key(gm, example_inputs, opts)
    if cache_key is not None:
        hit = _cached_graph(cache_key, opts, boxed, facts)
        if hit is not None:
            return hit
    gpu = gpu_of(example_inputs)
    if opts["compile_workers"] and opts["backend"] != "cpp" and gpu is not None:
        # its processes start while AOT autograd traces
        kernel_binaries.compile_pool(opts["compile_workers"], triton_launch.cuda_arch(gpu))
    return tracing.compile_traced(gm, example_inputs, opts, overrides, cache_key, boxed, facts)


def _announce_dynamo_recompile(opts: dict) -> None:
    """Dynamo compiling a frame again (a guard failed: a new size, dtype, ...): counted
    (`recompiles` in the metrics) and logged once per compile on the `recompiles` channel, with
    Dynamo's reason."""
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - a Dynamo without compile ids
        return
    context = torch._guards.CompileContext.try_get()
    if not getattr(compile_id, "frame_compile_id", 0) or getattr(context, "_ferrocore_announced", False):
        return
    context._ferrocore_announced = True  # (a graph break's later graphs belong to the same compile)
    metrics.count("recompiles")
    if "recompiles" in opts["logs"]:
        try:  # (Dynamo keeps it in its metrics for the compile, under this key)
            reason = torch._dynamo.utils.get_metrics_context()._metrics.get("recompile_reason")
        except Exception:  # noqa: BLE001 - a Dynamo that keeps it elsewhere
            reason = None
        print(f"[ferrocore:recompiles] {graph_names.current_base()}: Dynamo compiles frame {compile_id.frame_id} "
              f"again (compile {compile_id}): {reason or 'a guard failed (TORCH_LOGS=recompiles shows which)'}",
              file=sys.stderr)


def _graph_cache_key(gm: torch.fx.GraphModule, example_inputs, opts: dict) -> str | None:
    """The compiled-graph cache's key for this Dynamo graph, or None (logged) when it is not
    cacheable."""
    if not opts["graph_cache"]:
        return None
    if opts["cudagraphs"]:
        graph_cache.log(opts, "bypass: CUDA-graph recordings are not cached")
        return None
    if opts["debug_dir"] is not None:
        graph_cache.log(opts, "bypass: the stage dumps and the compile report are written by a compile")
        return None
    try:
        return graph_cache.key(gm, example_inputs, opts)
    except graph_cache.Bypass as e:
        graph_cache.log(opts, f"bypass: {e}")
    except Exception as e:  # noqa: BLE001 - a graph the key cannot describe is compiled, not refused
        graph_cache.log(opts, f"bypass: the key cannot be computed ({type(e).__name__}: {e})")
    return None


def _cached_graph(cache_key: str, opts: dict, boxed: bool, facts: dict) -> Callable | None:
    """The callable for a compiled-graph cache hit, or None on a miss (logged with its reason);
    sets `facts["written"]`."""
    start = time.perf_counter()
    entry = graph_cache.load(opts["cache_dir"], cache_key)
    if entry is None:
        graph_cache.log(opts, f"miss {cache_key[:16]}: no valid entry")
        return None
    if graph_cache.ENTRY_GRAPHS.get(entry["kind"]) != len(entry["graphs"]):
        graph_cache.log(opts, f"miss {cache_key[:16]}: an entry of kind {entry['kind']!r} cannot be run")
        return None
    graphs = [dataclasses.replace(g, name=graph_names.next_name(part))
              for g, part in zip(entry["graphs"], graph_cache.ENTRY_PARTS[entry["kind"]])]
    calls = []
    for graph in graphs:
        timings = {"graph_cache": (time.perf_counter() - start) * 1e3}
        calls.append(static_compile.load_graph(graph, timings, cpp_cache_hit=True, graph_cache="hit")[0])
        _show_cached_module(graph, opts, cache_key)
        start = time.perf_counter()
    names = ", ".join(f"{g.name} ({g.counts.get('kernels', 0)} kernels)" for g in graphs)
    graph_cache.log(opts, f"hit {cache_key[:16]}: {names}")
    facts["written"] = entry["runtime"].get("written_inputs")
    if entry["kind"] == "training":
        return aot_runtime.training_call(calls[0], calls[1], entry["runtime"], boxed)
    return aot_runtime.inference_call(calls[0], entry["runtime"], boxed)


def _show_cached_module(graph: graph_cache.CompiledGraph, opts: dict, cache_key: str) -> None:
    """A cache hit's module where a compile's would show: the `output_code` channel (and torch's
    switch of that name) and, under TORCH_TRACE, its artifacts with a note of the hit."""
    code = [{"channel": "output_code", "text": graph.module_source}]
    if torch_logs.tracing():
        torch_logs.trace_graph(graph.name, graph.module_path, code, note=f"compiled-graph cache hit {cache_key[:16]}")
    static_compile.print_logs([log for log in code if log["channel"] in opts["logs"]], graph.name,
                              graph.module_path, graph.artifact)


def compile_graph(
    gm: torch.fx.GraphModule, example_inputs: Any = None, options: dict | None = None
) -> Callable:
    """Compiles an ATen-level FX graph (e.g. from `make_fx`) directly; returns `f(*args) -> list`.

    `example_inputs` is unused: the graph's `node.meta["val"]` carries the input metadata.
    """
    boxed = dispatch.compile_request(static_compile.CompileRequest(gm, {}, options or {}))
    return lambda *args: boxed(list(args))


_start_compile_workers_early()
