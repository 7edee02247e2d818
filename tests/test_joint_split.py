"""How a directly traced training graph is split into forward and backward
(`ferrocore/joint_split.py`): which activations the forward saves (the minimum cut), what the
backward recomputes, and the merging of common subexpressions."""

from __future__ import annotations

import operator

import pytest
import torch
import torch._dynamo
from helpers import is_ferrocore

pytestmark = pytest.mark.skipif(not is_ferrocore(), reason="ferrocore's own split")

aten = torch.ops.aten


def _split(fn, *inputs):
    """The Split of the one graph Dynamo makes of `fn`'s training step."""
    from ferrocore import decompositions, direct_trace, joint_split

    found = []

    def capture(gm, example_inputs, **kwargs):
        direct_trace.check_graph(gm, example_inputs, training=True)
        joint = direct_trace.trace_joint(gm, example_inputs, decompositions.decompositions(training=True))
        found.append(joint_split.split(joint.graph, joint.num_outputs, len(joint.requires_grad),
                                       set(direct_trace.static_inputs(gm)), set(joint.written)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*inputs)
    assert len(found) == 1
    return found[0]


def _saved(split) -> list:
    """The ops that made the values the forward saves (`placeholder` for a primal)."""
    outs = list(split.forward.graph.output_node().args[0])
    saved = outs[len(outs) - len(split.saved_is_input):]
    return [n.target if n.op == "call_function" else n.op for n in saved]


def _targets(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_a_pointwise_chain_is_recomputed_from_the_matmul():
    w = torch.randn(32, 32, requires_grad=True)

    def f(x):
        return torch.nn.functional.gelu(x @ w).mul(3).tanh().sum()

    split = _split(f, torch.randn(16, 32))
    saved = _saved(split)
    # the matmul's output (and the input, alive anyway), not gelu's or tanh's intermediates
    assert aten.mm.default in saved, saved
    assert aten.tanh.default not in saved and aten.erf.default not in saved, saved
    assert aten.erf.default in _targets(split.backward)  # gelu recomputed where it is fused
    assert aten.mm.default in _targets(split.forward)


def test_random_values_are_saved_not_drawn_again():
    w = torch.randn(64, 64, requires_grad=True)

    def f(x):
        return torch.nn.functional.dropout(x @ w, 0.5, training=True).relu().sum()

    split = _split(f, torch.randn(64, 64))
    random = {t for t in _targets(split.forward) if isinstance(t, torch._ops.OpOverload)
              and torch.Tag.nondeterministic_seeded in t.tags}
    assert random, _targets(split.forward)
    assert not random & _targets(split.backward)
    assert all(split.backward.graph.nodes), "the backward runs"


def test_shrinking_reduction_is_saved():
    w = torch.randn(64, 64, requires_grad=True)

    def f(x):
        y = x @ w
        return (y - y.amax(-1, keepdim=True)).exp().sum()

    split = _split(f, torch.randn(64, 64))
    assert aten.amax.default not in _targets(split.backward), split.backward.code


def test_donated_values_are_the_forwards_own():
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        return (x @ w).sigmoid().sum()

    split = _split(f, torch.randn(4, 8))
    saved = list(split.forward.graph.output_node().args[0])[1:]
    for i in split.donated:
        assert saved[i].op == "call_function" and not saved[i].target.is_view, saved[i]
    assert all(not is_input or i not in split.donated for i, is_input in enumerate(split.saved_is_input))


def test_common_subexpressions_are_merged_but_not_look_alikes():
    from ferrocore.joint_split import eliminate_common_subexpressions

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a, b = (graph.call_function(aten.add.Tensor, (x, 0.0)) for _ in range(2))
    c = graph.call_function(aten.add.Tensor, (x, -0.0))  # equal to 0.0, but not the same constant
    d = graph.call_function(aten.add.Tensor, (x, False))  # equal to 0, but a bool
    r1, r2 = (graph.call_function(aten.rand.default, ([4],)) for _ in range(2))  # two draws
    graph.output((a, b, c, d, r1, r2))
    eliminate_common_subexpressions(graph)
    out = graph.output_node().args[0]
    assert out[0] is out[1]
    assert len({out[0], out[2], out[3]}) == 3
    assert out[4] is not out[5]
    assert operator.getitem not in {n.target for n in graph.nodes}
