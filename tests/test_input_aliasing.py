"""Inputs that overlap in memory (`ferrocore.runtime.aliasing`): a graph that writes into an input is
compiled for the way its inputs overlap, checked at every call (Dynamo does not guard on it),
compiled again where it changed, and cached only for inputs that do not overlap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ferrocore
from ferrocore.runtime import aliasing


def add_then_read(a, b):
    a.add_(1)
    return b * 2


def read_then_add(a, b):
    out = b * 2
    a.add_(1)
    return out


def separate():
    return torch.arange(4.0), torch.arange(2.0, 6.0)


def overlapping():
    base = torch.arange(6.0)
    return base[0:4], base[2:6]


@pytest.mark.parametrize("fn", [add_then_read, read_then_add])
@pytest.mark.parametrize("order", ["separate_first", "overlapping_first"])
def test_writes_into_inputs_see_the_overlap_of_each_call(fn, order):
    # compiled for separate inputs and called with overlapping ones, the write into `a` came
    # after the read of `b`: [4, 6, 8, 10] where eager gives [6, 8, 8, 10]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ferrocore")
    makers = [separate, overlapping] if order == "separate_first" else [overlapping, separate]
    for make in makers * 2:
        a, b = make()
        ea, eb = make()
        out = compiled(a, b)
        expected = fn(ea, eb)
        assert torch.equal(out, expected), (make.__name__, out, expected)
        assert torch.equal(a, ea) and torch.equal(b, eb)


def test_a_graph_that_writes_no_input_runs_unchecked():
    def call(x, y):
        return x + y

    assert aliasing.guarded(call, [torch.ones(2), torch.ones(2)], [], None, "g") is call
    assert aliasing.guarded(call, [torch.ones(2), torch.ones(2)], [0], None, "g") is not call


def test_overlap_is_decided_on_memory_not_storage():
    base = torch.arange(12.0)
    halves = [base[:6], base[6:]]
    assert aliasing.overlapping(halves) == frozenset()
    assert aliasing.overlapping([base[:7], base[6:]]) == {(0, 1)}
    assert aliasing.overlapping([base[:7], base[6:], torch.zeros(3)], among=frozenset({2})) == frozenset()
    assert aliasing.overlapping([base.view(3, 4).t(), base[11:]]) == {(0, 1)}
    assert aliasing.overlapping([base[:0], base]) == frozenset()


def test_the_graph_cache_keeps_no_entry_for_overlapping_inputs():
    from ferrocore.runtime import graph_cache

    gm = torch.fx.symbolic_trace(lambda a, b: a + b)
    with pytest.raises(graph_cache.Bypass, match="overlap in memory"):
        graph_cache.key(gm, list(overlapping()), {})


PROGRAM = textwrap.dedent("""
    import sys, torch, ferrocore
    def f(a, b):
        a.add_(1)
        return b * 2
    base = torch.arange(6.0)
    a, b = (base[0:4], base[2:6]) if sys.argv[1] == "overlapping" else (torch.arange(4.0), torch.arange(2.0, 6.0))
    print(torch.compile(f, backend="ferrocore")(a, b).tolist())
""")


def test_processes_sharing_a_graph_cache_see_their_own_overlap(tmp_path):
    # an entry stored for separate inputs was hit by a process with overlapping ones: wrong
    # values (the other order, an entry for overlapping inputs, is never stored: see above)
    env = {**os.environ, "FERROCORE_CACHE_DIR": str(tmp_path / "cache"), "FERROCORE_LOGS": "graph_cache"}
    expected = {"separate": [4.0, 6.0, 8.0, 10.0], "overlapping": [6.0, 8.0, 8.0, 10.0]}
    for kind in ("separate", "overlapping"):
        run = subprocess.run([sys.executable, "-c", PROGRAM, kind], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == str(expected[kind]), (kind, run.stdout, run.stderr)
        if kind == "overlapping":
            assert "overlap in memory" in run.stderr
