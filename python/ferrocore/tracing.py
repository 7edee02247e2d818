"""Tracing: a Dynamo graph to the ATen graphs the compiler takes.

Directly (`direct_trace`: an inference graph, or a training graph's joint graph split by
`joint_split` into a forward compiled now and a backward compiled at its first call,
`LazyBackward`), else through AOT autograd (`_aot_autograd`, its min-cut partitioner,
`decompositions`); the strides each graph's outputs must keep; the compiled graphs stored in the
compiled-graph cache once they exist. Each ATen graph goes to the dynamic-shape dispatch
(`dispatch.compile_request`) as a `static_compile.CompileRequest`.

Below the entry (`backend`), above the dispatch: it imports the dispatch, the static compile and
the runtime, never the entry (tests/test_front_imports.py).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
from typing import Callable

import torch
from torch._dynamo import disable
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition

from . import conv_layout, decompositions, direct_trace, dispatch, graph_names, joint_split, padding, progress
from .metrics import metrics
from .runtime import aot_runtime, cudagraphs, graph_cache
from .serialize import lend_forward_lines
from .static_compile import CompileRequest, KernelsLater
from .strides import is_dense


# the collector's generation-2 threshold during a compile: a full collection after this many
# generation-1 collections (CPython's default is 10)
_FULL_COLLECTION_DEFERRED = 1000


@contextlib.contextmanager
def collector_spared():
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


def compile_traced(gm: torch.fx.GraphModule, example_inputs, opts: dict, overrides: dict, cache_key: str | None,
                   boxed: bool, facts: dict) -> Callable:
    """Traces one Dynamo graph to ATen and compiles what it gives: directly where it can
    (`_traced_directly`), else through AOT autograd, whose forward, backward and inference graphs
    each go to the dynamic-shape dispatch (`dispatch.compile_request`). `cache_key`: the
    compiled-graph cache's key, where the graphs are stored once compiled. Sets
    `facts["written"]` to the positions of the inputs the graph writes into."""
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
        request = CompileRequest(graph, state.take(), overrides, strides, free_layout=_free_layout(saved),
                                 saved=saved, family=family, record=recorded["graphs"].append)
        return dispatch.compile_request(request)

    def inference(graph, inputs):
        facts["written"] = aot_runtime.written_inputs(len(example_inputs))
        _describe_runtime(recorded, aot_runtime.inference_runtime)
        strides = _visible_output_strides(graph, user_strides, inference=True)
        request = CompileRequest(graph, state.take(), overrides, strides, record=recorded["graphs"].append)
        recorded["call"] = dispatch.compile_request(request)
        return recorded["call"]

    base = graph_names.current_base()

    def backward(graph, inputs):
        _take_input_strides(graph, inputs)
        donated = _donated_inputs()
        # AOT autograd may compile the backward at its first call, outside the forward's line
        with progress.compiling(label + " (backward)", opts["progress"]), collector_spared(), \
                graph_names.naming(base):
            request = CompileRequest(graph, state.take(), overrides, donated=donated, backward=True, family=family,
                                     record=recorded["graphs"].append)
            compiled = dispatch.compile_request(request)
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
            decompositions=decompositions.decompositions(training=_needs_grad(example_inputs)),
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
                traced = direct_trace.trace_joint(gm, example_inputs, decompositions.decompositions(training=True),
                                                  logs=tuple(opts["logs"]), backend=opts["backend"])
                traced_ms = (time.perf_counter() - start) * 1e3
                gemms = padding.Measurements(traced.graph, opts)  # for both graphs' padding
                if gpu_of(example_inputs) is None:
                    conv_layout.measure_ahead(traced.graph, opts)
                parts = joint_split.split(traced.graph, traced.num_outputs, len(traced.requires_grad),
                                          set(direct_trace.static_inputs(gm)), set(traced.written))
            else:
                traced = direct_trace.trace(gm, example_inputs, decompositions.decompositions(training=False))
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
        request = CompileRequest(traced, {"trace": traced_ms}, overrides, strides,
                                 static_inputs=direct_trace.static_inputs(gm), record=recorded["graphs"].append)
        call = dispatch.compile_request(request)
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
        fw_call = dispatch.compile_request(CompileRequest(parts.forward, {"trace": traced_ms + split_ms}, overrides,
                                                          strides, free_layout=saved, saved=saved, family=family,
                                                          record=recorded["graphs"].append, static_inputs=static,
                                                          reported_strides=reported, kernels_later=later,
                                                          measured=gemms))
    finally:
        later.wait()
    _restride_saved(parts.backward, reported[joint.num_outputs:])
    runtime = aot_runtime.direct_training_runtime(joint, parts.saved_is_input, example_inputs, joint.unsafe_views)
    recorded["runtime"] = aot_runtime.add_backward(runtime, parts.backward, None, parts.donated)
    base = graph_names.current_base()

    def compile_backward() -> Callable:
        with progress.compiling(label + " (backward)", opts["progress"]), collector_spared(), \
                graph_names.naming(base):
            bw_call = dispatch.compile_request(CompileRequest(parts.backward, {}, overrides, donated=parts.donated,
                                                              backward=True, family=family,
                                                              record=recorded["graphs"].append, measured=gemms))
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


def gpu_of(example_inputs) -> torch.device | None:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)


def _describe_runtime(recorded: dict, describe: Callable) -> None:
    """Records AOT autograd's runtime for the cache entry, or why it cannot be rebuilt."""
    if recorded["bypass"] is not None:
        return
    try:
        recorded["runtime"] = describe()
    except graph_cache.Bypass as e:
        recorded["bypass"], recorded["runtime"] = str(e), None


def _store_graph(cache_key: str, opts: dict, recorded: dict, kind: str) -> bool:
    """Stores the compiled graphs; False when they are not cacheable (partitioned, specialized
    or eager graphs, an AOT runtime `aot_runtime` cannot rebuild)."""
    why = recorded["bypass"]
    if why is None and (recorded["runtime"] is None or len(recorded["graphs"]) != graph_cache.ENTRY_GRAPHS[kind]):
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


def _needs_grad(example_inputs) -> bool:
    """Whether AOT autograd will trace a joint graph (as its own test does)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


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


def _donated_inputs() -> list:
    """The backward's input positions AOT autograd donates: saved activations nothing else holds
    once it calls the backward (none when the graph may run backward again: retain_graph)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    return list(getattr(meta, "bw_donated_idxs", None) or [])
