"""Scatters: indirect stores into a copy of the destination (scatter*, index_put, masked_scatter)
and the backward ops that are scatters (max-pool indices, embedding)."""

import pytest
import torch
import torch.nn.functional as F

import ferrocore
from helpers import check, raises_index_error


def test_scatter_src_value_and_add():
    x = torch.randn(10, 5)
    idx = torch.tensor([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]])
    check(lambda t, i, s: (torch.scatter(t, 0, i, s), torch.scatter(t, 1, i, 2.5)), x, idx, torch.randn(2, 5))
    many = torch.randint(0, 10, (6, 5))  # repeated targets: the adds accumulate
    check(lambda t, i, s: torch.scatter_add(t, 0, i, s) * 2, x, many, torch.randn(6, 5))
    check(lambda t, i, s: torch.scatter(t, 0, i, s, reduce="multiply"), x, many, torch.randn(6, 5))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    x = torch.randn(10, 5)
    idx = torch.randint(0, 10, (6, 5))
    src = torch.randn(6, 5)
    fn = lambda t, i, s: torch.scatter_reduce(t, 0, i, s, reduce, include_self=include_self)
    check(fn, x, idx, src)
    check(fn, (x * 10).long(), idx, (src * 10).long())
    check(fn, x.half(), idx, src.half())


def test_index_put_assign_and_accumulate():
    x = torch.randn(10, 5, 3)
    rows = torch.tensor([1, 3, -2])
    check(lambda t, r, v: t.index_put((r,), v), x, rows, torch.randn(3, 5, 3))
    dup = torch.tensor([1, 3, 1, 1])
    check(lambda t, r, v: t.index_put((r,), v, accumulate=True), x, dup, torch.randn(4, 5, 3))
    # two index tensors broadcast, values broadcast over the rest
    def assign(t, a, b):
        y = t.clone()
        y[a, :, b] = 7.0
        return y

    check(assign, x, torch.tensor([[0], [4]]), torch.tensor([0, 2]))
    # (index tensors made inside the function: on the input's device, as dynamo applies no
    # default device to factory calls it traces)
    check(lambda t, v: (t.index_add(1, torch.tensor([1, 3, 1], device=t.device), v),
                        t.index_fill(2, torch.tensor([0, 2], device=t.device), -1.0)), x, torch.randn(10, 3, 3))
    check(lambda t, v: t.index_copy(0, torch.tensor([9, 0], device=t.device), v) + 1, x, torch.randn(2, 5, 3))


def test_index_put_with_a_boolean_mask():
    x = torch.randn(6, 7)

    def assign(t, m):
        y = t.clone()
        y[m] = 3.0
        return y

    check(assign, x, x > 0.5)
    check(lambda t, m, v: t.index_put((m,), v, accumulate=True), x, x < 0, torch.tensor(0.5))


def test_masked_scatter():
    x = torch.randn(6, 7)
    check(lambda t, m, s: t.masked_scatter(m, s), x, x > 0, torch.randn(50))
    check(lambda t, m, s: t.masked_scatter(m, s), x, torch.rand(7) > 0.5, torch.randn(6, 10))


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)], ids=str)
def test_masked_scatter_of_an_empty_tensor(shape):
    # found by the fuzzer: the running count over a size-0 mask divided its index by 0
    x = torch.randn(shape)
    check(lambda t, m, s: (t.masked_scatter(m, s), s * 2), x, torch.rand(shape) > 0.5, torch.randn(4))


def test_max_pool_and_embedding_backward():
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    fn = lambda t: F.max_pool2d(t, 3, stride=2, padding=1).sum()
    expected = torch.autograd.grad(fn(x), x)[0]
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(fn, backend="ferrocore")(x), x)[0]
    torch.testing.assert_close(got, expected)
    assert ferrocore.metrics.last["fallbacks"] == 0

    w = torch.randn(10, 4, requires_grad=True)
    ind = torch.tensor([[1, 2, 3], [3, 3, 9]])
    for kw in ({}, {"padding_idx": 3}, {"scale_grad_by_freq": True}):
        f = lambda i: (F.embedding(i, w, **kw) * torch.arange(4.0, device=w.device)).sum()
        expected = torch.autograd.grad(f(ind), w)[0]
        torch._dynamo.reset()
        got = torch.autograd.grad(torch.compile(f, backend="ferrocore")(ind), w)[0]
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dims, kernel, stride, padding, ceil", [
    (2, 3, 2, 1, False), (2, 2, 2, 0, True), (2, (3, 2), (1, 2), (1, 0), False), (2, 3, 3, 1, True), (3, 2, 2, 1, False),
])
def test_max_pool_gradients_from_saved_window_offsets(dims, kernel, stride, padding, ceil):
    # training saves int8 window offsets; the backward's gather compares each covering window's
    # offset with the element's own tap in it (ties: the first tap, as ATen)
    torch.manual_seed(0)
    size = (2, 3) + (7, 9, 5)[:dims]
    x = torch.randn(size).round(decimals=1).requires_grad_()  # rounding makes ties
    pool = F.max_pool2d if dims == 2 else F.max_pool3d

    def fn(t):
        y = pool(t * 2, kernel, stride=stride, padding=padding, ceil_mode=ceil)
        return (y * torch.arange(y.numel(), dtype=y.dtype, device=y.device).view(y.shape)).sum()

    expected = torch.autograd.grad(fn(x), x)[0]
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(fn, backend="ferrocore")(x), x)[0]
    torch.testing.assert_close(got, expected)
    assert ferrocore.metrics.last["fallbacks"] == 0


def test_scatter_index_out_of_range_raises():
    fn = torch.compile(lambda t, i: torch.scatter_add(t, 0, i, torch.ones_like(i, dtype=t.dtype)), backend="ferrocore")
    x = torch.zeros(4)
    fn(x, torch.tensor([0, 3]))
    assert raises_index_error(lambda: fn(x, torch.tensor([0, 4])))


def test_index_put_with_a_partial_mask_and_rows_of_values():
    x = torch.randn(5, 4, 3)
    m = torch.tensor([True, False, True, True, False])
    check(lambda t, mm, v: t.index_put((mm,), v), x, m, torch.randn(3, 4, 3))
    check(lambda t, mm, v: t.index_put((mm,), v, accumulate=True), x, m, torch.randn(4, 3))

    def inner(t, mm, v):
        y = t.clone()
        y[:, mm] = v
        return y

    check(inner, x, torch.tensor([True, False, True, False]), torch.randn(5, 2, 3))


def test_scatter_of_one_element_per_row_is_a_select():
    # the cross-entropy backward's shape: -1 scattered into zeros at each row's label, scaled
    x = torch.randn(8, 33)
    idx = torch.randint(0, 33, (8, 1))
    g = torch.randn(8, 1)
    stats = check(lambda z, i, s: torch.zeros_like(z).scatter(1, i, -1.0) * s, x, idx, g, expect_kernels=1)
    check(lambda z, i: torch.full_like(z, 2.0).scatter(1, i, z[:, :1] * 3), x, idx)
    check(lambda z, i: z.scatter(0, i.T % 8, z[:1] + 1), x, idx)
    bad = idx.clone()
    bad[3] = 40
    bad_scatter = torch.compile(lambda z, i: torch.zeros_like(z).scatter(1, i, -1.0) + 1, backend="ferrocore")
    assert raises_index_error(lambda: bad_scatter(x, bad))
    del stats
