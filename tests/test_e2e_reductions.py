"""Reductions end to end: every reduction over every dim of a 3-D tensor (with and without
keepdim), full and multi-dim reductions, integer/bool/low-precision reductions, argmax/argmin,
softmax/log_softmax and layer_norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check

# Odd sizes, the last one past a multiple of any vector width, so vector loops need tails.
SHAPE = (5, 7, 33)


def uniform(*shape, dtype=torch.float32):
    """Uniform in [0.5, 1.5): products over 33 elements stay well inside float32's range."""
    return (torch.rand(shape) + 0.5).to(dtype)


def any_of(x, dim, keepdim):
    # Threshold chosen so that each reduced row is all-False with probability 1/2: the result
    # has both values.
    n = x.shape[dim]
    return (x > 0.5 + 0.5 ** (1.0 / n)).any(dim, keepdim=keepdim)


REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k),
    "amax": lambda x, d, k: x.amax(d, keepdim=k),
    "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "var_c0": lambda x, d, k: torch.var(x, d, correction=0, keepdim=k),
    "var_c1": lambda x, d, k: torch.var(x, d, correction=1, keepdim=k),
    "prod": lambda x, d, k: x.prod(d, keepdim=k),
    "any": any_of,
}


@pytest.mark.parametrize("keepdim", [False, True], ids=["", "keepdim"])
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_over_dim(name, dim, keepdim):
    op = REDUCTIONS[name]
    check(lambda x: op(x, dim, keepdim), uniform(*SHAPE))


FULL_REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "mean": lambda x: x.mean(),
    "amax": lambda x: x.amax(),
    "amin": lambda x: x.amin(),
    "max": lambda x: x.max(),
    "var_c0": lambda x: x.var(correction=0),
    "var_c1": lambda x: x.var(),
    "std": lambda x: x.std(),
    "any": lambda x: ((x > 1.49).any(), (x > 1.6).any()),
    "all": lambda x: ((x > 0.51).all(), (x > 0.4).all()),
}


@pytest.mark.parametrize("name", sorted(FULL_REDUCTIONS))
def test_full_reduction(name):
    check(FULL_REDUCTIONS[name], uniform(*SHAPE))


def test_full_prod():
    # The product of 1155 values in [0.5, 1.5) is tiny (~1e-23): compare with atol=0, or any
    # result near zero would pass.
    check(lambda x: x.prod(), uniform(*SHAPE), atol=0.0)


MULTI_DIM = {
    "sum_0_2": lambda x: x.sum((0, 2)),
    "sum_neg": lambda x: x.sum(dim=(-1, -2), keepdim=True),
    "mean_1_2": lambda x: x.mean((1, 2)),
    "mean_0_1_keep": lambda x: x.mean((0, 1), keepdim=True),
    "amax_0_1": lambda x: x.amax((0, 1)),
    "amin_0_2_keep": lambda x: x.amin((0, 2), keepdim=True),
    "var_0_2": lambda x: torch.var(x, (0, 2), correction=1),
    "var_1_2_c0_keep": lambda x: torch.var(x, (1, 2), correction=0, keepdim=True),
    "all_dims": lambda x: x.sum((0, 1, 2)),
}


@pytest.mark.parametrize("name", sorted(MULTI_DIM))
def test_multi_dim_reduction(name):
    check(MULTI_DIM[name], uniform(*SHAPE))


def test_reductions_of_signed_values():
    x = torch.randn(SHAPE)
    check(lambda x: (x.sum(-1), x.amax(1), x.amin(0), x.mean(), torch.var_mean(x, -1)), x)


def test_reduction_with_nan():
    x = uniform(4, 9)
    x[1, 3] = float("nan")
    x[2, 0] = float("nan")
    check(lambda x: (x.amax(-1), x.amin(-1), x.sum(-1), x.amax(0)), x)


def test_reduction_with_inf():
    x = uniform(4, 9)
    x[0, 2] = float("inf")
    x[3, 5] = float("-inf")
    check(lambda x: (x.amax(-1), x.amin(-1), x.sum(-1), x.softmax(-1)), x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool], ids=str)
def test_integer_sum_promotes_to_int64(dtype):
    if dtype is torch.bool:
        x = torch.rand(SHAPE) > 0.5
    else:
        x = torch.randint(-1000, 1000, SHAPE, dtype=dtype)
    check(lambda x: (x.sum(-1), x.sum(0, keepdim=True), x.sum()), x)


def test_integer_reductions():
    x = torch.randint(-9, 10, SHAPE, dtype=torch.int32)
    check(lambda x: (x.amax(1), x.amin(-1), x[:, :, :4].prod(-1), (x != 0).all(-1)), x)


def test_int64_sum_exceeds_int32():
    x = torch.full((3, 8), 2**30, dtype=torch.int64) + torch.arange(24).view(3, 8)
    check(lambda x: x.sum(-1), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_low_and_high_precision_reductions(dtype):
    x = uniform(*SHAPE, dtype=dtype)
    check(lambda x: (x.sum(-1), x.mean(1), x.amax(0), torch.var(x, -1)), x)


def test_argmax_argmin_and_max_with_indices():
    x = torch.randn(SHAPE)
    check(lambda x: (x.argmax(-1), x.argmin(0), x.argmax(1, keepdim=True), x.argmax()), x)
    check(lambda x: torch.max(x, 1), x)
    check(lambda x: torch.min(x, -1, keepdim=True), x)


def test_reduction_over_size_one_dims():
    check(lambda x: (x.sum(0), x.amax(2, keepdim=True), x.mean((0, 2))), torch.randn(1, 7, 1))


def test_reduction_of_noncontiguous_input():
    base = torch.randn(33, 7, 5)
    check(lambda x: (x.sum(-1), x.amax(0), x.mean(1)), base.permute(2, 1, 0))
    check(lambda x: x.t().sum(-1), torch.randn(9, 40))


@pytest.mark.parametrize("columns", [16, 40, 1000, 1030])
def test_column_reductions_of_many_rows(columns):
    # reductions over the outer dim take a tile of columns per vector loop: the last tile is
    # partial, 3000 rows add in chunks, and an epilogue runs per column
    x = torch.randn(3000, columns)
    x[5, 3] = float("nan")
    x[2000, ::3] = 10.0
    check(lambda x: (x.sum(0), x.mean(0) * 2, x.amax(0), x.amin(0, keepdim=True), x.var(0), (x > 5).any(0)), x)
    check(lambda x: (x.sum(0) + x.abs().sum(0), x.sum(0, dtype=torch.float64)), torch.randn(3000, columns))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.bool])
def test_column_sums_of_every_type(dtype):
    x = torch.randint(-3, 4, (700, 40)).to(dtype)
    check(lambda x: (x.sum(0), x.sum((0, 1)), x.amax(0)), x, allow_constant=True)
    check(lambda x: x.sum(0), torch.randn(2, 30, 50).to(dtype) if dtype.is_floating_point else x.view(7, 100, 40))


def test_column_sum_of_a_million_rows_is_as_exact_as_eager():
    x = torch.rand(1_000_000, 20) + 1000
    ref = x.double().sum(0)
    compiled = torch.compile(lambda x: x.sum(0), backend="ferrocore")(x)
    eager_err = (x.sum(0).double() - ref).abs().max().item()
    err = (compiled.double() - ref).abs().max().item()
    assert err <= max(2 * eager_err, 1e-7 * ref.abs().max().item()), (err, eager_err)


def test_reduction_then_pointwise_epilogue():
    check(lambda x: (x.sum(-1, keepdim=True) * x).relu().amax(1) + 1, torch.randn(SHAPE))


# ------------------------------------------------------------------------------------------------
# softmax, log_softmax.


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_3d(fn, dim):
    check(lambda x: fn(x, dim), torch.randn(SHAPE) * 3)


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax], ids=["softmax", "log_softmax"])
def test_softmax_large_values_is_stable(fn):
    # exp(200) overflows float32: a softmax that does not subtract the max returns inf/nan.
    check(lambda x: fn(x, -1), torch.randn(16, 64) * 100 + 100)


def test_softmax_2d_last_dim_and_module():
    x = torch.randn(16, 64)
    check(lambda x: F.softmax(x, dim=-1), x)
    check(lambda x: torch.nn.functional.log_softmax(x, dim=0), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_softmax_low_precision(dtype):
    x = torch.randn(16, 64).to(dtype)
    check(lambda x: (torch.softmax(x, -1), torch.softmax(x, -1, dtype=torch.float32)), x)


def test_softmax_of_transposed_input():
    check(lambda x: torch.softmax(x.t(), -1), torch.randn(40, 12))


# ------------------------------------------------------------------------------------------------
# layer_norm.


def test_layer_norm_without_affine():
    check(lambda x: F.layer_norm(x, (64,)), torch.randn(8, 64) * 2 + 1)


def test_layer_norm_with_affine():
    x, w, b = torch.randn(8, 64), torch.randn(64), torch.randn(64)
    check(lambda x, w, b: F.layer_norm(x, (64,), w, b), x, w, b)


def test_layer_norm_multi_dim_normalized_shape():
    x, w, b = torch.randn(2, 5, 48), torch.randn(5, 48), torch.randn(5, 48)
    check(lambda x, w, b: F.layer_norm(x, (5, 48), w, b, eps=1e-3), x, w, b)


def test_layer_norm_odd_size_and_epilogue():
    x, w = torch.randn(3, 6, 33), torch.randn(33)
    check(lambda x, w: F.layer_norm(x, (33,), weight=w).relu() * 2, x, w)


def test_layer_norm_module():
    ln = torch.nn.LayerNorm(48)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    with torch.no_grad():
        check(ln, torch.randn(4, 10, 48))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_layer_norm_low_precision(dtype):
    x, w, b = torch.randn(8, 64).to(dtype), torch.randn(64).to(dtype), torch.randn(64).to(dtype)
    check(lambda x, w, b: F.layer_norm(x, (64,), w, b), x, w, b)
