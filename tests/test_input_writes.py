"""Graphs that write several inputs, each write reading other written inputs' old contents (an
optimizer step: the parameter update reads the moments its own loop overwrites). Every write
must see the contents from before the call, whichever kernel it lands in; the writes that read
only the element they overwrite share one loop."""

from __future__ import annotations

import torch

import ferrocore


def run(fn, *shapes, kernels=None):
    """`fn` compiled and eager on equal random inputs: same inputs afterwards, same result."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(len(shapes))
    base = [torch.randn(s, generator=gen, device="cpu").to(torch.get_default_device()) for s in shapes]
    eager = [t.clone() for t in base]
    compiled = [t.clone() for t in base]
    expected = fn(*eager)
    out = torch.compile(fn, backend="ferrocore")(*compiled)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6, equal_nan=True)
    if expected is not None:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert ferrocore.metrics.last["fallbacks"] == 0
    if kernels is not None:
        assert ferrocore.metrics.last["kernels"] == kernels, ferrocore.metrics.last


def adam_like(p, m, v, g):
    m.lerp_(g, 0.1)
    v.abs_().mul_(0.999).addcmul_(g, g, value=0.001)
    p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)


def test_an_update_reading_the_moments_it_overwrites_is_one_loop():
    # p's write reads m and v where their writes store: one kernel writes p, m and v; before,
    # p's new value went through a buffer of its own and each write was a kernel
    run(adam_like, (64, 33), (64, 33), (64, 33), (64, 33), kernels=1)
    # large enough for parallel vector loops
    run(adam_like, (1 << 16,), (1 << 16,), (1 << 16,), (1 << 16,), kernels=1)


def swap(a, b):
    old = a.clone()
    a.copy_(b)
    b.copy_(old)


def test_inputs_written_with_each_others_contents():
    run(swap, (37,), (37,))
    run(lambda a, b: (swap(a.t(), b), None)[1], (5, 7), (7, 5))

    def rotate(a, b, c):
        old = a.clone()
        a.copy_(b * 2)
        b.copy_(c * 3)
        c.copy_(old + 1)

    run(rotate, (129,), (129,), (129,))


def test_a_write_reading_another_input_elsewhere_than_it_stores():
    def shifted(a, b):
        b.copy_(a.roll(1) + b)
        a.mul_(2)

    run(shifted, (1000,), (1000,))

    def transposed(a, b):
        b.add_(a.t())
        a.add_(1)

    run(transposed, (48, 48), (48, 48))

    def reversed_self(a, b):
        a.copy_(a.flip(0) + b)
        b.copy_(a.flip(0))

    run(reversed_self, (50,), (50,))


def test_a_write_after_a_reduction_of_the_input_it_overwrites():
    def centred(a, b):
        b.add_(a.sum())
        a.sub_(a.mean())

    run(centred, (4096,), (4096,))

    def row_norm(a, b):
        b.copy_(a / a.norm(dim=1, keepdim=True))
        a.mul_(b)

    run(row_norm, (64, 96), (64, 96))
