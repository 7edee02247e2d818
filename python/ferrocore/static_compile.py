"""The static compile: one ATen graph of static sizes, taken as one request
(`CompileRequest`), to a loaded, callable compiled graph.

`compile_static` prepares the graph (`prepare`), serializes it, has Rust compile it
(`_run_compiler`), and loads and wraps the result (`_loaded_call`: CUDA graphs where they may
record); `load_graph` runs a compiled graph's wrapper module and compiles its Triton kernels (for
a fresh compile, or a compiled-graph cache hit).

Below the dispatch: it imports the runtime and the compile layer's own modules (`prepare`,
`padding`, `conv_layout`), never the dispatch, tracing or the entry
(tests/test_front_imports.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import linecache
import marshal
import os
import sys
import time
import types
import weakref
from typing import Callable

import torch
from torch._functorch.aot_autograd import make_boxed_func

from . import artifact, graph_names, padding, prepare, progress, torch_logs
from . import options as _options
from .extension import extension
from .metrics import metrics
from .runtime import cache as _cache
from .runtime import cpp_library, cudagraphs, graph_cache, kernel_binaries, precompile
from .serialize import UnsupportedGraph, lifted_constants, serialize_graph


@dataclasses.dataclass
class CompileRequest:
    """One ATen graph to compile and what its caller knows and wants of it. `record` receives
    the CompiledGraph (static graphs only, the compiled-graph cache's entries).
    `static_inputs`: the inputs that keep their addresses across calls (parameters, buffers),
    when AOT autograd's metadata does not say. `reported_strides` receives the strides the
    compiled graph writes its outputs with (where `free_layout` let ferrocore choose them);
    otherwise AOT autograd is told. `kernels_later`: see `load_graph`; `measured`: GEMM
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
    # the graph's name, where it is not one of the model's (`graph_names`)
    name: str | None = None


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


def compile_static(req: CompileRequest, opts: dict) -> Callable:
    """Compiles a graph of static sizes: prepares it (host scalars, GEMM padding, convolution
    layout), serializes it, has Rust compile it, loads the result and wraps its call."""
    gm, timings = req.gm, req.timings
    name = req.name or graph_names.next_name("bw" if req.backward else "fw" if req.saved is not None else "inference")
    start = time.perf_counter()
    device, host_scalars, gemms, opts, excluded = prepare.prepare(gm, name, opts, timings, req.measured, _compile_region)
    start += excluded
    try:
        graph_json = serialize_graph(gm, name, req.output_strides, req.free_layout, donated_inputs=req.donated, **gemms)
        constants = lifted_constants(gm)
    except UnsupportedGraph as e:
        print(f"[ferrocore:fallback] graph {name} runs eagerly: {e.reason}", file=sys.stderr)
        metrics.record(metrics_entry(name, timings, graph_fallback=True))
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
        metrics.record(metrics_entry(name, timings, graph_fallback=True, backend=result.get("backend")))
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
        gpu_scalars=prepare.declared_gpu_scalars(gm, host_scalars) if device is not None else [],
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


def _compile_region(gm: torch.fx.GraphModule, opts: dict) -> Callable:
    """A graph cut out of another to time one of its choices (`gemm_choice`), compiled as it is
    told (nothing measured again); its call takes a list."""
    return compile_static(CompileRequest(gm, {}, {}, name="gemm_choice"), opts)


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
    print_logs([log for log in logs if log["channel"] in opts["logs"]], name, result.get("module_path", ""),
                result.get("artifact"))
    return result


def _loaded_call(req: CompileRequest, graph, result: dict, opts: dict, device, host_scalars, report_path) -> Callable:
    """The compiled graph loaded and its call wrapped: in a CUDA graph where it may be recorded,
    refusing to run Triton kernels on CPU tensors without Triton's interpreter."""
    gm, timings, name = req.gm, req.timings, graph.name
    call, module = load_graph(graph, timings, cpp_cache_hit=bool(result.get("cpp_cache_hit", False)),
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


def load_graph(graph: graph_cache.CompiledGraph, timings: dict, cpp_cache_hit: bool,
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
    """Running one compiled graph's wrapper module and compiling its kernels (`load_graph`),
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
        metrics.record(metrics_entry(graph.name, timings, cpp_cache_hit=self.cpp_cache_hit, module_path=graph.module_path,
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


def _report_output_strides(result: dict) -> None:
    """Tells AOT autograd the strides the forward returns its outputs with, so that the backward
    is compiled for the layout of the activations it receives."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and getattr(ctx, "output_strides", None) is not None and not ctx.output_strides:
        ctx.output_strides.extend(tuple(s) if s is not None else None for s in result.get("output_strides", ()))


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


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def metrics_entry(name: str, timings: dict, **fields) -> dict:
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


def print_logs(logs, name: str, module_path: str = "", compiled: str | None = None) -> None:
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
