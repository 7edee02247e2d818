"""Graphs with data-dependent values (unbacked symbols), split into statically compilable segments.

With `torch._dynamo.config.capture_scalar_outputs` / `capture_dynamic_output_shape_ops`, dynamo
hands over graphs in which a node's *value* decides later sizes: `nonzero`, `masked_select`,
`Tensor.item()` (`_local_scalar_dense`), `unique`, ... Their results carry unbacked symbols
(`u0`) that no input signature fixes, so such a graph cannot be specialized as a whole.

The graph is cut after every node whose data decides a new unbacked symbol (`reads_data`). Each such node runs as an
ATen call between the segments (a library call; see docs/externs.md); every other segment is an
ordinary graph handed to `dispatch.compile_request`, which specializes it per input signature. Once the
data-dependent values are concrete (real tensors, Python numbers), they are part of the next
segment's signature, so every kernel is still compiled for static sizes.

This module only cuts and runs; it never decides what ferrocore can compile.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .serialize import module_attr

# Data-dependent overloads that run as library calls between segments (counted as externs):
# their result size or value is the data-dependent part, computed by ATen.
DATA_DEPENDENT_CALLS = {
    "aten.nonzero.default",
    "aten._local_scalar_dense.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
    "aten.index.Tensor",  # only ever cut here with a boolean mask index: x[mask]
}


def _unbacked(value: Any) -> set:
    if isinstance(value, torch.Tensor) and _static_layout(value):
        return set()  # most values: walking them for symbols costs more than the rest of the check
    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # values free_unbacked_symbols does not walk (None, strings, devices)
        return set()


def _static_layout(t: torch.Tensor) -> bool:
    try:
        return all(type(x) is int for x in (*t.shape, *t.stride(), t.storage_offset()))
    except (RuntimeError, NotImplementedError):  # layouts without strides (sparse, nested)
        return False


def binds_unbacked(node: torch.fx.Node) -> bool:
    """Whether `node` introduces a data-dependent symbol its inputs do not already carry."""
    if node.op != "call_function":
        return False
    if node.meta.get("unbacked_bindings"):
        return True
    own = _unbacked(node.meta.get("val"))
    if not own:
        return False
    seen: set = set()
    for inp in node.all_input_nodes:
        seen |= _unbacked(inp.meta.get("val"))
    return bool(own - seen)


def reads_data(node: torch.fx.Node) -> bool:
    """Whether the graph is cut after `node`: it binds an unbacked symbol whose value only the
    data can tell (`nonzero`'s count, `item()`'s value). A node that binds one from symbolic
    arguments (`slice` at a start taken from `item()`) is not: once its arguments are concrete,
    specialization makes its sizes static."""
    if not binds_unbacked(node):
        return False
    tags = getattr(node.target, "tags", ())
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return True
    return not any(_unbacked(inp.meta.get("val")) for inp in node.all_input_nodes)


def has_data_dependent_nodes(gm: torch.fx.GraphModule) -> bool:
    return any(reads_data(n) for n in gm.graph.nodes)


@dataclass
class Segment:
    """A run of nodes in graph order: compiled as a graph (`call` is None) or one data-dependent
    ATen call (`call`), with the getitems that unpack its result."""

    nodes: list = field(default_factory=list)
    call: torch.fx.Node | None = None
    inputs: list = field(default_factory=list)   # nodes defined earlier (or placeholders)
    outputs: list = field(default_factory=list)  # nodes read later (or returned)
    run: Callable | None = None


def split(gm: torch.fx.GraphModule) -> list[Segment]:
    """Cuts `gm` after every node that reads data into an unbacked symbol; computes each segment's inputs
    and outputs. get_attr nodes are copied into every segment that reads them."""
    segments: list[Segment] = [Segment()]
    owner: dict = {}  # node -> segment index
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        src = n.args[0] if n.target is operator.getitem and n.args else None
        if isinstance(src, torch.fx.Node) and src in owner and segments[owner[src]].call is not None:
            segments[owner[src]].nodes.append(n)  # unpacked in Python, next to the call
            owner[n] = owner[src]
        elif reads_data(n):
            segments.append(Segment(nodes=[n], call=n))
            owner[n] = len(segments) - 1
            segments.append(Segment())
        else:
            segments[-1].nodes.append(n)
            owner[n] = len(segments) - 1
    segments = [s for s in segments if s.nodes]
    owner = {n: i for i, s in enumerate(segments) for n in s.nodes}

    returned = set(gm.graph.output_node().all_input_nodes)
    for i, s in enumerate(segments):
        members = set(s.nodes)
        for n in s.nodes:
            for inp in n.all_input_nodes:
                if inp not in members and inp.op != "get_attr" and inp not in s.inputs:
                    s.inputs.append(inp)
            if n in returned or any(owner.get(u, i) != i for u in n.users):
                s.outputs.append(n)
    return segments


def segment_module(gm: torch.fx.GraphModule, seg: Segment) -> torch.fx.GraphModule:
    """The segment as a GraphModule of its own: placeholders for its inputs (with their
    metadata), its nodes, and its outputs returned as a tuple."""
    graph = torch.fx.Graph()
    env: dict = {}
    for inp in seg.inputs:
        ph = graph.placeholder(inp.name)
        ph.meta = dict(inp.meta)
        env[inp] = ph

    def value(x):
        if x not in env:  # a get_attr read by this segment
            env[x] = graph.node_copy(x, value)
        return env[x]

    for n in seg.nodes:
        env[n] = graph.node_copy(n, value)
    graph.output(tuple(env[n] for n in seg.outputs))
    return torch.fx.GraphModule(gm, graph)


def produces_tensors(seg: Segment) -> bool:
    return any(isinstance(n.meta.get("val"), torch.Tensor) for n in seg.nodes)


def run_call(seg: Segment, env: dict) -> list:
    """Runs a data-dependent segment: the ATen call, then the getitems on its result."""
    local = dict(env)
    for n in seg.nodes:
        args = torch.fx.node.map_arg(n.args, lambda x: local[x])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda x: local[x])
        local[n] = n.target(*args, **kwargs)
    return [local[n] for n in seg.outputs]


def runner(gm: torch.fx.GraphModule, segments: list[Segment]) -> Callable:
    """A boxed `call(args)` that runs the segments in order, passing values between them and
    dropping each value after its last reader."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_args = gm.graph.output_node().args[0]
    last_reader: dict = {}
    for i, s in enumerate(segments):
        for inp in s.inputs:
            last_reader[inp] = i
    returned = set(gm.graph.output_node().all_input_nodes)
    dying = [[n for n in s.inputs if last_reader[n] == i and n not in returned] for i, s in enumerate(segments)]

    constants = {n: module_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}

    def call(args):
        env = dict(constants)
        env.update(zip(placeholders, args))
        args.clear()
        for i, s in enumerate(segments):
            if s.call is not None:
                results = run_call(s, env)
            else:
                results = s.run([env[n] for n in s.inputs])
            for n, v in zip(s.outputs, results):
                env[n] = v
            for n in dying[i]:
                env.pop(n, None)
        out = torch.fx.node.map_arg(out_args, lambda x: env[x])
        return list(out) if isinstance(out, (list, tuple)) else [out]

    call._boxed_call = True
    return call
