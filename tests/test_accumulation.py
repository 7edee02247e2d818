"""How reductions and scans accumulate: long float sums as exact as eager's (C++: chunked
partial sums in the vector lanes added into a double or compensated total; `bench/accuracy.py`
measures 1e5..1e8 elements), float scans carrying a double total as CPU eager does, variances in
double on the CPU, and bool / narrow-integer accumulations that saturate or wrap as eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check, compile_fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def compiled(fn, *args):
    torch._dynamo.reset()
    return compile_fn(fn)[0](*args)


N = 10**6
# values drawn on the CPU (the same on every test device), then placed on the test device
gen = torch.Generator(device="cpu").manual_seed(0)


def _on_device(make):
    def made(*size, **kw):
        return make(*size, generator=gen, device="cpu", **{k: v for k, v in kw.items() if k != "generator"}).to(
            torch.get_default_device())
    return made


_rand, _randn = _on_device(torch.rand), _on_device(torch.randn)
LONG = {
    "sum": (lambda x: x.sum(), _rand(N)),
    "mean": (lambda x: x.mean(), _rand(N)),
    "var": (lambda x: x.var(), _randn(N) + 1000),
    "norm": (lambda x: torch.linalg.vector_norm(x), _randn(N)),
    "layer_norm": (lambda x: F.layer_norm(x, (N,)), _randn(1, N) + 1000),
    "mse_loss": (lambda x: F.mse_loss(x, x.flip(0) * 0.5), _rand(N)),
    "logsumexp": (lambda x: x.logsumexp(0), _randn(N)),
    "column_sum": (lambda x: x.sum(0), _rand(N // 16, 16)),
    "float64_sum": (lambda x: x.sum(), _randn(N, dtype=torch.float64) + 1),
}


@pytest.mark.parametrize("name", list(LONG))
def test_long_reductions_are_as_exact_as_eager(name):
    # one accumulator per thread had 100-1000x eager's error at this size (var: 1e6x)
    fn, x = LONG[name]
    ref = fn(x.double()) if x.dtype == torch.float32 else fn(x.to(torch.float64)).double()
    eager = rel_err(fn(x), ref)
    ours = rel_err(compiled(fn, x), ref)
    # at least one ulp of the result's type: both may be correctly rounded
    floor = torch.finfo(x.dtype).eps
    assert ours <= max(2 * eager, floor), f"{name}: error {ours:.2e}, eager's {eager:.2e}"


def test_a_sum_past_float_precision_counts_every_element():
    # a float accumulator stops at 2^24 per thread: 10^8 ones summed to 33554432
    assert compiled(lambda x: x.sum(), torch.ones(10**8)).item() == 10**8


def test_a_half_precision_sum_into_float_is_as_exact_as_eager():
    x = _rand(4 * 10**6).bfloat16()
    ref = x.double().sum()
    fn = lambda t: t.sum(dtype=torch.float32)  # noqa: E731
    assert rel_err(compiled(fn, x), ref) <= max(2 * rel_err(fn(x), ref), torch.finfo(torch.float32).eps)


@pytest.mark.cpu_only("CPU eager's scans carry a double; CUDA eager's a float")
@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_float_scans_carry_a_double_total_as_eager(op):
    # CPU eager's running total is a double, rounded to float per element: bitwise the same
    x = _rand(10**6) * 1e-5 + 1 if op == "cumprod" else _rand(10**6)
    fn = (lambda t: t.cumsum(0)) if op == "cumsum" else (lambda t: t.cumprod(0))
    assert torch.equal(compiled(fn, x), fn(x))


@pytest.mark.parametrize("shape", [(4, 256), (2, 100000)], ids=["short", "long"])
def test_bool_sums_saturate_as_eager(shape):
    ones = torch.ones(shape, dtype=torch.bool)
    mixed = _rand(*shape) > 0.9
    for x in (ones, mixed, ~ones):
        check(lambda t: t.sum(1, dtype=torch.bool), x, allow_constant=True)
        check(lambda t: t.sum(dtype=torch.bool), x, allow_constant=True)
        check(lambda t: t.prod(1, dtype=torch.bool), x, allow_constant=True)
        check(lambda t: (t.amax(1), t.amin(1), t.all(1), t.any(1)), x, allow_constant=True)


def test_narrow_integer_sums_wrap_as_eager():
    check(lambda t: t.sum(dtype=torch.int8), torch.full((300,), 3, dtype=torch.int8), allow_constant=True)
    check(lambda t: t.sum(1, dtype=torch.uint8), torch.full((3, 300), 3, dtype=torch.uint8), allow_constant=True)
    check(lambda t: t.cumsum(0, dtype=torch.int16), torch.full((40000,), 7, dtype=torch.int16))
