"""The harness must be able to fail: `check` run against deliberately broken backends.

These tests do not use the selected backend; they run in every mode and keep the differential
tests honest (a comparison that ignores strides, dtypes or the second call would pass here)."""

from __future__ import annotations

import pytest
import torch
from helpers import check


def broken_backend(transform):
    """A dynamo backend that runs the graph eagerly, then applies `transform(call, outputs)`."""
    calls = {"n": 0}

    def backend(gm, example_inputs):
        def run(*args):
            calls["n"] += 1
            outs = gm(*args)
            return type(outs)(transform(calls["n"], o, args) for o in outs)

        return run

    return backend


def perturb(call, out, args):
    return out + 1e-3 if out.is_floating_point() else out


def contiguous(call, out, args):
    return out.contiguous()


def widen(call, out, args):
    return out.double()


def wrong_on_second_call(call, out, args):
    return out * 1.01 if call == 2 else out


def mutate_input(call, out, args):
    args[0].add_(1)
    return out


def test_harness_accepts_a_correct_backend():
    eager_graph = broken_backend(lambda call, out, args: out)
    check(lambda x: (x.t() * 2, x.sum(0)), torch.randn(8, 16), backend=eager_graph)


@pytest.mark.parametrize(
    "transform, message",
    [
        (perturb, "not close"),
        (contiguous, "stride"),
        (widen, "dtype"),
        (wrong_on_second_call, "second compiled call"),
        (mutate_input, "was modified"),
    ],
    ids=["values", "strides", "dtype", "second_call", "input_mutation"],
)
def test_harness_rejects_a_broken_backend(transform, message):
    with pytest.raises(AssertionError, match=message):
        check(lambda x: x.t() * 2, torch.randn(8, 16), backend=broken_backend(transform))


def test_harness_rejects_constant_outputs_unless_allowed():
    eager_graph = broken_backend(lambda call, out, args: out)
    with pytest.raises(AssertionError, match="constant"):
        check(lambda x: (x > 10).float(), torch.randn(8, 16), backend=eager_graph)
    check(lambda x: (x > 10).float(), torch.randn(8, 16), backend=eager_graph, allow_constant=True)


def test_harness_ignores_strides_of_size_one_dims():
    # (5, 1) tensors with strides (1, 1) and (1, 5) are the same layout.
    def restride(call, out, args):
        return out.as_strided(out.shape, (1, 5))

    check(lambda x: x * 2, torch.randn(5, 1), backend=broken_backend(restride))
