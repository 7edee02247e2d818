"""A directly traced training graph (`direct_trace.trace_joint`) split into its forward and
backward graphs, as AOT autograd's min-cut partitioner splits the joint graphs it traces.

First, common subexpressions are merged (the backward formulas recompute what the forward
computed: a normalization's centred input, a mask's comparison). Then the activations the
forward saves are chosen by a minimum cut of a flow network over the values the forward can
compute: each value is an edge `in -> out` whose capacity is what saving it costs (its bytes,
twice that where its users would otherwise fuse it away), the source feeds the values the forward
must compute and may not be recomputed (matmuls, convolutions, random ops, reductions that
shrink their input, the primals, values a matmul or convolution of the backward reads, and every
hundredth value of a long pointwise chain), and the sink takes every value the backward reads.
As in AOT's partitioner, saving a value costs more the farther it lies from the backward. Cheap
values on the sink's side (pointwise chains, views, gathers) are recomputed in the backward,
where ferrocore fuses them into its kernels. The cut is solved in Rust (`ferrocore::min_cut`).
"""

from __future__ import annotations

import dataclasses
import heapq
import operator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from .direct_trace import NeedsAot, graph_module, is_factory
from .extension import extension

aten = torch.ops.aten
# ops that are neither pointwise nor views but cost no more to recompute than to load
_CHEAP = {aten.clone.default, aten._to_copy.default, aten.cat.default, aten.constant_pad_nd.default,
          aten.index.Tensor, aten.gather.default, aten.embedding.default, aten.where.self,
          aten.lift_fresh_copy.default, aten.scalar_tensor.default}
_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
               aten.amin.default, aten.var.correction, aten.prod.dim_int, aten.any.dim, aten.max.dim,
               aten.min.dim}


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
    backward = _descendants(nodes, set(tangents))
    copies = [n for n in nodes if n.op == "call_function" and n.target is aten.copy_.default]
    forward_needs = _ancestors([*user, *copies])
    saved = _saved_values(nodes, backward, forward_needs, grads, primals, free_inputs, written)

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


def _descendants(nodes: list, roots: set) -> set:
    found = set(roots)
    for n in nodes:
        if n not in found and any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _ancestors(roots: list) -> set:
    found: set = set()
    stack = [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


# ---- the cut -----------------------------------------------------------------------------------

# A chain of fusible forward values longer than this (in forward order) is cut by a saved value:
# the backward would otherwise recompute a model-long chain (a residual stream, a post-norm
# model's normalized activations) from the values beside it, in one huge kernel.
_LONGEST_CHAIN = 100
# Saving a value costs this factor more per step it lies from the backward (up to _FARTHEST
# steps), so that of two equal cuts the one the backward reads directly wins.
_DISTANCE_COST = 1.1
_FARTHEST = 100


def _saved_values(nodes: list, backward: set, forward_needs: set, grads: list, primals: list,
                  free_inputs: set, written: set) -> list:
    """The values the forward saves: the minimum cut between what the forward must compute and
    what the backward reads, over the values that do not depend on a tangent."""
    computable = [n for n in nodes if n not in backward and n.op != "output"
                  and not (n.op == "call_function" and n.target is aten.copy_.default)]
    index = {n: i for i, n in enumerate(computable)}
    source, sink = 0, 1
    vin = lambda n: 2 + 2 * index[n]  # noqa: E731
    vout = lambda n: 3 + 2 * index[n]  # noqa: E731
    free = {primals[i] for i in free_inputs}
    overwritten = {primals[i] for i in written}
    read_by_backward = {a for n in backward for a in n.all_input_nodes if a in index}
    read_by_backward |= {g for g in grads if isinstance(g, torch.fx.Node) and g in index}
    if overwritten & read_by_backward:
        raise NeedsAot("the backward reads an input the forward writes into")
    banned = _banned(computable, forward_needs)
    distance = _distances(nodes, forward_needs)
    infinite = extension().MIN_CUT_INFINITE  # (an edge the cut never takes)
    edges = []
    for n in computable:
        weight = infinite if n in overwritten else 0 if n in free else _weight(n, distance[n])
        edges.append((vin(n), vout(n), weight))
        for a in n.all_input_nodes:
            if a in index:
                edges.append((vout(a), vin(n), infinite))
        if n.op in ("placeholder", "get_attr") or n in banned:
            edges.append((source, vin(n), infinite))
        if n in read_by_backward:
            edges.append((vout(n), sink, infinite))
    side = extension().min_cut_source_side(2 + 2 * len(computable), edges, source, sink)
    return [n for n in computable if side[vin(n)] and not side[vout(n)]]


def _banned(computable: list, forward_needs: set) -> set:
    """Forward values the backward may not recompute: those dearer to recompute than to load,
    those the backward must write to memory anyway (a matmul or convolution there reads them, so
    recomputing adds a write and a read), and breaks in long fusible chains."""
    banned = {n for n in computable if n in forward_needs
              and (not _recomputable(n) or _materialized_in_backward(n, forward_needs))}
    order = {n: i for i, n in enumerate(computable) if n in forward_needs}
    visited: set = set()
    for start in order:
        # walk the fusible values downstream of `start` in forward order; where the walk has
        # narrowed to one value _LONGEST_CHAIN past the start, that value is saved
        frontier = [(order[start], start)]
        while frontier:
            _, cur = heapq.heappop(frontier)
            if cur in visited:
                continue
            visited.add(cur)
            if order[cur] > order[start] + _LONGEST_CHAIN and not frontier:
                if not _is_view(cur.target):
                    banned.add(cur)
                break
            if not _fusible(cur):
                continue
            for u in cur.users:
                if u in order and u not in banned and _fusible(u):
                    heapq.heappush(frontier, (order[u], u))
    return banned


def _materialized_in_backward(node: torch.fx.Node, forward_needs: set) -> bool:
    """Whether a backward op that cannot fuse it (a matmul, a convolution, the graph's output)
    reads the value, directly or through views."""
    if node.op == "call_function" and _is_view(node.target):
        return False
    frontier, seen = [node], {node}
    while frontier:
        for u in frontier.pop().users:
            if u not in forward_needs and not _fusible(u):
                return True
            if u not in seen and u.op == "call_function" and _is_view(u.target):
                seen.add(u)
                frontier.append(u)
    return False


def _distances(nodes: list, forward_needs: set) -> dict:
    """Per node, how many steps its nearest backward reader lies ahead (0 for values the
    forward does not need)."""
    far = 10 ** 9
    distance: dict = {}
    for n in reversed(nodes):
        if n.op == "output":
            continue
        distance[n] = min((distance.get(u, far) + 1 for u in n.users), default=far) if n in forward_needs else 0
    return distance


def _weight(node: torch.fx.Node, distance: int) -> int:
    """What saving the value costs: its bytes, doubled where its users would fuse it away (it
    would not be written to memory otherwise), and more the farther it lies from the backward;
    views and non-tensors are never saved."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or _is_view(node.target):
        return extension().MIN_CUT_INFINITE
    size = max(val.numel() * val.element_size(), 1)
    size = int(size * _DISTANCE_COST ** max(min(distance, _FARTHEST), 1))
    materialized = node.op == "placeholder" or not _recomputable(node) or any(
        u.op == "output" or not _fusible(u) for u in node.users)
    return min(size if materialized else 2 * size, extension().MIN_CUT_INFINITE // 1024)


def _fusible(node: torch.fx.Node) -> bool:
    """Whether ferrocore fuses the op with its neighbours: pointwise ops, views, cheap gathers
    and copies, factories and reductions."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return (torch.Tag.pointwise in target.tags or _is_view(target) or target in _CHEAP or is_factory(target)
            or target in _REDUCTIONS)


def _recomputable(node: torch.fx.Node) -> bool:
    """Whether the backward may recompute the value instead of loading it."""
    if node.op != "call_function":
        return node.op != "placeholder"
    if not _fusible(node):
        return False
    if node.target in _REDUCTIONS:
        # a reduction that shrinks its input is cheap to save and dear to recompute
        ins = sum(_bytes(a) for a in node.all_input_nodes)
        return 4 * _bytes(node) >= ins
    return True


def _bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


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
