"""A directly traced training graph (`direct_trace.trace_joint`) split into its forward and
backward graphs, as AOT autograd's min-cut partitioner splits the joint graphs it traces.

First, common subexpressions are merged (the backward formulas recompute what the forward
computed: a normalization's centred input, a mask's comparison). Then the compiler chooses the
activations the forward saves (`ferrocore::joint`: a minimum cut over the joint graph, given each
value's op, inputs and bytes, on the compiler's own model of what its kernels fuse), and the
joint graph is cut there into two FX graphs: the forward returns the user's outputs and the
saved values, the backward takes the saved values and the tangents.
"""

from __future__ import annotations

import dataclasses
import json
import operator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from .direct_trace import NeedsAot, graph_module
from .extension import extension
from .serialize import UnsupportedGraph, target_name

aten = torch.ops.aten


@dataclasses.dataclass
class Split:
    forward: torch.fx.GraphModule  # outputs: the user's outputs, then the saved values
    backward: torch.fx.GraphModule  # placeholders: the saved values, then the tangents
    saved_is_input: list  # per saved value: whether it is a primal
    donated: list  # backward input positions nothing else holds (it may write into them)


def split(joint: torch.fx.GraphModule, num_outputs: int, num_primals: int, free_inputs: set,
          written: set) -> Split:
    """Splits the joint graph; `free_inputs`: primal positions that cost nothing to save
    (parameters and buffers, alive anyway); `written`: those the forward writes into (the
    backward cannot read their old value from them)."""
    graph = joint.graph
    eliminate_common_subexpressions(graph)
    nodes = list(graph.nodes)
    outputs = list(nodes[-1].args[0])
    user, grads = outputs[:num_outputs], outputs[num_outputs:]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    primals, tangents = placeholders[:num_primals], placeholders[num_primals:]
    copies = [n for n in nodes if n.op == "call_function" and n.target is aten.copy_.default]
    saved = _saved_values(nodes, num_outputs, num_primals, free_inputs, written)

    forward = _extract(joint, nodes, [*user, *saved], primals, effects=tuple(copies))
    backward_graph = _extract(joint, nodes, grads, [*saved, *tangents])
    return Split(forward, backward_graph, [n.op == "placeholder" for n in saved],
                 _donated(saved, user, primals))


def eliminate_common_subexpressions(graph: torch.fx.Graph) -> None:
    """Merges pure nodes that apply the same op to the same arguments (in place)."""
    seen: dict = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pure(node.target):
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
            other = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument
            continue
        if other is not node:
            node.replace_all_uses_with(other)
            graph.erase_node(node)


def _key(value):
    """A hashable stand-in for an argument that tells apart what compares equal but differs
    (0.0 and -0.0, True and 1)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_key, value))
    if isinstance(value, dict):
        return ("dict", *((k, _key(v)) for k, v in sorted(value.items())))
    if isinstance(value, (bool, int, float)):
        return (type(value).__name__, repr(value))
    return value


def _pure(target) -> bool:
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)


# ---- the cut -----------------------------------------------------------------------------------


def _saved_values(nodes: list, num_outputs: int, num_primals: int, free_inputs: set, written: set) -> list:
    """The values the forward saves, as the compiler's minimum cut (`ferrocore::joint`) chooses
    them: each value's op, what it reads and its bytes go to Rust, their positions come back."""
    index = {n: i for i, n in enumerate(nodes)}
    described = []
    for n in nodes[:-1]:  # the output node is `outputs` below
        target = None if n.op in ("placeholder", "get_attr") else _target(n)
        described.append({"target": target, "inputs": [index[a] for a in n.all_input_nodes], "bytes": _bytes(n),
                          "constant": n.op == "get_attr"})
    outputs = [index[o] if isinstance(o, torch.fx.Node) else None for o in nodes[-1].args[0]]
    joint = {"nodes": described, "outputs": outputs, "user_outputs": num_outputs, "primals": num_primals,
             "free_inputs": sorted(free_inputs), "written": sorted(written)}
    try:
        positions = extension().joint_saved_values(json.dumps(joint))
    except extension().FerrocoreError as e:
        raise NeedsAot(str(e)) from None
    return [nodes[i] for i in positions]


def _target(n: torch.fx.Node) -> str:
    try:
        return target_name(n)
    except UnsupportedGraph as e:
        raise NeedsAot(e.reason) from None


def _bytes(n: torch.fx.Node) -> int | None:
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return int(val.numel()) * val.element_size()
    except (TypeError, RuntimeError):  # a symbolic size
        raise NeedsAot(f"node {n.name} has a symbolic size") from None


def _is_view(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.is_view


# ---- the two graphs ----------------------------------------------------------------------------


def _extract(joint: torch.fx.GraphModule, nodes: list, outputs: list, placeholders: list,
             effects: tuple = ()) -> torch.fx.GraphModule:
    """A new graph computing `outputs` (and the side effects `effects`) from `placeholders`,
    with the joint's nodes in the joint's order."""
    inputs = set(placeholders)
    needed: set = set()
    stack = [o for o in (*outputs, *effects) if isinstance(o, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n not in inputs:
            if n.op == "placeholder":
                raise AssertionError(f"joint_split: {n.name} is neither saved nor a tangent")
            stack.extend(n.all_input_nodes)
    graph = torch.fx.Graph()
    env: dict = {}
    for p in placeholders:
        env[p] = graph.placeholder(p.name)
        env[p].meta = dict(p.meta)
    root = torch.nn.Module()
    for n in nodes:
        if n not in needed or n in env:
            continue
        if n.op == "get_attr":
            setattr(root, n.target, getattr(joint, n.target))
        env[n] = graph.create_node(n.op, n.target, torch.fx.node.map_arg(n.args, env.__getitem__),
                                   torch.fx.node.map_arg(n.kwargs, env.__getitem__), name=n.name)
        env[n].meta = dict(n.meta)
    graph.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in outputs))
    return graph_module(root, graph)


def _donated(saved: list, user: list, primals: list) -> list:
    """Saved values the backward may write into: made by the forward, not a view, and sharing
    storage with no input, user output or other saved value."""
    def storage(n):
        val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None

    counts: dict = {}
    for n in [*saved, *user, *primals]:
        s = storage(n)
        if s is not None:
            counts[s] = counts.get(s, 0) + 1
    return [i for i, n in enumerate(saved)
            if n.op == "call_function" and not _is_view(n.target) and n not in user
            and counts.get(storage(n)) == 1]
