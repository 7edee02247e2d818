"""Layouts end to end: non-contiguous and expanded inputs, chains of views, cat, outputs that alias
inputs, multiple outputs, 0-d tensors, size-1 and size-0 dims, and dtype coverage."""

from __future__ import annotations

import pytest
import torch
from helpers import check


def randn(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


# ------------------------------------------------------------------------------------------------
# Non-contiguous inputs.

NONCONTIGUOUS_INPUTS = {
    "transposed": lambda: randn(24, 40).t(),
    "permuted_3d": lambda: randn(6, 7, 33).permute(2, 0, 1),
    "sliced_with_step": lambda: randn(24, 40)[::2, 1::3],
    "negative_offset_slice": lambda: randn(24, 40)[3:-2, 5:],
    "expanded": lambda: randn(24, 1).expand(24, 40),
    "selected_column": lambda: randn(24, 40)[:, 7],
    "transposed_3d_middle": lambda: randn(5, 9, 33).transpose(0, 1),
}


@pytest.mark.parametrize("name", sorted(NONCONTIGUOUS_INPUTS))
def test_noncontiguous_input_pointwise(name):
    x = NONCONTIGUOUS_INPUTS[name]()
    check(lambda x: (x * 2 + 1).sigmoid() - x, x)


@pytest.mark.parametrize("name", sorted(NONCONTIGUOUS_INPUTS))
@pytest.mark.cpu_only("a factory call inside the compiled function: dynamo does not apply torch.set_default_device to it, so eager and compiled results land on different devices")
def test_noncontiguous_input_reduction(name):
    x = NONCONTIGUOUS_INPUTS[name]()
    # The weights keep the reduction over dim 0 of the expanded input from being constant.
    check(lambda x: (x.sum(-1), (x * torch.arange(1.0, x.shape[-1] + 1)).amax(0)), x)


def test_transposed_plus_contiguous():
    # The output layout follows eager's TensorIterator rules for mixed layouts.
    a, b = randn(16, 24), randn(24, 16)
    check(lambda a, b: (a.t() + b, b + a.t(), a.t() * 2), a, b)


# ------------------------------------------------------------------------------------------------
# Views inside the function.

VIEW_CHAINS = {
    "view_permute_reshape_slice": lambda x: (
        x.view(4, 8, 6).permute(1, 0, 2).reshape(8, 24)[:, 2:20:3] * 2
    ),
    "unsqueeze_squeeze": lambda x: (x.unsqueeze(1) + x[:5].unsqueeze(0)).sum(-1).squeeze() + 1,
    "expand": lambda x: x[:, None, :6].expand(32, 5, 6) * torch.arange(5.0).view(1, 5, 1),
    "select": lambda x: x.select(1, 2) + x[:, 0] * x.select(0, -1)[3],
    "transpose": lambda x: x.view(4, 8, 6).transpose(0, 2) * 3,
    "narrow": lambda x: x.narrow(1, 2, 3).exp()[1:] + x.narrow(0, 1, 31).narrow(1, 0, 3),
    "flatten_unflatten": lambda x: x.view(2, 16, 6).flatten(1).unflatten(1, (6, 16)).sin(),
    "reshape_of_transpose": lambda x: x.t().reshape(-1) + 1,
    "view_of_contiguous_t": lambda x: (x.t().contiguous().view(32, 6) - x).abs(),
    "slice_of_permute_of_view": lambda x: (
        x.view(2, 4, 4, 6).permute(3, 1, 0, 2)[1::2, :, 1, ::3] + 0.5
    ),
    "diagonal": lambda x: x[:6].diagonal() * 2 + x[:6, :6].t().diagonal(1).sum(),
    "movedim_unbind": lambda x: torch.stack(
        x.view(4, 8, 6).movedim(2, 0).unbind(0)[::2], dim=-1
    ).cos(),
}


@pytest.mark.parametrize("name", sorted(VIEW_CHAINS))
@pytest.mark.cpu_only("a factory call inside the compiled function: dynamo does not apply torch.set_default_device to it, so eager and compiled results land on different devices")
def test_view_chain(name):
    check(VIEW_CHAINS[name], randn(32, 6))


def test_view_chain_on_noncontiguous_input():
    x = randn(12, 8, 10)[:, ::2].permute(2, 0, 1)
    check(lambda x: x.reshape(10, -1)[:, ::5].unsqueeze(-1).expand(10, 10, 3).sum(1) * 2, x)


# ------------------------------------------------------------------------------------------------
# cat.


def test_cat_dim0_dim1():
    a, b = randn(5, 12), randn(3, 12)
    check(lambda a, b: torch.cat([a, b], dim=0), a, b)
    c = randn(5, 4)
    check(lambda a, c: torch.cat([a, c], dim=1), a, c)


def test_cat_mixed_with_pointwise():
    a, b, c = randn(5, 12), randn(7, 12), randn(5, 12)
    check(lambda a, b, c: torch.cat([a.sin(), b * 2, c + a], dim=0).relu() + 1, a, b, c)
    check(lambda a, c: torch.cat([a.exp(), c.t().t() - 1, a * c], dim=1).sum(-1), a, c)


def test_cat_noncontiguous_and_mixed_dtypes():
    a = randn(12, 5).t()
    b = torch.randint(-5, 5, (5, 3))
    check(lambda a, b: torch.cat([a, b], dim=1) * 0.5, a, b)


def test_cat_3d_middle_dim_and_stack():
    a, b = randn(2, 3, 9), randn(2, 5, 9)
    check(lambda a, b: torch.cat([a, b, a], dim=1).tanh(), a, b)
    check(lambda a: torch.stack([a, a * 2, -a], dim=1), a)


def test_a_cats_only_pointwise_reader_is_computed_by_its_pieces(capfd, monkeypatch):
    # a masked fill over a concatenated gradient (Mixtral's experts) and rotary embedding's
    # rotated half read through a transpose: each piece's writer computes the reader over its
    # piece, and the concatenation is never stored
    torch.manual_seed(0)
    mask = torch.rand(64, 1) > 0.5
    a, b, c = randn(64, 48), randn(64, 48), randn(64, 48)

    def masked(a, b, c, mask):
        return torch.where(mask, 0.0, torch.cat([a * b, torch.nn.functional.silu(c)], dim=1))

    def rope(q, freqs):
        # the cos/sin table is itself a cat, read by both embeddings: the rotated halves merge
        emb = torch.cat([freqs, freqs], dim=-1)
        k = q.flip(1)
        rotated_q = torch.cat([-q[..., 32:], q[..., :32]], dim=-1)
        rotated_k = torch.cat([-k[..., 32:], k[..., :32]], dim=-1)
        return (q * emb.cos() + rotated_q * emb.sin()).transpose(1, 2), k * emb.cos() + rotated_k * emb.sin()

    def two_readers(a, b):
        x = torch.cat([a, b * 2], dim=0)
        return x.exp(), x + 1

    q, freqs = randn(2, 4, 16, 64), randn(16, 32)
    monkeypatch.setenv("FERROCORE_LOGS", "fusion")
    monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")  # the fusion log comes from a compile, not a cache hit
    for f, args, kernels in ((masked, (a, b, c, mask), 2), (rope, (q, freqs), None), (two_readers, (a, b), None)):
        torch._dynamo.reset()
        check(f, *args, expect_kernels=kernels)
        merged = capfd.readouterr().err.count("cat read in place")
        assert merged == {masked: 1, rope: 2, two_readers: 0}[f], f.__name__


# ------------------------------------------------------------------------------------------------
# Outputs: multiple, aliasing inputs, views of intermediates.


def test_multiple_outputs_of_different_kinds():
    x = randn(12, 20)
    check(lambda x: (x + 1, x.sum(0), x > 0, (x * 2).to(torch.float16), x.amax()), x)


def test_output_used_twice_and_intermediate_output():
    check(lambda x: (lambda y: (y, y * 2, y.sum(-1)))(x.exp() - 1), randn(12, 20))


ALIASING = {
    "transpose": lambda x: (x.t(), x + 1),
    "slice": lambda x: (x[1:], x.sum()),
    "view": lambda x: (x.view(-1), x * x),
    "strided_slice": lambda x: (x[::2, 1::3], x.cos()),
    "unsqueeze_expand": lambda x: (x.unsqueeze(0).expand(3, 12, 20), x.exp()),
    "select": lambda x: (x[2], x.relu()),
}


@pytest.mark.parametrize("name", sorted(ALIASING))
def test_output_aliases_input(name):
    check(ALIASING[name], randn(12, 20))


def test_output_view_of_intermediate():
    check(
        lambda x: ((x + 1).t(), (x * 2)[::2], (x - 1).view(4, 3, 20).permute(2, 0, 1)),
        randn(12, 20),
    )


def test_same_tensor_returned_twice():
    check(lambda x: (lambda y: (y, y))(x + 1), randn(12, 20))


# ------------------------------------------------------------------------------------------------
# 0-d, size-1 and size-0.


def test_zero_dim_inputs_and_outputs():
    s = torch.tensor(1.75)
    check(lambda s: s * 2 + s.exp(), s)
    check(lambda s, t: (s + t, s * t, torch.maximum(s, t)), s, torch.tensor(-0.5))
    check(lambda x: (x.sum() * x, x.mean()), randn(6, 7))


def test_zero_dim_with_2d():
    check(lambda s, x: (s + x, x / s, torch.where(x > s, x, s)), torch.tensor(0.3), randn(8, 16))


def test_size_one_dims():
    x = randn(1, 9, 1)
    check(
        lambda x, y: (x + y, (x * y).sum(0), x.squeeze(), x.expand(4, 9, 5) * 2), x, randn(4, 1, 5)
    )


def test_all_size_one():
    check(lambda x: (x.exp(), x.sum(1)), randn(1, 1, 1))


def test_size_zero_dims():
    x = randn(0, 5)
    check(lambda x: (x + 1).sin(), x)
    check(lambda x: x.sum(0), x, allow_constant=True)  # sum over an empty dim is 0
    check(lambda x: x.sum(1), x)
    check(lambda x, y: torch.cat([x, y]) * 2, x, randn(3, 5))
    check(lambda x: torch.softmax(x, -1), randn(3, 0))


def test_empty_mean_is_nan():
    check(lambda x: x.mean(0), randn(0, 4), allow_constant=True)


# ------------------------------------------------------------------------------------------------
# dtype coverage for one pointwise+reduction function.

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
]


def _input(dtype):
    if dtype is torch.bool:
        return torch.rand(9, 20) > 0.85  # some rows of x.t() are all False
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, (9, 20), dtype=dtype)
    return randn(9, 20, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_coverage(dtype):
    def fn(x):
        y = x.t() if dtype is torch.bool else (x * 3 - x.t().t())
        return y, y.amax(-1), torch.where(x.bool(), x, torch.zeros_like(x)), x.to(torch.float32) + 1

    check(fn, _input(dtype))
