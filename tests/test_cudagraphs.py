"""mode="reduce-overhead": CUDA graph recording and replay of GPU inference graphs.

The replay rules (which recording may run, when the plain wrapper runs instead) are checked on
the CPU with a stand-in for the captured graph; the CUDA tests record real graphs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import ferrocore
from ferrocore import options
from ferrocore.runtime import cudagraphs

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
    writing into its pool; it reads its inputs where they were at capture without keeping them
    alive, as a graph reads addresses."""

    def __init__(self, fn, args, outs):
        self.fn, self.outs = fn, outs
        self.args = [(StorageWeakRef(a.untyped_storage()), a.storage_offset(), a.shape, a.stride(), a.dtype) for a in args]

    def replay(self):
        storages = [torch.UntypedStorage._new_with_weak_ptr(ref.cdata) for ref, *_ in self.args]
        args = [torch.empty(0, dtype=dt, device=st.device).set_(st, off, size, stride)
                for st, (_, off, size, stride, dt) in zip(storages, self.args)]
        for dst, src in zip(self.outs, self.fn(args)):
            dst.copy_(src)


def _stand_in_runner(fn, copied=(), saved=(), **kw):
    runner = cudagraphs.CudaGraphRunner(lambda args, **k: fn(args, **k), "graph_test", torch.device("cpu"), copied=copied,
                                        saved=saved, **kw)

    def capture(static, kw):
        # pool outputs are new memory; an input returned as an output (or written over) stays
        # the input
        outs = [t if any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in static) else t.clone()
                for t in fn(list(static), **kw)]
        return _StandInGraph(functools.partial(fn, **kw), list(static), outs), outs

    runner._capture = capture
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
    assert a[1] is x  # an output that is an input is the caller's tensor, as a plain call returns it
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


def test_an_output_autograd_saved_keeps_its_recording():
    # a forward's saved activation lives on only inside autograd's saved variables (no Python
    # reference): its recording replays again only after the backward has run
    runner = _stand_in_runner(lambda a: [a[0] * 2], saved=[0])

    class Step(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            (act,) = runner([x.detach()])
            ctx.save_for_backward(act)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (act,) = ctx.saved_tensors
            return g * act

    x = torch.arange(3.0, requires_grad=True)
    runner([x.detach()])  # warm-up
    before = _counts()
    first = Step.apply(x).sum()  # records generation 1; its activation is saved
    second = Step.apply(x + 1).sum()  # generation 1 is held by `first`'s graph: generation 2
    assert _delta(before)["cudagraph_recordings"] == 2
    first.backward()
    torch.testing.assert_close(x.grad, torch.arange(3.0) * 2)
    del first
    third = Step.apply(x).sum()  # generation 1 is free again
    assert _delta(before)["cudagraph_replays"] == 1
    second.backward(), third.backward()
    torch.testing.assert_close(x.grad, torch.arange(3.0) * 2 + (torch.arange(3.0) + 1) * 2 + torch.arange(3.0) * 2)


def test_a_gradient_handed_out_becomes_grad_without_a_copy():
    # autograd moves a gradient nobody else references into `.grad`; there it holds the
    # recording until the next zero_grad
    runner = _stand_in_runner(lambda a: [a[0] * 3], copied=[0])  # an incoming gradient is copied

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, g):
            return runner([g.contiguous()])[0]

    w = torch.ones(4, requires_grad=True)
    runner([torch.ones(4)])  # warm-up
    before = _counts()
    Scale.apply(w).sum().backward()
    (rec,) = next(iter(runner.recordings.values()))
    assert w.grad.data_ptr() == rec.static_outputs[0].data_ptr()
    assert not rec.free()
    w.grad = None
    assert rec.free()
    Scale.apply(w).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((4,), 3.0))
    d = _delta(before)
    assert (d["cudagraph_recordings"], d["cudagraph_replays"]) == (1, 1), d


def test_a_backward_overwrites_its_forward_recordings_saved_activation_in_place():
    # a donated saved activation is the forward recording's pool memory, which that recording
    # references: the backward's capture is told so (`held`), and writes an intermediate over it
    # without a copy
    from ferrocore.runtime.wrapper import owned_storage

    written = []

    def bw(a, held=None):
        t = owned_storage(a[0], 4, held).mul_(a[1])
        written.append(t.data_ptr())
        return [t * 3]

    family = cudagraphs.Family()
    forward = _stand_in_runner(lambda a: [a[0] * 2], copied=[0], saved=[0], family=family)
    backward = _stand_in_runner(bw, copied=[1], donated_writes=True, family=family)

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            (act,) = forward([x.detach()])
            ctx.save_for_backward(act)
            return x * 6

        @staticmethod
        def backward(ctx, g):
            (act,) = ctx.saved_tensors
            return backward([act, g.contiguous()])[0]

    before = _counts()
    for step in range(4):
        x = (torch.arange(4.0) + step).requires_grad_()
        Scaled.apply(x).sum().backward()
        torch.testing.assert_close(x.grad, (torch.arange(4.0) + step) * 6)
    d = _delta(before)
    assert (d["cudagraph_recordings"], d["cudagraph_replays"]) == (2, 4), d
    # the backward's capture (its second call) wrote into the forward recording's output
    (rec,) = next(iter(forward.recordings.values()))
    assert written[1] == rec.static_outputs[0].data_ptr()


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


def test_copied_inputs_replay_at_new_addresses():
    # a batch is copied into the recording's buffer: new batches replay, parameters are keyed
    runner = _stand_in_runner(lambda a: [a[0] * a[1], a[0]], copied=[0])
    w = torch.arange(3.0)
    before = _counts()
    runner([torch.ones(3), w])
    for i in range(4):
        x = torch.full((3,), float(i))
        out = runner([x, w])
        torch.testing.assert_close(out[0], x * w)
        assert out[1].data_ptr() == x.data_ptr()  # an input returned is the caller's tensor
        del out
    d = _delta(before)
    assert (d["cudagraph_recordings"], d["cudagraph_replays"]) == (1, 3), d
    runner([torch.ones(3), torch.arange(3.0)])  # a parameter elsewhere: recorded again
    assert _delta(before)["cudagraph_recordings"] == 2


def test_a_recording_keeps_no_output_that_views_an_input():
    # a loss graph saving its logits input: a reference from the recording would hold the
    # caller's storage (and the recording that handed it out) for ever
    runner = _stand_in_runner(lambda a: [a[0] * 2, a[0]])
    x = torch.arange(4.0)
    runner([x])
    out = runner([x])
    (rec,) = next(iter(runner.recordings.values()))
    assert rec.static_outputs[0] is not None and rec.static_outputs[1] is None
    assert out[1].data_ptr() == x.data_ptr()


def test_a_saved_copied_input_is_the_recordings_copy():
    # a forward saves its batch for the backward: handed out as the recording's copy (one address
    # for the backward's recording), and never overwritten while autograd holds it
    runner = _stand_in_runner(lambda a: [a[0] * 2, a[0]], copied=[0], saved=[1])
    before = _counts()
    runner([torch.ones(3)])
    x = torch.full((3,), 5.0)
    first = runner([x])
    assert first[1].data_ptr() != x.data_ptr()
    torch.testing.assert_close(first[1], x)
    again = runner([torch.full((3,), 7.0)])  # `first` holds the copy: generation 2
    torch.testing.assert_close(first[1], x)
    torch.testing.assert_close(again[0], torch.full((3,), 14.0))
    assert _delta(before)["cudagraph_recordings"] == 2
    del first, again
    runner([torch.full((3,), 9.0)])
    assert _delta(before)["cudagraph_replays"] == 1


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
def test_reduce_overhead_records_forward_and_backward():
    # a training step: the forward's saved activations stay in its pool for the backward's
    # recording; a new batch each step replays both
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    ref = copy.deepcopy(model)
    g = torch.compile(model, backend="ferrocore", mode="reduce-overhead")
    before = _counts()
    for step in range(5):
        x = torch.randn(16, 32, device="cuda")
        loss = g(x).square().mean()
        loss.backward()
        expected = ref(x).square().mean()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            p.grad, q.grad = None, None
    d = _delta(before)
    # steps 2..4 replay both graphs: the saved batch is the forward recording's copy
    assert (d["cudagraph_recordings"], d["cudagraph_replays"]) == (2, 6), d


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
