"""The direct trace's memory of fake-tensor calls (`ferrocore/fake_calls.py`): a call answered
from memory gives what FakeTensorMode gives (sizes, strides, offset, dtype, device, and the
storage a view shares), calls whose outputs depend on more than their arguments' metadata are
never answered from memory, and a trace of repeated layers answers most of its calls so."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from ferrocore import direct_trace
from ferrocore.fake_calls import FakeCalls

aten = torch.ops.aten
DEVICE = torch.get_default_device()


def _layout(t):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


def _storage(t):
    return StorageWeakRef(t.untyped_storage())


def _twice(mode, calls, func, *args, **kwargs):
    """The call made directly, then twice through `calls` (remembered, then answered)."""
    with mode:
        direct = func(*args, **kwargs)
        first = calls(func, args, kwargs)
        hits = calls.hits
        second = calls(func, args, kwargs)
    return direct, first, second, calls.hits - hits


def test_an_answered_call_gives_fake_tensor_modes_outputs():
    mode = FakeTensorMode()
    calls = FakeCalls(mode)
    x = mode.from_tensor(torch.randn(4, 6, 8, device=DEVICE))
    w = mode.from_tensor(torch.randn(8, device=DEVICE))
    cases = [
        (aten.add.Tensor, (x, w)),
        (aten.mm.default, (x[0], x[0].t())),
        (aten.permute.default, (x, [2, 0, 1])),
        (aten.slice.Tensor, (x, 1, 2, 5)),  # a view with an offset
        (aten.split.Tensor, (x, 3, 1)),  # views, as a tuple
        (aten.native_layer_norm.default, (x, [8], w, w, 1e-5)),  # three fresh outputs
        (aten.max.dim, (x, 1)),  # values and int64 indices
        (aten.sum.dim_IntList, (x, [0, 2], True)),
        (aten._to_copy.default, (x,)),
    ]
    for func, args in cases:
        direct, first, second, hits = _twice(mode, calls, func, *args)
        assert hits == 1, func
        outs = (direct, first, second) if isinstance(direct, torch.Tensor) else tuple(zip(direct, first, second))
        for d, f, s in [outs] if isinstance(direct, torch.Tensor) else outs:
            assert type(s) is FakeTensor and s.fake_mode is mode
            assert _layout(s) == _layout(d) == _layout(f), func
            shares = _storage(d) == _storage(args[0])
            assert (_storage(s) == _storage(args[0])) == shares, func
            if not shares:
                assert _storage(s) != _storage(f)


def test_the_key_tells_apart_what_changes_outputs():
    mode = FakeTensorMode()
    calls = FakeCalls(mode)
    with mode:
        ints = calls(aten.full.default, ([2], 1), {"device": DEVICE})
        floats = calls(aten.full.default, ([2], 1.0), {"device": DEVICE})
        assert (ints.dtype, floats.dtype) == (torch.int64, torch.float32)
        x = torch.empty(4, 6, device=DEVICE)
        a = calls(aten.add.Tensor, (x, x), {})
        b = calls(aten.add.Tensor, (x.t(), x.t()), {})  # other strides
        assert (a.stride(), b.stride()) == ((6, 1), (1, 6))
    assert calls.hits == 0


def test_calls_that_depend_on_more_than_metadata_are_made_every_time():
    mode = FakeTensorMode()
    calls = FakeCalls(mode)
    x = mode.from_tensor(torch.randn(4, 6, device=DEVICE))
    constant = mode.from_tensor(torch.tensor([1.0, 2.0], device=DEVICE))
    constant.constant = torch.tensor([1.0, 2.0])  # as lift_fresh leaves a constant's fake
    for func, args in [(aten.rand_like.default, (x,)),  # random
                       (aten.mul.Tensor, (constant, constant)),  # a constant's values propagate
                       (aten.sym_size.int, (x, 0))]:  # not a tensor
        _, _, _, hits = _twice(mode, calls, func, *args)
        assert hits == 0, func


def test_a_trace_of_repeated_layers_answers_its_calls_from_memory():
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                                       torch.nn.GELU()) for _ in range(4)]).to(DEVICE)
    made = []
    original = direct_trace._Recorder.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    direct_trace._Recorder.__init__ = keep
    try:
        torch._dynamo.reset()
        x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
        out = torch.compile(layers, backend="ferrocore")(x)
        out.sum().backward()
    finally:
        direct_trace._Recorder.__init__ = original
    [recorder] = made
    calls = recorder.fake_calls
    # each op of layers 2-4 (and of their backward) is layer 1's again
    assert calls.hits > len(calls.entries)
    expected = layers(x)
    torch.testing.assert_close(out, expected)
