"""The dynamic-shape dispatch: one ATen graph (a `static_compile.CompileRequest`) to a call.

A graph with data-dependent sizes is cut into segments between the calls that make them
(`partition`); one with symbolic sizes is compiled once per input signature it is called with
(`_specializing`, re-traced with `make_fx` under torch's compile lock); a static one goes
straight to the static compile (`static_compile.compile_static`).

Below tracing, above the static compile: it imports the static compile and the runtime, never
tracing or the entry (tests/test_front_imports.py).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from . import graph_names, partition
from . import options as _options
from .metrics import metrics
from .static_compile import CompileRequest, compile_static, metrics_entry
from .strides import is_dense


def compile_request(req: CompileRequest) -> Callable:
    """Compiles one ATen graph: a graph with data-dependent sizes in segments between the calls
    that make them, one with symbolic sizes once per shape it is called with (each a static
    compile again), a static one at once (`static_compile.compile_static`)."""
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
    return compile_static(req, _options.build_options(overrides))


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
                metrics.record(metrics_entry(f"{name}_{seg.call.name}", {}, externs=1))
            else:
                print(f"[ferrocore:fallback] node {seg.call.name} ({target}) runs through ATen: "
                      "it binds a data-dependent symbol", file=sys.stderr)
                metrics.record(metrics_entry(f"{name}_{seg.call.name}", {}, fallbacks=1, fallback_ops=[target]))
            continue
        module = partition.segment_module(gm, seg)
        if not partition.produces_tensors(seg):
            # host-side scalar arithmetic and runtime asserts on data-dependent sizes
            seg.run = lambda inputs, m=module: list(m(*inputs))
            continue
        seg.run = compile_request(CompileRequest(module, timings, overrides,
                                                 _returned_strides(gm, seg, output_strides)))
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
    metrics.record(metrics_entry(name, dict(timings), graph_fallback=True))

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
    inner = compile_request(CompileRequest(static, timings, overrides, strides or None))

    def run(call_args):
        results = inner([call_args[i] for i in tensor_pos])
        out = list(flat)
        for i, r in zip(tensor_out, results):
            out[i] = r
        return out

    return run


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
