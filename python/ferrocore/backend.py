"""The dynamo backend: AOT autograd to core ATen, then each graph through Rust.

`torch.compile(model, backend="ferrocore")` finds `ferrocore_backend` through the
`torch_dynamo_backends` entry point. A graph the exchange format cannot express runs eagerly (a
logged, counted graph fallback); an error raised by Rust is a bug and propagates.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib.util
import json
import linecache
import marshal
import math
import operator
import os
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable

import torch
import torch._decomp as decomp
import torch._inductor.inductor_prims  # noqa: F401 - registers the prims `_max_pool_saving_offsets` calls
from torch._decomp import get_decompositions
from torch._dynamo import disable
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from . import artifact, conv_layout, direct_trace, foreach, graph_names, joint_split, padding, partition, progress, torch_logs
from . import options as _options
from .runtime import aliasing, aot_runtime, cpp_library, cudagraphs, graph_cache, kernel_binaries, precompile, triton_launch
from .runtime import cache as _cache
from .extension import extension
from .metrics import metrics
from .serialize import UnsupportedGraph, lend_forward_lines, lifted_constants, serialize_graph
from .strides import is_dense



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
# the collector's generation-2 threshold during a compile: a full collection after this many
# generation-1 collections (CPython's default is 10)
_FULL_COLLECTION_DEFERRED = 1000


def ferrocore_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs) -> Callable:
    """Dynamo backend. `options=` (a dict) overrides env options; `mode="reduce-overhead"`
    records GPU graphs (inference, forward and backward) as CUDA graphs,
    "max-autotune-no-cudagraphs" times each Triton kernel's candidate configurations,
    "max-autotune" does both; another mode, or an unknown option, raises OptionError."""
    with _collector_spared():
        try:
            return _compile_dynamo_graph(gm, example_inputs, kwargs)
        except _options.OptionError as e:
            raise _options.through_dynamo(e) from None


@contextlib.contextmanager
def _collector_spared():
    """Keeps the cyclic garbage collector's full collections out of a compile. A compile
    allocates enough to set off several, each walking the whole heap (GPT-2's training graph on
    the H100's host: one of 0.39 s inside its backward's serialization). The objects that existed
    before (the model, Dynamo's state) are frozen, and full collections wait until the compile is
    over (torch 2.15's Dynamo defers them likewise, `gc_gen2_threshold_during_compile`); the
    younger generations are still collected. Left alone where the program froze objects itself,
    or turned the collector off."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], _FULL_COLLECTION_DEFERRED))
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def _compile_dynamo_graph(gm: torch.fx.GraphModule, example_inputs, kwargs: dict) -> Callable:
    facts: dict = {}
    with graph_names.naming(graph_names.base_for(gm)):
        compiled = _compile_named_dynamo_graph(gm, example_inputs, kwargs, facts)
        name = graph_names.current_base()

    def compile_for(args):
        # the same graph for inputs that overlap otherwise (`aliasing`), compiled at a call
        with _collector_spared(), graph_names.naming(graph_names.base_for(gm)):
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
    opts = _options.build_options(overrides)
    facts["logs"] = opts["logs"]
    _announce_dynamo_recompile(opts)
    boxed = isinstance(gm, getattr(torch._dynamo.utils, "GmWrapper", ()))
    cache_key = _graph_cache_key(gm, example_inputs, opts)
    if cache_key is not None:
        hit = _cached_graph(cache_key, opts, boxed, facts)
        if hit is not None:
            return hit
    gpu = _gpu_of(example_inputs)
    if opts["compile_workers"] and opts["backend"] != "cpp" and gpu is not None:
        # its processes start while AOT autograd traces
        kernel_binaries.compile_pool(opts["compile_workers"], triton_launch.cuda_arch(gpu))
    user_strides = _user_output_strides(gm)
    label = _progress_label()
    start = time.perf_counter()
    if opts["direct_trace"]:
        direct = _traced_directly(gm, example_inputs, opts, overrides, user_strides, cache_key, boxed, label)
        if direct is not None:
            facts["written"] = direct[1]
            return direct[0]
    # a direct trace given up counts as tracing time
    state = _AotClock({"trace": (time.perf_counter() - start) * 1e3} if opts["direct_trace"] else {})
    # the forward's and backward's CUDA-graph runners see each other's recordings
    family = cudagraphs.Family()
    # what the compiled-graph cache stores: the compiled graphs (inference, or forward and
    # backward) and what AOT autograd's runtime does around them
    recorded: dict = {"graphs": [], "bypass": None, "runtime": None, "call": None}

    def forward(graph, inputs):
        facts["written"] = aot_runtime.written_inputs(len(example_inputs))
        _describe_runtime(recorded, lambda: aot_runtime.training_runtime(graph))
        strides = _visible_output_strides(graph, user_strides, inference=False)
        saved = _saved_outputs(graph)
        return _compile(CompileRequest(graph, state.take(), overrides, strides, free_layout=_free_layout(saved),
                                       saved=saved, family=family, record=recorded["graphs"].append))

    def inference(graph, inputs):
        facts["written"] = aot_runtime.written_inputs(len(example_inputs))
        _describe_runtime(recorded, aot_runtime.inference_runtime)
        strides = _visible_output_strides(graph, user_strides, inference=True)
        recorded["call"] = _compile(CompileRequest(graph, state.take(), overrides, strides,
                                                   record=recorded["graphs"].append))
        return recorded["call"]

    base = graph_names.current_base()

    def backward(graph, inputs):
        _take_input_strides(graph, inputs)
        donated = _donated_inputs()
        # AOT autograd may compile the backward at its first call, outside the forward's line
        with progress.compiling(label + " (backward)", opts["progress"]), _collector_spared(), \
                graph_names.naming(base):
            compiled = _compile(CompileRequest(graph, state.take(), overrides, donated=donated, backward=True,
                                               family=family, record=recorded["graphs"].append))
        if cache_key is not None:
            if recorded["runtime"] is not None:
                _describe_runtime(recorded, lambda: aot_runtime.add_backward(recorded["runtime"], graph, inputs,
                                                                             donated))
            # the entry is complete only now: AOT autograd compiles most backwards lazily
            _store_graph(cache_key, opts, recorded, "training")
        return compiled

    with progress.compiling(label, opts["progress"]):
        compiled = _aot_autograd(
            gm,
            example_inputs,
            # writes into inputs (batch-norm running statistics) stay in the graph as `copy_`,
            # which ferrocore lowers to stores into the input's memory (`lowering/mutation.rs`)
            keep_inference_input_mutations=True,
            fw_compiler=forward,
            inference_compiler=inference,
            bw_compiler=backward,
            decompositions=decompositions(training=_needs_grad(example_inputs)),
            partition_fn=_partition,
        )
    state.stop()
    if cache_key is not None and recorded["call"] is not None and _store_graph(cache_key, opts, recorded, "inference"):
        # what a cache hit returns: AOT autograd's runtime wrapper around a plain call is the
        # call with grad off, and its first call would check every op for custom-op aliasing
        return aot_runtime.inference_call(recorded["call"], recorded["runtime"], boxed)
    return compiled


def _traced_directly(gm: torch.fx.GraphModule, example_inputs, opts: dict, overrides: dict, user_strides: list,
                     cache_key: str | None, boxed: bool, label: str) -> Callable | None:
    """Compiles a graph traced to ATen by ferrocore (`direct_trace`): an inference graph, or a
    training graph's joint trace split into forward and backward (`joint_split`). Returns the
    callable and the positions of the inputs it writes into, or None (logged on `trace`) when
    the graph needs AOT autograd."""
    training = _needs_grad(example_inputs)
    with progress.compiling(label, opts["progress"]):
        start = time.perf_counter()
        try:
            direct_trace.check_graph(gm, example_inputs, training)
            if training:
                traced = direct_trace.trace_joint(gm, example_inputs, decompositions(training=True))
                traced_ms = (time.perf_counter() - start) * 1e3
                gemms = padding.Measurements(traced.graph, opts)  # for both graphs' padding
                if _gpu_of(example_inputs) is None:
                    conv_layout.measure_ahead(traced.graph, opts)
                parts = joint_split.split(traced.graph, traced.num_outputs, len(traced.requires_grad),
                                          set(direct_trace.static_inputs(gm)), set(traced.written))
            else:
                traced = direct_trace.trace(gm, example_inputs, decompositions(training=False))
        except direct_trace.NeedsAot as e:
            _log_trace(opts, f"{label} goes through AOT autograd: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - AOT autograd traces what this pass cannot; a real error recurs there
            print(f"[ferrocore:trace] {label}: the direct trace failed ({type(e).__name__}: {e}); "
                  "AOT autograd traces it", file=sys.stderr)
            metrics.count("direct_trace_failures")
            return None
        if training:
            split_ms = (time.perf_counter() - start) * 1e3 - traced_ms
            return _compile_joint(traced, parts, gm, example_inputs, opts, overrides, user_strides, cache_key, boxed,
                                  label, (traced_ms, split_ms), gemms), list(traced.written)
        traced_ms = (time.perf_counter() - start) * 1e3
        _log_trace(opts, f"{label} traced directly ({len(traced.graph.nodes)} nodes, {traced_ms:.0f} ms)")
        recorded: dict = {"graphs": [], "bypass": None, "runtime": aot_runtime.plain_inference_runtime()}
        strides = _visible_output_strides(traced, user_strides, inference=True)
        call = _compile(CompileRequest(traced, {"trace": traced_ms}, overrides, strides,
                                       static_inputs=direct_trace.static_inputs(gm), record=recorded["graphs"].append))
    if cache_key is not None:
        _store_graph(cache_key, opts, recorded, "inference")
    return aot_runtime.inference_call(call, recorded["runtime"], boxed), []


def _compile_joint(joint: direct_trace.Joint, parts: joint_split.Split, gm: torch.fx.GraphModule, example_inputs,
                   opts: dict, overrides: dict, user_strides: list, cache_key: str | None, boxed: bool, label: str,
                   spent_ms: tuple, gemms: padding.Measurements) -> Callable:
    """Compiles a directly traced joint graph's forward now and its backward at the backward's
    first call (`LazyBackward`): a model called for inference without `torch.no_grad()` never
    compiles one. `spent_ms`: (tracing, splitting); `gemms`: the joint graph's GEMM timings, for
    both graphs' padding."""
    traced_ms, split_ms = spent_ms
    static = direct_trace.static_inputs(gm)
    _log_trace(opts, f"{label} traced directly with its backward ({len(joint.graph.graph.nodes)} nodes, "
                     f"{traced_ms:.0f} ms; split in {split_ms:.0f} ms: {len(parts.saved_is_input)} saved)")
    recorded: dict = {"graphs": [], "bypass": None}
    family = cudagraphs.Family()
    saved = list(range(joint.num_outputs, joint.num_outputs + len(parts.saved_is_input)))
    strides = _visible_output_strides(parts.forward, user_strides, inference=False)
    reported: list = []
    later = KernelsLater()
    try:
        fw_call = _compile(CompileRequest(parts.forward, {"trace": traced_ms + split_ms}, overrides, strides,
                                          free_layout=saved, saved=saved, family=family,
                                          record=recorded["graphs"].append, static_inputs=static,
                                          reported_strides=reported, kernels_later=later, measured=gemms))
    finally:
        later.wait()
    _restride_saved(parts.backward, reported[joint.num_outputs:])
    runtime = aot_runtime.direct_training_runtime(joint, parts.saved_is_input, example_inputs, joint.unsafe_views)
    recorded["runtime"] = aot_runtime.add_backward(runtime, parts.backward, None, parts.donated)
    base = graph_names.current_base()

    def compile_backward() -> Callable:
        with progress.compiling(label + " (backward)", opts["progress"]), _collector_spared(), \
                graph_names.naming(base):
            bw_call = _compile(CompileRequest(parts.backward, {}, overrides, donated=parts.donated, backward=True,
                                              family=family, record=recorded["graphs"].append, measured=gemms))
        if cache_key is not None:
            # the entry holds both graphs: stored once the backward exists
            _store_graph(cache_key, opts, recorded, "training")
        return bw_call

    return aot_runtime.training_call(fw_call, LazyBackward(compile_backward), recorded["runtime"], boxed)


class LazyBackward:
    """A training graph's compiled backward, compiled at its first call (as AOT autograd
    compiles its backwards): forward-only use of a model whose parameters require gradients
    compiles one graph. Called with the boxed argument list."""

    def __init__(self, compile_backward: Callable[[], Callable]) -> None:
        self._compile = compile_backward
        self._call: Callable | None = None
        self._lock = threading.Lock()

    def __call__(self, args):
        if self._call is None:
            with self._lock:
                if self._call is None:
                    self._call = self._compile()
        return self._call(args)


class KernelsLater:
    """Kernel compiles that run on a thread of their own while the caller compiles the next
    graph: a training graph's forward kernels compile (Triton's in the worker processes, C++ in
    the compiler) while its backward is generated, and the workers never idle between the two
    batches. `wait()` before a launch."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrocore-kernels")
        self._pending: list = []

    def submit(self, fn: Callable) -> None:
        self._pending.append(self._pool.submit(fn))

    def wait(self) -> None:
        try:
            for future in self._pending:
                future.result()
        finally:
            self._pool.shutdown(wait=True)


def _restride_saved(backward: torch.fx.GraphModule, strides: list) -> None:
    """The backward reads each saved activation with the strides the compiled forward wrote it
    with (ferrocore chooses the layout of values only the backward reads)."""
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    for node, stride in zip(placeholders, strides):
        val = node.meta.get("val")
        if stride is not None and isinstance(val, torch.Tensor) and tuple(val.stride()) != tuple(stride):
            with torch._guards.detect_fake_mode([val]) or contextlib.nullcontext():
                node.meta["val"] = torch.empty_strided(val.shape, stride, dtype=val.dtype, device=val.device)


def _log_trace(opts: dict, text: str) -> None:
    if "trace" in opts["logs"]:
        print(f"[ferrocore:trace] {text}", file=sys.stderr)


def _aot_autograd(gm: torch.fx.GraphModule, example_inputs, **kwargs) -> Callable:
    """AOT autograd, run as torch's `aot_autograd` backend helper runs it: the backward compiler
    and the compiled graph hidden from Dynamo, its counters kept. The helper also imports
    Inductor's debug module for AOT's debug logging: 0.09 s of every cold process, so it is
    taken only where that logging is asked for (TORCH_COMPILE_DEBUG, or the module loaded
    already) or the inputs need its flattening."""
    debug = os.environ.get("TORCH_COMPILE_DEBUG", "0") not in ("", "0") or "torch._inductor.debug" in sys.modules
    if debug or any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return aot_autograd(**kwargs)(gm, example_inputs)
    bw_compiler = kwargs["bw_compiler"]

    def hidden_bw_compiler(*args, **kw):
        # neither the compiler nor the backward it returns is Dynamo's to trace
        compiled = disable(bw_compiler, reason="do not trace backward compiler function")(*args, **kw)
        return disable(compiled, reason="do not trace generated backwards pass")

    counters["aot_autograd"]["total"] += 1
    try:
        compiled = aot_module_simplified(gm, example_inputs, **{**kwargs, "bw_compiler": hidden_bw_compiler})
    except Exception as e:
        if type(e).__name__ != "TensorifyScalarRestartAnalysis":  # a restart, not a failure
            counters["aot_autograd"]["not_ok"] += 1
        raise
    counters["aot_autograd"]["ok"] += 1
    return disable(compiled, reason="do not trace AOT-compiled graph")


def _progress_label() -> str:
    """The graph a progress line names: Dynamo's frame and graph number ("graph 0/1")."""
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - an older Dynamo without compile ids
        compile_id = None
    return f"graph {compile_id}" if compile_id is not None else "graph"


def _gpu_of(example_inputs) -> torch.device | None:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)


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


def _describe_runtime(recorded: dict, describe: Callable) -> None:
    """Records AOT autograd's runtime for the cache entry, or why it cannot be rebuilt."""
    if recorded["bypass"] is not None:
        return
    try:
        recorded["runtime"] = describe()
    except graph_cache.Bypass as e:
        recorded["bypass"], recorded["runtime"] = str(e), None


# an entry's kind, and how many compiled graphs it holds
_ENTRY_GRAPHS = {"inference": 1, "training": 2}
_ENTRY_PARTS = {"inference": ("inference",), "training": ("fw", "bw")}


def _cached_graph(cache_key: str, opts: dict, boxed: bool, facts: dict) -> Callable | None:
    """The callable for a compiled-graph cache hit, or None on a miss (logged with its reason);
    sets `facts["written"]`."""
    start = time.perf_counter()
    entry = graph_cache.load(opts["cache_dir"], cache_key)
    if entry is None:
        graph_cache.log(opts, f"miss {cache_key[:16]}: no valid entry")
        return None
    if _ENTRY_GRAPHS.get(entry["kind"]) != len(entry["graphs"]):
        graph_cache.log(opts, f"miss {cache_key[:16]}: an entry of kind {entry['kind']!r} cannot be run")
        return None
    graphs = [dataclasses.replace(g, name=graph_names.next_name(part))
              for g, part in zip(entry["graphs"], _ENTRY_PARTS[entry["kind"]])]
    calls = []
    for graph in graphs:
        timings = {"graph_cache": (time.perf_counter() - start) * 1e3}
        calls.append(_load_graph(graph, timings, cpp_cache_hit=True, graph_cache="hit")[0])
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
    _print_logs([log for log in code if log["channel"] in opts["logs"]], graph.name, graph.module_path,
                graph.artifact)


def _store_graph(cache_key: str, opts: dict, recorded: dict, kind: str) -> bool:
    """Stores the compiled graphs; False when they are not cacheable (partitioned, specialized
    or eager graphs, an AOT runtime `aot_runtime` cannot rebuild)."""
    why = recorded["bypass"]
    if why is None and (recorded["runtime"] is None or len(recorded["graphs"]) != _ENTRY_GRAPHS[kind]):
        why = "the graph was partitioned, specialized per shape or run eagerly"
    if why is not None:
        graph_cache.log(opts, f"not stored {cache_key[:16]}: {why}")
        return False
    try:
        graph_cache.store(opts["cache_dir"], cache_key, kind, recorded["runtime"], recorded["graphs"])
    except Exception as e:  # noqa: BLE001 - the compiled graph works without its entry
        print(f"[ferrocore:graph_cache] could not store {cache_key[:16]}: {e}", file=sys.stderr)
        return True
    graph_cache.log(opts, f"stored {cache_key[:16]}: {', '.join(g.name for g in recorded['graphs'])}")
    return True


def _saved_outputs(graph: torch.fx.GraphModule) -> list:
    """Positions of a forward graph's outputs that only its backward reads (saved activations,
    after the mutated inputs and user outputs)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    returns = getattr(meta, "num_forward_returns", None)
    if returns is None:
        return []
    outs = torch.utils._pytree.arg_tree_leaves(*graph.graph.output_node().args)
    return list(range(returns, len(outs)))


def _free_layout(saved: list) -> list:
    """The saved activations whose layout is ferrocore's to choose: AOT autograd compiles the
    backward for the strides the forward reports (`_report_output_strides`)."""
    ctx = torch._guards.TracingContext.try_get()
    return saved if ctx is not None and getattr(ctx, "output_strides", None) is not None else []


def _report_output_strides(result: dict) -> None:
    """Tells AOT autograd the strides the forward returns its outputs with, so that the backward
    is compiled for the layout of the activations it receives."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and getattr(ctx, "output_strides", None) is not None and not ctx.output_strides:
        ctx.output_strides.extend(tuple(s) if s is not None else None for s in result.get("output_strides", ()))


def _take_input_strides(graph: torch.fx.GraphModule, inputs) -> None:
    """A backward graph's placeholders take the strides of the example inputs AOT autograd hands
    the compiler: saved activations come with the layout the forward reported."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    for n, x in zip(placeholders, inputs or ()):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(x, torch.Tensor) and x.shape == val.shape \
                and x.stride() != val.stride():
            n.meta["val"] = x


def _partition(joint, joint_inputs, **kwargs):
    """Splits a training graph into forward and backward with AOT autograd's min-cut
    rematerialization partitioner, in its fusing-compiler setting (as Inductor does): the
    backward recomputes cheap pointwise chains from a few saved tensors instead of saving every
    intermediate, since ferrocore fuses the recomputation into the backward's kernels."""
    lend_forward_lines(joint.graph)
    return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)


def _user_output_strides(gm: torch.fx.GraphModule) -> list:
    """The strides of the program's outputs as eager produces them (dynamo's example values,
    computed with the original operators' meta functions), None for non-tensors."""
    out = []
    for o in torch.utils._pytree.arg_tree_leaves(*gm.graph.output_node().args):
        val = o.meta.get("example_value") if isinstance(o, torch.fx.Node) else None
        out.append((tuple(val.shape), tuple(val.stride())) if isinstance(val, torch.Tensor) else None)
    return out


def _visible_output_strides(graph: torch.fx.GraphModule, user: list, *, inference: bool) -> dict:
    """{AOT output node name: stride} for the user-visible outputs whose strides differ from what
    the program produces eagerly. A decomposition (e.g. attention's math form) may lay an output
    out differently than the fused operator eager runs; like Inductor's keep_output_stride,
    ferrocore writes such outputs with eager's strides. AOT's forward returns mutated inputs
    first, then the user outputs, then saved activations."""
    start = 0
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is not None and not inference:
        start = getattr(meta, "num_mutated_inp_runtime_indices", 0)
    outs = torch.utils._pytree.arg_tree_leaves(*graph.graph.output_node().args)
    result = {}
    for k, want in enumerate(user):
        i = start + k
        if want is None or i >= len(outs) or not isinstance(outs[i], torch.fx.Node):
            continue
        node = outs[i]
        if sum(1 for o in outs if o is node) > 1:
            continue  # also saved for backward, which reads it with the graph's strides
        val = node.meta.get("val")
        shape, stride = want
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            continue
        if not all(type(x) is int for x in (*shape, *stride, *val.shape, *val.stride())):
            # a size a tensor's data decides (`.item()`): comparing it would guard on data; such
            # a graph is compiled per concrete size later (`partition`)
            continue
        if tuple(val.shape) != shape:
            continue
        if tuple(val.stride()) != stride and is_dense(shape, stride):
            result[node.name] = list(stride)
    return result


def compile_graph(
    gm: torch.fx.GraphModule, example_inputs: Any = None, options: dict | None = None
) -> Callable:
    """Compiles an ATen-level FX graph (e.g. from `make_fx`) directly; returns `f(*args) -> list`.

    `example_inputs` is unused: the graph's `node.meta["val"]` carries the input metadata.
    """
    boxed = _compile(CompileRequest(gm, {}, options or {}))
    return lambda *args: boxed(list(args))


def _donated_inputs() -> list:
    """The backward's input positions AOT autograd donates: saved activations nothing else holds
    once it calls the backward (none when the graph may run backward again: retain_graph)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    return list(getattr(meta, "bw_donated_idxs", None) or [])


def _copied_inputs(gm: torch.fx.GraphModule, backward: bool, static: list | None = None) -> list:
    """Inputs a CUDA graph copies into buffers of its own before each replay instead of reading
    them where they live: a forward's or inference graph's inputs other than parameters and
    buffers (AOT autograd's `static_input_indices`: a new batch each step still replays), a
    backward's incoming gradients. Inputs the graph writes into are read where they live. None
    outside torch.compile (`compile_graph`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if backward:
        copied = {i for i, n in enumerate(placeholders) if n.name.startswith("tangents")}
    else:
        if static is None:
            ctx = torch._guards.TracingContext.try_get()
            meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
            static = getattr(meta, "static_input_indices", None)
        if static is None:
            return []
        copied = set(range(len(placeholders))) - set(static)
    return sorted(i for i in copied if not _written(placeholders[i]))


def _written(placeholder: torch.fx.Node) -> bool:
    """Whether an op of the graph writes into this input (its schema marks the argument)."""
    for user in placeholder.users:
        schema = getattr(user.target, "_schema", None)
        if schema is None:
            continue
        passed = list(zip(schema.arguments, user.args)) + [(a, user.kwargs[a.name]) for a in schema.arguments
                                                           if a.name in user.kwargs]
        if any(v is placeholder and a.alias_info is not None and a.alias_info.is_write for a, v in passed):
            return True
    return False


def _needs_grad(example_inputs) -> bool:
    """Whether AOT autograd will trace a joint graph (as its own test does)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


@functools.lru_cache(None)
def decompositions(training: bool = False) -> dict:
    """Core ATen's table, less the ops ferrocore lowers better itself; for training graphs also
    the softmaxes and normalizations. The partitioner recomputes only ops it knows to be cheap and
    treats these as opaque, so it would save their full-size outputs beside their inputs; taken
    apart, it saves the input and the per-row statistics, and the backward recomputes the rest
    in its kernels (as Inductor's table does)."""
    table = _core_aten_table()
    # Lowered natively as a gather; torch's decomposition is a scatter-add (index_put).
    table.pop(torch.ops.aten.col2im.default, None)
    # A library call (fused CPU flash attention): its decomposition returns the attention
    # weights where the op returns logsumexp, and lays the output out unlike the kernel.
    table.pop(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    # Lowered natively as ATen's kernel computes it; the decomposition works in the default float
    # type and disagrees with eager (e.g. an int64 linspace off by one at half the points).
    # logspace likewise (its decomposition takes the power of unrounded float64 points where a
    # half-type eager result rounds the bounds first).
    for op in (torch.ops.aten.linspace, torch.ops.aten.logspace):
        for overload in ("default", "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor"):
            table.pop(getattr(op, overload), None)
    table.update(foreach.decompositions())
    # (not in torch 2.11's core table: gradient clipping's norms ran as ATen calls on its GPUs)
    table.update(get_decompositions([torch.ops.aten.linalg_vector_norm]))
    if training:
        aten = torch.ops.aten
        table.update(get_decompositions([
            aten._log_softmax, aten._softmax, aten.native_layer_norm, aten.native_group_norm,
            aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
            aten._native_batch_norm_legit_no_training, aten.native_batch_norm,
            aten._batch_norm_with_update, aten._batch_norm_with_update_functional, aten._batch_norm_no_update,
        ]))
        table[aten.max_pool2d_with_indices.default] = functools.partial(_max_pool_saving_offsets, dims=2)
        table[aten.max_pool3d_with_indices.default] = functools.partial(_max_pool_saving_offsets, dims=3)
    return table


def _core_aten_table() -> dict:
    """Core ATen's decompositions as AOT autograd applies them. `core_aten_decompositions()` also
    maps every CompositeImplicitAutograd op to its own composite kernel, for export, which traces
    above the dispatcher; AOT autograd traces below it, where those ops have decomposed already.
    Listing them costs 0.14 s per process; the graphs of the model benchmark's 16 models,
    inference and training, are identical without them."""
    post_autograd = getattr(decomp, "_core_aten_decompositions_post_autograd", None)
    if post_autograd is None:  # (another torch): the whole table
        return dict(decomp.core_aten_decompositions().items())
    return dict(post_autograd())


def _max_pool_saving_offsets(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False, *, dims):
    """Max pooling whose argmax is the int8 offset of the tap within its window, turned into
    ATen's indices by a separate op the partitioner may recompute: the forward of a training
    graph then saves a byte per pooled element instead of an int64 (ResNet's stem pool)."""
    def spread(v, default):
        v = [v] if isinstance(v, int) else list(v)
        return default if not v else v * dims if len(v) == 1 else v

    kernel = spread(kernel_size, None)
    stride = spread(stride, kernel)
    padding = spread(padding, [0] * dims)
    dilation = spread(dilation, [1] * dims)
    prims = torch.ops.prims
    if math.prod(kernel) > torch.iinfo(torch.int8).max or not hasattr(prims, "_low_memory_max_pool_with_offsets"):
        return NotImplemented
    values, offsets = prims._low_memory_max_pool_with_offsets(x, kernel, stride, padding, dilation, ceil_mode)
    indices = prims._low_memory_max_pool_offsets_to_indices(offsets, kernel, x.shape[-dims:], stride, padding, dilation)
    return values, indices


class _AotClock:
    """Time AOT autograd spends before handing each graph over (tracing, partitioning); the
    first graph also takes `pending` (timings spent before AOT autograd started)."""

    def __init__(self, pending: dict) -> None:
        self.mark: float | None = time.perf_counter()
        self.pending = pending

    def take(self) -> dict:
        if self.mark is None:  # a backward compiled lazily, after this backend returned
            return {}
        now = time.perf_counter()
        spent, self.mark = (now - self.mark) * 1e3, now
        taken, self.pending = {**self.pending, "aot": spent}, {}
        return taken

    def stop(self) -> None:
        self.mark = None


@dataclasses.dataclass
class CompileRequest:
    """One ATen graph to compile and what its caller knows and wants of it. `record` receives
    the CompiledGraph (static graphs only, the compiled-graph cache's entries).
    `static_inputs`: the inputs that keep their addresses across calls (parameters, buffers),
    when AOT autograd's metadata does not say. `reported_strides` receives the strides the
    compiled graph writes its outputs with (where `free_layout` let ferrocore choose them);
    otherwise AOT autograd is told. `kernels_later`: see `_load_graph`; `measured`: GEMM
    timings taken ahead (`padding.Measurements`)."""

    gm: torch.fx.GraphModule
    timings: dict
    overrides: dict
    output_strides: dict | None = None
    free_layout: list | None = None
    donated: list | None = None
    backward: bool = False
    saved: list | None = None
    family: object = None
    record: Callable | None = None
    static_inputs: list | None = None
    reported_strides: list | None = None
    kernels_later: KernelsLater | None = None
    measured: padding.Measurements | None = None


def _prepare(gm: torch.fx.GraphModule, name: str, opts: dict, timings: dict, measured) -> tuple:
    """The graph made ready to serialize: effect tokens and clamp bounds unwrapped, host scalars
    moved to its device, GEMMs to pad (GPU) or the convolution layout (CPU) chosen. Returns
    (device, host scalars, padded GEMMs, the options with the layout chosen, seconds spent
    timing GEMMs or layouts: not serialization's)."""
    excluded = 0.0
    _unwrap_effects(gm)
    _wrap_integer_clamp_bounds(gm)
    device, host_scalars = _host_scalars(gm)
    if device is not None and not torch.cuda.is_available():
        # (a graph traced on fake GPU tensors) rather than the driver's message at the first call
        raise RuntimeError(f"ferrocore: graph {name} computes on {device}, but this machine has no usable GPU "
                           "(torch.cuda.is_available() is False)")
    if device is None and opts["autotune"] and not _said["cpu_autotune"]:
        _said["cpu_autotune"] = True
        print(f"[ferrocore] {name} is on the CPU: autotuning (mode='max-autotune') times Triton kernels only; "
              "C++ kernels compile as in the default mode", file=sys.stderr)
    if device is not None:
        _move_host_scalars(gm, device, host_scalars)
    padded = {}
    if device is not None:
        t = time.perf_counter()
        padded = padding.padded_matmuls(gm, opts, measured)
        timings["padding"] = (time.perf_counter() - t) * 1e3
        excluded += time.perf_counter() - t
    else:
        t = time.perf_counter()
        layout = conv_layout.choose(gm, opts)
        if layout is not None:
            opts = {**opts, "conv_layout": layout[0]}
            timings["conv_layout"] = (time.perf_counter() - t) * 1e3
            if "layout" in opts["logs"]:
                print(f"[ferrocore:layout]\n{name}: {layout[1]}", file=sys.stderr)
        excluded += time.perf_counter() - t
    return device, host_scalars, padded, opts, excluded


def _compile(req: CompileRequest) -> Callable:
    """Compiles one ATen graph: a graph with data-dependent sizes in segments between the calls
    that make them, one with symbolic sizes once per shape it is called with (each a static
    compile again), a static one at once (`_compile_static`)."""
    gm, overrides = req.gm, req.overrides
    data_dependent = partition.has_data_dependent_nodes(gm)
    if data_dependent or _is_symbolic(gm):
        if _options.build_options(overrides)["cudagraphs"]:
            # segments between data-dependent calls, and per-shape compilations, see fresh
            # addresses on most calls: recording them would rarely replay
            print("[ferrocore:cudagraphs] a graph with data-dependent or symbolic sizes runs without CUDA graphs",
                  file=sys.stderr)
            overrides = {**overrides, "cudagraphs": False}
        if data_dependent:
            return _partitioned(gm, req.timings, overrides, req.output_strides)
        return _specializing(gm, req.timings, overrides, req.output_strides)
    return _compile_static(req, _options.build_options(overrides))


def _compile_static(req: CompileRequest, opts: dict) -> Callable:
    """Compiles a graph of static sizes: prepares it (host scalars, GEMM padding, convolution
    layout), serializes it, has Rust compile it, loads the result and wraps its call."""
    gm, timings = req.gm, req.timings
    name = graph_names.next_name("bw" if req.backward else "fw" if req.saved is not None else "inference")
    start = time.perf_counter()
    device, host_scalars, padded, opts, excluded = _prepare(gm, name, opts, timings, req.measured)
    start += excluded
    try:
        graph_json = serialize_graph(gm, name, req.output_strides, req.free_layout, padded, req.donated)
        constants = lifted_constants(gm)
    except UnsupportedGraph as e:
        print(f"[ferrocore:fallback] graph {name} runs eagerly: {e.reason}", file=sys.stderr)
        metrics.record(_entry(name, timings, graph_fallback=True))
        return make_boxed_func(gm.forward)
    timings["serialize"] = (time.perf_counter() - start) * 1e3

    options = json.dumps(opts)
    # a CPU graph whose kernels may compile later has its C++ compiled on that thread
    result = _run_compiler(name, graph_json, opts, timings, device is None and req.kernels_later is not None)
    report_path = result.get("report_path")
    if report_path:
        print(f"[ferrocore] {name}: compile report {report_path}", file=sys.stderr)
    if result.get("graph_fallback"):
        # the kernel backend cannot render this graph yet (e.g. a scan for Triton)
        timings.update(result.get("timings_ms", {}))
        print(f"[ferrocore:fallback] graph {name} runs eagerly: {result['graph_fallback']}", file=sys.stderr)
        metrics.record(_entry(name, timings, graph_fallback=True, backend=result.get("backend")))
        return make_boxed_func(gm.forward)

    if req.free_layout and req.reported_strides is not None:
        req.reported_strides.extend(result.get("output_strides", ()))
    elif req.free_layout:
        _report_output_strides(result)
    timings.update(result.get("timings_ms", {}))
    fallbacks = result.get("fallbacks", [])
    graph = graph_cache.CompiledGraph(
        name=name,
        module_path=result["module_path"],
        module_source=result["module_source"],
        artifact=result["artifact"],
        artifact_path=result["artifact_path"],
        options=options,
        device=str(device) if device is not None else None,
        host_scalars=list(host_scalars),
        gpu_scalars=_declared_gpu_scalars(gm, host_scalars) if device is not None else [],
        constants=constants,
        counts={
            "kernels": result.get("kernels", 0),
            "externs": result.get("externs", 0),
            "fallbacks": len(fallbacks),
            "fallback_ops": [f["target"] for f in fallbacks],
            "extern_ops": result.get("extern_ops", []),
            "backend": result.get("backend"),
        },
    )
    if req.record is not None:
        req.record(graph)
    return _loaded_call(req, graph, result, opts, device, host_scalars, report_path)


def _run_compiler(name: str, graph_json: str, opts: dict, timings: dict, cpp_later: bool) -> dict:
    """Rust's compile of the serialized graph (its result, parsed), with its logs printed and
    traced; `cpp_later`: its C++ is left for the caller to compile (on a thread of its own)."""
    _ferrocore = extension()
    native_progress = _ferrocore.CompileProgress()
    progress.current().watch(native_progress)
    traced = torch_logs.tracing()
    asked = {**opts, "logs": list(dict.fromkeys([*opts["logs"], *torch_logs.TRACED]))} if traced else opts
    if opts["debug_dir"] is not None:
        asked = {**asked, "front_timings_ms": list(timings.items())}  # for the compile report
    result = json.loads(_ferrocore.compile_graph(graph_json, json.dumps({**asked, "skip_native_compile": True})
                                                 if cpp_later else json.dumps(asked), native_progress))
    logs = result.get("logs", ())
    if traced:
        torch_logs.trace_graph(name, result.get("module_path", ""), logs)
    _print_logs([log for log in logs if log["channel"] in opts["logs"]], name, result.get("module_path", ""),
                result.get("artifact"))
    return result


def _loaded_call(req: CompileRequest, graph, result: dict, opts: dict, device, host_scalars, report_path) -> Callable:
    """The compiled graph loaded and its call wrapped: in a CUDA graph where it may be recorded,
    refusing to run Triton kernels on CPU tensors without Triton's interpreter."""
    gm, timings, name = req.gm, req.timings, graph.name
    call, module = _load_graph(graph, timings, cpp_cache_hit=bool(result.get("cpp_cache_hit", False)),
                               kernels_later=req.kernels_later, cpp_source=result.get("cpp_source"),
                               **({"report_path": report_path} if report_path else {}))
    if opts["cudagraphs"]:
        inputs_meta = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        compiled = artifact.parse(graph.artifact)
        why = cudagraphs.blocker(compiled, device, inputs_meta, bool(host_scalars))
        if why is not None:
            print(f"[ferrocore:cudagraphs] {name} runs without CUDA graphs: {why}", file=sys.stderr)
        else:
            call = cudagraphs.CudaGraphRunner(call, name, device, index_flag=artifact.checks_indices_by_flag(compiled),
                                              copied=_copied_inputs(gm, req.backward, req.static_inputs),
                                              saved=req.saved or (),
                                              donated_writes=artifact.holds_donated_inputs(compiled), family=req.family)
    if device is None and opts["backend"] == "triton" and not _triton_interpreted():
        call = _refusing_uninterpreted_triton(name)
    call._boxed_call = True  # `call(args)` takes the argument list and may clear it
    return call


# what the process has been told once
_said = {"cpu_autotune": False}


def _refusing_uninterpreted_triton(name: str) -> Callable:
    """A CPU graph's Triton module without Triton's interpreter can be generated and imported
    (tests read it, workers compile its kernels for a GPU) but not run: its call says why,
    rather than Triton's "0 active drivers" at the first launch."""

    def call(args, **kw):
        raise _options.OptionError(
            f"ferrocore option 'backend' (FERROCORE_BACKEND): graph {name} is on the CPU, and 'triton' kernels for "
            "CPU tensors run only under Triton's interpreter; set TRITON_INTERPRET=1 before triton is imported, "
            "or use 'auto' or 'cpp'")

    return call


def _load_graph(graph: graph_cache.CompiledGraph, timings: dict, cpp_cache_hit: bool,
                kernels_later: "KernelsLater | None" = None, cpp_source: str | None = None, **fields) -> tuple:
    """Runs a compiled graph's wrapper module (freshly compiled, or from the compiled-graph
    cache): its kernels load from their caches, Triton's are compiled now, or with
    `kernels_later` on its thread while the caller goes on (the caller waits before any launch).
    `cpp_source`: a CPU graph's C++ that `compile_graph` left to compile here; with
    `kernels_later`, it is compiled and the module run on that thread. Returns (the boxed call,
    with host scalars moved and lifted constants appended; the module, or None while the thread
    runs it)."""
    load = _GraphLoad(graph, timings, cpp_cache_hit, fields)
    if cpp_source is not None and kernels_later is not None:
        kernels_later.submit(functools.partial(load.run, cpp_source))

        def call(args, **kw):  # the caller waits for the thread before the first call
            return load.module.call(args, **kw)

        return _with_argument_moves(call, graph), None
    load.run_module(cpp_source)
    # parsed once here and passed on, never kept: the load outlives the compile
    compiled = artifact.parse(graph.artifact) if load.device is not None else None
    if kernels_later is not None and compiled is not None and artifact.has_triton_kernels(compiled):
        kernels_later.submit(functools.partial(load.compile_kernels, compiled))
    else:
        load.compile_kernels(compiled)
    return _with_argument_moves(load.module.call, graph), load.module


class _GraphLoad:
    """Running one compiled graph's wrapper module and compiling its kernels (`_load_graph`),
    on whichever thread does it; records the graph's metrics once done."""

    def __init__(self, graph: graph_cache.CompiledGraph, timings: dict, cpp_cache_hit: bool, fields: dict):
        self.graph, self.timings, self.cpp_cache_hit, self.fields = graph, timings, cpp_cache_hit, fields
        self.opts = json.loads(graph.options)
        self.device = torch.device(graph.device) if graph.device is not None else None
        self.reporter = progress.current()
        self.module = None
        self.ticket = metrics.ticket()

    def run(self, cpp_source: str | None) -> None:
        self.run_module(cpp_source)
        self.compile_kernels()

    def run_module(self, cpp_source: str | None) -> None:
        """Runs the module; `cpp_source` (its kernels' C++, uncompiled so far) is compiled and
        loaded first, timed on its own."""
        graph = self.graph
        self.reporter.stage("loading")
        library = None
        if cpp_source is not None:
            start = time.perf_counter()
            library, self.cpp_cache_hit = cpp_library.load_kernels_reporting(cpp_source, graph.options)
            self.timings["cpp_compile"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        self.module = _import_module(graph.module_path, graph.name, graph.module_source, graph.options, self.opts.get("cache_dir"))
        del library  # the module holds it now
        self.timings["load"] = (time.perf_counter() - start) * 1e3

    def compile_kernels(self, compiled: dict | None = None) -> None:
        """Compiles the GPU graph's Triton kernels (`compiled`: its compiled graph, parsed; None
        on the CPU), then records the graph's metrics."""
        graph, opts, module, timings = self.graph, self.opts, self.module, self.timings
        tuned = {}
        if compiled is not None and artifact.has_triton_kernels(compiled):
            start = time.perf_counter()
            kernels, launchers = artifact.triton_kernels(compiled, module)
            self.reporter.stage("Triton kernels", len(kernels))
            timeline: list = []
            tuned = precompile.precompile_triton(kernels, self.device, launchers,
                                              autotune=opts["autotune"], cache_dir=opts["cache_dir"],
                                              unit=artifact.unit_source(compiled), workers=opts.get("compile_workers", 0),
                                              on_kernel=self.reporter.advance, timeline=timeline)
            if "kernel_compile" in opts["logs"]:
                text = kernel_binaries.timeline_text(graph.name, timeline, start, opts.get("compile_workers", 0))
                print(f"[ferrocore:kernel_compile]\n{text}", file=sys.stderr)
            timings["autotune" if opts["autotune"] else "triton_compile"] = (time.perf_counter() - start) * 1e3
        _cache_trimmer.after_compile(opts["cache_dir"], opts["cache_max_bytes"], not self.cpp_cache_hit)
        metrics.record(_entry(graph.name, timings, cpp_cache_hit=self.cpp_cache_hit, module_path=graph.module_path,
                              artifact_path=graph.artifact_path,
                              **graph.counts, **self.fields, **tuned), self.ticket)


def _with_argument_moves(call: Callable, graph: graph_cache.CompiledGraph) -> Callable:
    """`call`, moving host scalars to the GPU and appending the lifted constants first."""
    device = torch.device(graph.device) if graph.device is not None else None
    host_scalars, gpu_scalars, constants = graph.host_scalars, graph.gpu_scalars, graph.constants
    if host_scalars:
        # ATen lets a 0-d CPU tensor join a CUDA op; a GPU kernel cannot read host memory
        inner_call = call

        def call(args, **kw):
            for i in host_scalars:
                args[i] = args[i].to(device, non_blocking=True)
            return inner_call(args, **kw)
    if gpu_scalars:
        # torch's fake tensors put an attention's saved random-number state (0-d int64) on the
        # GPU; the real one comes on the CPU
        scalar_call = call

        def call(args, **kw):
            for i in gpu_scalars:
                if args[i].device != device:
                    args[i] = args[i].to(device, non_blocking=True)
            return scalar_call(args, **kw)
    if constants:
        # lifted constants are the graph's last inputs (see serialize.lifted_constants)
        inner = call

        def call(args, **kw):
            args.extend(constants)
            return inner(args, **kw)

    return call


# the process's compiles keep the cache under its size limit (`cache.Trimmer`)
_cache_trimmer = _cache.Trimmer()


def _host_scalars(gm: torch.fx.GraphModule) -> tuple:
    """(the graph's GPU device, positions of its 0-d CPU tensor inputs), or (None, []) for a
    graph that touches no GPU."""
    device = None
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                device = v.device
                break
        if device is not None:
            break
    if device is None:
        return None, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # an input the graph writes into stays where it is (a copy on the GPU would take the write)
    written = {n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default}
    host = [
        i for i, n in enumerate(placeholders)
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type == "cpu"
        and n.meta["val"].dim() == 0 and n not in written
    ]
    return device, host


def _declared_gpu_scalars(gm: torch.fx.GraphModule, host: list) -> list:
    """Positions of the 0-d inputs the graph declares on the GPU (other than the host scalars it
    moves there itself): such a tensor may arrive on the CPU, where ATen would take it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if i not in host and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].device.type == "cuda" and n.meta["val"].dim() == 0]


def _move_host_scalars(gm: torch.fx.GraphModule, device: torch.device, host: list) -> None:
    """Declares the 0-d CPU inputs of a GPU graph as GPU tensors (the call moves them there) and
    moves its 0-d CPU constants, so that every kernel reads device memory."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in host:
        _declare_on(placeholders[i], device)
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        *path, leaf = n.target.split(".")
        owner = gm
        for part in path:
            owner = getattr(owner, part)
        t = getattr(owner, leaf)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0:
            # a real copy: the backend may run under dynamo's fake mode, where `.to` is fake
            with unset_fake_temporarily():
                setattr(owner, leaf, t.to(device))
            _declare_on(n, device)
    _move_host_scalar_nodes(gm, device)


def _declare_on(n: torch.fx.Node, device: torch.device) -> None:
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        mode = getattr(val, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            n.meta["val"] = torch.empty((), dtype=val.dtype, device=device)


def _on_cpu_0d(n) -> bool:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dim() == 0


def _move_host_scalar_nodes(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """0-d CPU tensors made inside a GPU graph only to feed GPU ops (`scalar_tensor`/`full` on
    the CPU, a copy of a moved constant) are made on the GPU instead, so that their consumers
    compile rather than fall back on mixed devices. A graph output stays where eager puts it."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not _on_cpu_0d(n):
            continue
        if not n.users or any(u.op == "output" for u in n.users):
            continue
        inputs = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        asked = n.kwargs.get("device")
        if inputs:
            # derived from tensors that now all live on the GPU, with no device of its own
            movable = asked is None and all(a.meta["val"].device.type == device.type for a in inputs)
        else:
            movable = asked is not None and torch.device(asked).type == "cpu"
        if not movable:
            continue
        if asked is not None:
            n.kwargs = {**n.kwargs, "device": device}
        _declare_on(n, device)


def _partitioned(gm: torch.fx.GraphModule, timings: dict, overrides: dict, output_strides: dict | None) -> Callable:
    """A graph with data-dependent sizes or values, cut at each node that binds one
    (`partition.split`): those nodes run as ATen calls, every other segment is compiled (and
    specialized to the concrete values when it reads them)."""
    segments = partition.split(gm)
    name = graph_names.next_name("segments")
    for seg in segments:
        if seg.call is not None:
            target = str(seg.call.target)
            if target in partition.DATA_DEPENDENT_CALLS:
                metrics.record(_entry(f"{name}_{seg.call.name}", {}, externs=1))
            else:
                print(f"[ferrocore:fallback] node {seg.call.name} ({target}) runs through ATen: "
                      "it binds a data-dependent symbol", file=sys.stderr)
                metrics.record(_entry(f"{name}_{seg.call.name}", {}, fallbacks=1, fallback_ops=[target]))
            continue
        module = partition.segment_module(gm, seg)
        if not partition.produces_tensors(seg):
            # host-side scalar arithmetic and runtime asserts on data-dependent sizes
            seg.run = lambda inputs, m=module: list(m(*inputs))
            continue
        seg.run = _compile(CompileRequest(module, timings, overrides, _returned_strides(gm, seg, output_strides)))
        timings = {}
    return partition.runner(gm, segments)


def _returned_strides(gm: torch.fx.GraphModule, seg, output_strides: dict | None) -> dict | None:
    """The strides a segment must give the graph's outputs it computes: eager's where they
    differ from the metadata (`output_strides`), else the graph's metadata. A segment compiled per
    concrete size re-traces its nodes from the tensors earlier segments hand it, whose layouts
    are ferrocore's choice, so the metadata of the re-trace may differ."""
    returned = set(torch.utils._pytree.arg_tree_leaves(*gm.graph.output_node().args))
    strides = dict(output_strides or {})
    for n in seg.outputs:
        val = n.meta.get("val")
        if n in returned and n.name not in strides and isinstance(val, torch.Tensor) \
                and all(isinstance(x, int) for x in (*val.shape, *val.stride())) and is_dense(val.shape, val.stride()):
            strides[n.name] = list(val.stride())
    return strides or None


def _is_symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph has symbolic sizes (dynamic shapes): SymInt inputs or tensors whose
    sizes or strides are symbols."""
    sym = (torch.SymInt, torch.SymFloat, torch.SymBool)
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if isinstance(val, sym):
            return True
        if isinstance(val, torch.Tensor) and any(
            isinstance(s, sym) for s in (*val.shape, *val.stride(), val.storage_offset())
        ):
            return True
    return False


def _specializing(gm: torch.fx.GraphModule, timings: dict, overrides: dict,
                  output_strides: dict | None = None) -> Callable:
    """A graph with dynamic shapes runs as one static compilation per distinct input signature
    (sizes, strides, dtypes and the values of integer inputs): at the first call with a new
    signature the graph is re-traced with those inputs, so every sym_size / sym_stride /
    sym_numel / sym_storage_offset becomes a constant, and compiled like any static graph,
    named after the symbolic graph's compile (`<base>_inference_1`, ...), not `graph_<n>`."""
    compiled: dict = {}
    base = graph_names.current_base()

    def call(args):
        key = tuple(
            (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device.type)
            if isinstance(a, torch.Tensor)
            else (type(a).__name__, a)
            for a in args
        )
        fn = compiled.get(key)
        if fn is None:
            with graph_names.naming(base):
                fn = _specialization(compiled, key, gm, args, timings, overrides, output_strides)
        return fn(args)

    call._boxed_call = True
    return call


# Static compilations kept per symbolic graph. Data-dependent sizes (`partition`) can make every
# call a new signature; past this many, new signatures run eagerly instead of recompiling.
SPECIALIZATION_LIMIT = 32


def _specialization(compiled: dict, key: tuple, gm: torch.fx.GraphModule, args: list, timings: dict,
                    overrides: dict, output_strides: dict | None) -> Callable:
    """The compilation for a new input signature, made under torch's compile lock: `make_fx`
    (as dynamo's own tracing) patches module-level state of torch.fx (`CURRENT_PATCHER`), so
    two traces at once in different threads break each other, and dynamo traces under this
    lock. A thread that waited for the lock finds a signature another one compiled meanwhile:
    each signature is compiled once. The lock is reentrant (a trace that calls a compiled
    function in the same thread does not wait for itself)."""
    with _compile_lock:
        fn = compiled.get(key)
        if fn is None:
            previous = next(reversed(compiled), None)
            if len(compiled) >= SPECIALIZATION_LIMIT:
                fn = _eager_beyond_limit(gm, timings)
            else:
                fn = _specialize(gm, list(args), dict(timings), overrides, output_strides)
            compiled[key] = fn
            _announce_specialization(previous, key, len(compiled), overrides)
    return fn


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


def _announce_specialization(previous: tuple | None, key: tuple, count: int, overrides: dict) -> None:
    """Counts a dynamic-shape graph's compile for a signature after its first (`recompiles` in
    the metrics) and logs each on the `recompiles` channel, with what changed."""
    if previous is not None:
        metrics.count("recompiles")
    if "recompiles" not in _options.build_options(overrides)["logs"]:
        return
    why = "its first call" if previous is None else _signature_change(previous, key)
    done = (f"compiled as {metrics.last.get('name')}" if count <= SPECIALIZATION_LIMIT
            else "beyond the limit, run eagerly")
    print(f"[ferrocore:recompiles] a dynamic-shape graph's signature {count}, {done}: {why}", file=sys.stderr)


def _signature_change(old: tuple, new: tuple) -> str:
    """What differs between two input signatures (as `_specializing` keys them)."""
    fields = ("sizes", "strides", "offset", "dtype", "device")
    changes = []
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if len(a) == len(b) == len(fields):
            changes += [f"input {i} {name} {x} -> {y}" for name, x, y in zip(fields, a, b) if x != y]
        else:
            changes.append(f"input {i} ({a[0]}) {a[-1]!r} -> {b[-1]!r}")
    return "; ".join(changes)


try:
    from torch._dynamo.convert_frame import compile_lock as _compile_lock
except ImportError:  # a torch without it: a lock of ferrocore's own
    import threading

    _compile_lock = threading.RLock()


def _eager_beyond_limit(gm: torch.fx.GraphModule, timings: dict) -> Callable:
    name = graph_names.next_name("eager")
    print(f"[ferrocore:fallback] graph {name} runs eagerly: more than {SPECIALIZATION_LIMIT} "
          "input signatures of one symbolic graph", file=sys.stderr)
    metrics.record(_entry(name, dict(timings), graph_fallback=True))

    def run(args):
        return list(gm(*args))

    return run


def _specialize(gm: torch.fx.GraphModule, args: list, timings: dict, overrides: dict,
                output_strides: dict | None = None) -> Callable:
    """One static compilation of `gm` for `args`. `output_strides` ({output node name: eager's
    stride}) carries over to the re-traced graph's outputs by position (the trace names its
    nodes anew)."""
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    scalars = {i: a for i, a in enumerate(args) if i not in tensor_pos}

    def with_scalars(*tensors):
        full = [scalars.get(i) for i in range(len(args))]
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        return gm(*full)

    start = time.perf_counter()
    static = make_fx(with_scalars, tracing_mode="fake")(*[args[i] for i in tensor_pos])
    timings["specialize"] = (time.perf_counter() - start) * 1e3
    _fold_constant_asserts(static)
    # non-tensor outputs (sizes saved for backward) are now constants: returned from Python
    out_node = static.graph.output_node()
    flat = list(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    tensor_out = [i for i, v in enumerate(flat) if isinstance(v, torch.fx.Node)]
    if len(tensor_out) != len(flat):
        out_node.args = ([flat[i] for i in tensor_out],)
        static.recompile()
    traced_outputs = torch.utils._pytree.arg_tree_leaves(*gm.graph.output_node().args)
    strides = {flat[i].name: output_strides[o.name] for i, o in enumerate(traced_outputs)
               if i in tensor_out and isinstance(o, torch.fx.Node) and o.name in (output_strides or {})}
    inner = _compile(CompileRequest(static, timings, overrides, strides or None))

    def run(call_args):
        results = inner([call_args[i] for i in tensor_pos])
        out = list(flat)
        for i, r in zip(tensor_out, results):
            out[i] = r
        return out

    return run


def _unwrap_effects(gm: torch.fx.GraphModule) -> None:
    """AOT autograd threads a token through ops with side effects (`with_effects(token, op,
    *args)`, e.g. `_linalg_check_errors`) so that they stay ordered and alive. The wrapper runs
    steps in graph order and keeps calls without results, so the op becomes a plain call and the
    returned token is the token that came in."""
    effects = getattr(torch.ops.higher_order, "with_effects", None)
    changed = False
    for n in list(gm.graph.nodes):
        if effects is None or n.op != "call_function" or n.target is not effects:
            continue
        if any(u.target is not operator.getitem for u in n.users):
            continue  # an unexpected use: leave this node as it is (the graph then runs eagerly)
        token, op, *args = n.args
        results = list(n.meta.get("val") or ())[1:]
        with gm.graph.inserting_before(n):
            call = gm.graph.call_function(op, tuple(args), dict(n.kwargs))
        call.meta["val"] = None if not results else results[0] if len(results) == 1 else tuple(results)
        for user in list(n.users):
            index = user.args[1]
            if index == 0:
                user.replace_all_uses_with(token)
            elif len(results) == 1:
                user.replace_all_uses_with(call)
            else:
                with gm.graph.inserting_before(user):
                    item = gm.graph.call_function(operator.getitem, (call, index - 1))
                item.meta = dict(user.meta)
                user.replace_all_uses_with(item)
            gm.graph.erase_node(user)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()


_CLAMPS = {
    torch.ops.aten.clamp.default: (1, 2),
    torch.ops.aten.clamp_min.default: (1,),
    torch.ops.aten.clamp_max.default: (1,),
}


@functools.lru_cache(None)
def _eager_wraps_clamp_bounds() -> bool:
    """Whether this torch's clamp converts an integer bound past the tensor's range to the
    tensor's type, wrapping (torch 2.11: clamp(uint8, min=-1) is 255 everywhere), rather than
    letting it bound nothing (later versions keep the values)."""
    try:
        return int(torch.clamp(torch.tensor([4], dtype=torch.uint8), min=-1)) == 255
    except RuntimeError:
        return False


def _wrap_integer_clamp_bounds(gm: torch.fx.GraphModule) -> None:
    """Gives clamps of integer tensors the bounds eager's kernel uses, where this torch wraps an
    out-of-range bound into the type (the lowering lets such a bound clamp nothing)."""
    changed = False
    for n in gm.graph.nodes:
        positions = _CLAMPS.get(n.target) if n.op == "call_function" else None
        val = n.meta.get("val")
        if positions is None or not isinstance(val, torch.Tensor) or val.dtype.is_floating_point \
                or val.dtype in (torch.bool, torch.int64) or not _eager_wraps_clamp_bounds():
            continue
        info = torch.iinfo(val.dtype)
        args = list(n.args)
        for i in positions:
            bound = args[i] if i < len(args) else None
            if isinstance(bound, int) and not isinstance(bound, bool) and not info.min <= bound <= info.max:
                span = info.max - info.min + 1
                args[i] = (bound - info.min) % span + info.min
                changed = True
        n.args = tuple(args)
    if changed:
        gm.recompile()


_ASSERTS = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def _fold_constant_asserts(gm: torch.fx.GraphModule) -> None:
    """Runtime asserts on sizes that specialization made constant: checked now, then removed."""
    folded = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _ASSERTS and not n.users and not n.all_input_nodes:
            n.target(*n.args, **n.kwargs)  # raises if the specialized values break the assert
            gm.graph.erase_node(n)
            folded = True
    if folded:
        gm.recompile()


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _entry(name: str, timings: dict, **fields) -> dict:
    entry = {
        "name": name,
        "kernels": 0,
        "externs": 0,
        "fallbacks": 0,
        "fallback_ops": [],
        "graph_fallback": False,
        "timings_ms": timings,
        "cpp_cache_hit": False,
    }
    entry.update(fields)
    return entry


def _module_code(source: str, path: str, cache_dir: str | None):
    """The module's code object, compiled once and then read back from the cache: `compile` of a
    GPU graph's module (thousands of lines) is a large part of a warm start. marshal's format,
    signed and verified like every cache entry, keyed by the source, the file name its
    tracebacks report and the interpreter's version."""
    if not cache_dir:
        return compile(source, path, "exec")
    _ferrocore = extension()
    key = hashlib.sha256("\0".join((sys.version, path, source)).encode()).hexdigest()
    rel = f"bytecode/{key[:2]}/{key}.marshal"
    data = _ferrocore.cache_read(cache_dir, rel)
    if data is not None:
        try:
            return marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            pass  # (verified, but not this interpreter's: compiled again and rewritten)
    code = compile(source, path, "exec")
    try:
        _ferrocore.cache_write(cache_dir, rel, marshal.dumps(code))
    except Exception:  # noqa: BLE001 - a cache that cannot be written costs only the compile
        pass
    return code


def _import_module(path: str, name: str, source: str, options: str | None, cache_dir: str | None = None):
    """Runs the wrapper module's source as the compiler returned it, never what the cached file
    holds by now (an edited or planted file runs nothing; Rust rewrites it). The file name is
    the cached path, for tracebacks; `linecache` holds this very source under it, so tracebacks
    and `inspect` (Triton reads its kernels' source) see what runs. The module is not kept in
    `sys.modules`: it lives as long as the graph's callable, and its kernel library with it.
    `options` (the compile's options JSON) reach the module as `__ferrocore_options__`: its C++
    library is looked up in that compile's cache, with its compiler (None: the environment's)."""
    mod_name = f"ferrocore_output_code_{name}"
    module = types.ModuleType(mod_name)
    module.__file__ = path
    module.__ferrocore_options__ = options
    code = _module_code(source, path, cache_dir)
    _hold_source(path, source, module.__dict__)
    sys.modules[mod_name] = module  # while it runs: a module may look itself up
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules.pop(mod_name, None)
    return module


class _SourceLease:
    """Kept in a wrapper module's globals: when they go, so does its source in `linecache`."""

    __slots__ = ("__weakref__",)


_held_sources: dict = {}  # path -> number of live modules run from it


def _hold_source(path: str, source: str, module_globals: dict) -> None:
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    _held_sources[path] = _held_sources.get(path, 0) + 1
    lease = module_globals["__ferrocore_source_lease__"] = _SourceLease()
    weakref.finalize(lease, _release_source, path)


def _release_source(path: str) -> None:
    left = _held_sources.get(path, 0) - 1
    if left > 0:
        _held_sources[path] = left
        return
    _held_sources.pop(path, None)
    linecache.cache.pop(path, None)


def _print_logs(logs, name: str, module_path: str = "", compiled: str | None = None) -> None:
    """Graph `name`'s channel texts on stderr, each block headed by its channel and graph (and
    for output_code, the module's file); `compiled`: its compiled graph's text (for its C++
    prelude)."""
    channel = None
    for log in logs:
        if log["channel"] != channel:
            channel = log["channel"]
            where = f" ({module_path})" if channel == "output_code" and module_path else ""
            print(f"[ferrocore:{channel}] {name}{where}", file=sys.stderr)
        text = _prelude_once(log["text"], name, compiled) if channel == "output_code" and compiled else log["text"]
        print(text.rstrip("\n"), file=sys.stderr)


# the preludes printed on the output_code channel so far in this process -> the graph that showed it
_preludes_shown: dict = {}


def _prelude_once(module_text: str, name: str, compiled_text: str) -> str:
    """Graph `name`'s output_code module with its C++ prelude (some 200 lines, the same for every
    graph) cut to one line after the first graph that printed it; the debug dumps keep it."""
    compiled = artifact.parse(compiled_text)
    prelude = artifact.prelude(compiled) if compiled["language"] == "cpp" else ""
    if not prelude or prelude not in module_text:
        return module_text
    shown = _preludes_shown.setdefault(prelude, name)
    if shown == name:
        return module_text
    return module_text.replace(prelude, f"// (the C++ prelude: {prelude.count(chr(10))} lines, as printed with {shown})\n", 1)


_start_compile_workers_early()
