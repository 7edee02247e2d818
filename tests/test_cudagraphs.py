"""mode="reduce-overhead": CUDA graph recording and replay of GPU inference graphs.

The replay rules (which recording may run, when the plain wrapper runs instead) are checked on
the CPU with a stand-in for the captured graph; the CUDA tests record real graphs.
"""

from __future__ import annotations

import pytest
import torch

import ferrocore
from ferrocore import cudagraphs, options

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _counts():
    t = ferrocore.metrics.total
    return {k: t.get(k, 0) for k in ("cudagraph_replays", "cudagraph_recordings", "cudagraph_plain_calls",
                                     "cudagraph_capture_failures")}


def _delta(before):
    after = _counts()
    return {k: after[k] - before[k] for k in after}


def test_option_and_env(monkeypatch):
    monkeypatch.delenv("FERROCORE_CUDAGRAPHS", raising=False)
    assert options.build_options()["cudagraphs"] is False
    assert options.build_options({"cudagraphs": True})["cudagraphs"] is True
    monkeypatch.setenv("FERROCORE_CUDAGRAPHS", "1")
    assert options.build_options()["cudagraphs"] is True


@pytest.mark.skipif(torch.get_default_device().type != "cpu", reason="a CPU graph")
def test_cpu_graph_runs_without_cuda_graphs(capfd):
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="ferrocore", mode="reduce-overhead")
    x = torch.randn(5)
    before = _counts()
    for _ in range(3):
        torch.testing.assert_close(f(x), torch.relu(x) * 2)
    assert "runs without CUDA graphs: not a GPU graph" in capfd.readouterr().err
    assert _delta(before) == {k: 0 for k in before}


class _StandInGraph:
    """Replays `fn` into the static outputs it produced at 'capture', like a CUDA graph replay
    writing into its pool."""

    def __init__(self, fn, args, outs):
        self.fn, self.args, self.outs = fn, args, outs

    def replay(self):
        for dst, src in zip(self.outs, self.fn(self.args)):
            dst.copy_(src)


def _stand_in_runner(fn):
    runner = cudagraphs.CudaGraphRunner(lambda args: fn(args), "graph_test", torch.device("cpu"))

    def record(args):
        # pool outputs are new memory; an input returned as an output stays the input
        outs = [t if any(t is a for a in args) else t.clone() for t in fn(list(args))]
        return cudagraphs._Recording(_StandInGraph(fn, list(args), outs), outs, cudagraphs._output_plan(outs, args))

    runner._record = record
    return runner


def test_replay_never_overwrites_a_held_output():
    x = torch.arange(4.0)
    runner = _stand_in_runner(lambda a: [a[0] * 10, a[0]])  # an output and the input itself
    before = _counts()
    first = runner([x])  # warm-up: the plain wrapper
    assert _delta(before)["cudagraph_plain_calls"] == 1
    a = runner([x])  # records generation 1 and replays it
    x.add_(1)
    b = runner([x])  # `a` is alive: generation 2
    x.add_(1)
    c = runner([x])  # both alive: the plain wrapper, fresh outputs
    d = _delta(before)
    assert (d["cudagraph_recordings"], d["cudagraph_replays"], d["cudagraph_plain_calls"]) == (2, 0, 2)
    torch.testing.assert_close(first[0], torch.arange(4.0) * 10)
    torch.testing.assert_close(a[0], torch.arange(4.0) * 10)
    torch.testing.assert_close(b[0], (torch.arange(4.0) + 1) * 10)
    torch.testing.assert_close(c[0], (torch.arange(4.0) + 2) * 10)
    assert a[1].data_ptr() == x.data_ptr() and a[1] is not x  # an input output is the caller's memory
    view = a[0][1:]  # a view keeps generation 1's outputs alive
    del a, first
    x.add_(1)
    e = runner([x])  # generation 1 is held through the view, generation 2 through `b`
    assert _delta(before)["cudagraph_replays"] == 0
    torch.testing.assert_close(view, torch.arange(1.0, 4.0) * 10)
    del view, c, e
    x.add_(1)
    f = runner([x])  # generation 1 is free again: replayed
    assert _delta(before)["cudagraph_replays"] == 1
    torch.testing.assert_close(f[0], (torch.arange(4.0) + 4) * 10)
    torch.testing.assert_close(b[0], (torch.arange(4.0) + 1) * 10)


def test_new_input_addresses_record_again():
    runner = _stand_in_runner(lambda a: [a[0] + a[1]])
    before = _counts()
    xs = [(torch.full((3,), float(i)), torch.ones(3)) for i in range(cudagraphs.MAX_KEYS + 2)]
    runner(list(xs[0]))
    for x, y in xs:
        out = runner([x, y])
        torch.testing.assert_close(out[0], x + 1)
        del out
    d = _delta(before)
    # the first MAX_KEYS address sets record; the rest evict an unused set and record
    assert d["cudagraph_recordings"] == len(xs) and len(runner.recordings) == cudagraphs.MAX_KEYS


@cuda
def test_reduce_overhead_replays_cuda_graphs():
    torch._dynamo.reset()
    x = torch.randn(1000, 64, device="cuda")
    w = torch.randn(64, device="cuda")

    def f(x, w):
        return torch.softmax(x * w, -1).sum(0), x.sum()

    g = torch.compile(f, backend="ferrocore", mode="reduce-overhead")
    before = _counts()
    with torch.no_grad():
        outs = [g(x, w) for _ in range(2)]  # warm-up, then record + replay
        for _ in range(3):
            x.mul_(0.5)  # the recording reads the input's memory at each replay
            out = g(x, w)
            torch.testing.assert_close(out, f(x, w), rtol=1e-4, atol=1e-4)
    d = _delta(before)
    assert d["cudagraph_recordings"] >= 1 and d["cudagraph_replays"] >= 1
    torch.testing.assert_close(outs[0], outs[1])  # held outputs were not overwritten


@cuda
def test_reduce_overhead_random_ops_draw_anew_each_replay():
    torch._dynamo.reset()
    g = torch.compile(lambda x: x + torch.rand_like(x), backend="ferrocore", mode="reduce-overhead")
    x = torch.zeros(4096, device="cuda")
    with torch.no_grad():
        outs = [g(x).clone() for _ in range(4)]
    for a in outs:
        assert 0.4 < a.mean().item() < 0.6
    assert all(not torch.equal(outs[i], outs[j]) for i in range(4) for j in range(i))


@cuda
def test_reduce_overhead_training_graphs_run_plainly(capfd):
    torch._dynamo.reset()
    w = torch.randn(8, device="cuda", requires_grad=True)
    g = torch.compile(lambda x: (x * w).sum(), backend="ferrocore", mode="reduce-overhead")
    x = torch.randn(8, device="cuda")
    g(x).backward()
    torch.testing.assert_close(w.grad, x)
    assert "runs without CUDA graphs: a training graph" in capfd.readouterr().err


@cuda
def test_reduce_overhead_records_checked_gathers_and_reports_bad_indices_later():
    # an embedding lookup checks its indices: recorded with a flag of its own, read after replays
    torch._dynamo.reset()
    table = torch.randn(100, 16, device="cuda")
    g = torch.compile(lambda ids: table[ids] * 2, backend="ferrocore", mode="reduce-overhead")
    ids = torch.randint(0, 100, (64,), device="cuda")
    before = _counts()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(g(ids), table[ids] * 2)
        d = _delta(before)
        assert d["cudagraph_recordings"] == 1 and d["cudagraph_replays"] >= 1, d
        ids[5] = 1000  # out of range: the replay clamps, raises the flag; a later call reports it
        g(ids)
        torch.cuda.synchronize()
        with pytest.raises(IndexError, match="index out of range"):
            g(ids)
