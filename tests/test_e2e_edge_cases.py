"""Edge cases across stages: size-1 and split reductions, extern inputs that are also outputs,
half-type scalars and intermediates, empty intermediates, huge slice steps, flipped views."""

import pytest
import torch
import torch.nn.functional as F
import ferrocore

from helpers import check


def test_reductions_over_size_one_dims():
    x = torch.randn(8, 1)
    check(lambda t: t.sum(-1) * 2, x)
    check(lambda t: torch.softmax(t, -1), x, allow_constant=True)
    check(lambda t: t.t().mean(0) + 1, x)
    check(lambda t: t.argmax(-1), x, allow_constant=True)
    check(lambda t: t.sum() + t.view(()) if t.numel() == 1 else t.view(8).sum(0, keepdim=True), x)


def test_full_arg_reduction_runs_split_across_threads():
    x = torch.randn(70000)
    x[12345] = 50.0
    check(lambda t: (t.argmax(), t.argmin(), torch.max(t, 0)[1]), x)


def test_output_returned_with_eager_strides_when_also_an_extern_input():
    x = torch.randn(6, 4).t()  # transposed input
    w = torch.randn(6, 3)
    check(lambda t, m: (torch.mm(t.sin(), m), t.sin()), x, w)


def test_half_comparison_with_a_scalar_rounds_the_scalar():
    x = torch.full((4,), 0.1, dtype=torch.float16)
    check(lambda t: (t == 0.1, t < 0.1, t >= 0.1), x, allow_constant=True)


def test_float_floor_division_matches_aten():
    x = torch.tensor([1.0, -1.0, 7.5, -7.5, 0.0, 3.0])
    check(lambda t: (t // 0.1, t // -0.3, torch.div(t, 0.7, rounding_mode="floor")), x)


def test_empty_intermediate_feeding_an_extern():
    x, w = torch.randn(4, 0), torch.randn(0, 3)
    check(lambda a, b: torch.mm(a.sin(), b) + 1, x, w, allow_constant=True)


def test_slice_with_huge_step():
    x = torch.randn(10, 3)
    check(lambda t: t[:: 2**40] * 2, x)


def test_float16_training_batch_norm_updates_running_stats():
    # ATen's functional batch norm returns float32 running stats for float16 inputs while the
    # graph's metadata says float16 (this once ran as a fallback whose result the wrapper had to
    # convert); the lowering computes in float32 and stores float16 like the metadata says
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, dtype=torch.float16)
    stats = [torch.zeros(3, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    mine = [s.clone() for s in stats]
    fn = lambda t, m, v: torch.nn.functional.batch_norm(t, m, v, training=True)  # noqa: E731
    want = fn(x, *stats)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ferrocore", dynamic=False)(x, *mine)
    # float16: the normalization's float32 rounding order may differ from ATen's by one ulp
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for a, b in zip(mine, stats):
        torch.testing.assert_close(a, b)
    assert ferrocore.metrics.last["fallbacks"] == 0


def test_flipped_view_output_and_bool_padding():
    x = torch.randn(5, 10)
    check(lambda t: torch.fliplr(t), x)
    check(lambda t: (t.flip(0), t.flip(1)[1:]), x)
    b = torch.rand(3, 4) > 0.5
    check(lambda t: torch.constant_pad_nd(t, (1, 2), True), b)


@pytest.mark.cpu_only("bit-exact to the scalar rounding of ATen's CPU kernels; the CUDA kernels' rounding is not matched bit for bit yet")
def test_half_type_scalars_round_like_eager():
    # add/sub/pow/fmod convert a Python scalar to the tensor's half type first, mul/div do not;
    # a filled (full_like) or padded tensor holds rounded values: bit-exact against eager
    import torch.nn.functional as F

    x = torch.randn(2000).bfloat16()
    fns = [
        lambda t: t * 0.1, lambda t: t + 0.3333, lambda t: t - 8.3961636, lambda t: 1.37 - t,
        lambda t: t.abs() ** 1.37, lambda t: torch.fmod(t, 0.3333), lambda t: t.half() / 3.3,
        lambda t: torch.full_like(t, 8.3961636) - t, lambda t: F.pad(t, (2, 2), value=0.3333) * 3,
    ]
    for fn in fns:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, backend="ferrocore")(x), fn(x))


def test_half_intermediates_stay_in_float_inside_a_kernel():
    # addcdiv decomposes into div, mul, add; ATen's fused kernel rounds once at the end, and so
    # must a fused kernel (rounding after each op was off by 0.037 on this bfloat16 sample)
    torch.manual_seed(5)
    a, b, c = (torch.randn(125) * 4).bfloat16(), torch.randn(125).bfloat16(), torch.randn(125).bfloat16()
    torch._dynamo.reset()
    got = torch.compile(lambda x, y, z: torch.addcdiv(x, y, z, value=0.7), backend="ferrocore")(a, b, c)
    reference = torch.addcdiv(a.float(), b.float(), c.float(), value=0.7).bfloat16()
    assert torch.equal(got, reference)
    # an explicit conversion still rounds
    x = torch.randn(64) * 3
    f = torch.compile(lambda t: t.bfloat16().float() * 3, backend="ferrocore")
    assert torch.equal(f(x), x.bfloat16().float() * 3)


@pytest.mark.parametrize("exponent", [0.5, -0.5, -2.0, 2.0, 3.0, -1.0, 0.7])
def test_pow_of_special_values_matches_eager_in_every_lane(exponent):
    # 0.5 / -0.5 are ATen's sqrt / rsqrt (NaN at -inf, -inf at -0.0), where C's pow gives +inf
    # and +0.0; nine of each so that vector lanes and scalar tails both see them
    specials = [float("-inf"), -0.0, float("inf"), float("nan"), 0.0, -2.0, 4.0]
    x = torch.tensor([v for v in specials for _ in range(9)])
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        check(lambda t: t ** exponent, x.to(dtype))


@pytest.mark.parametrize("dtype,value", [(torch.int8, 300), (torch.uint8, -256), (torch.int32, 2.0**31),
                                         (torch.int16, 40000), (torch.float32, 1e39)])
def test_fill_values_the_dtype_cannot_hold_raise_as_eager(dtype, value):
    # ATen's checked conversion raises; converting anyway gave 44 for 300 in int8
    x = torch.arange(4).to(dtype)
    fns = [lambda t: torch.where(t > 1, t, value), lambda t: t.masked_fill(t > 1, value),
           lambda t: t + torch.full((4,), value, dtype=dtype), lambda t: t.clone().fill_(value),
           lambda t: t.index_fill(0, t.new_tensor([1], dtype=torch.int64), value)]
    raised = 0
    for fn in fns:
        try:
            fn(x)
        except RuntimeError as eager:
            raised += 1
            torch._dynamo.reset()
            with pytest.raises(RuntimeError, match="cannot be converted to type"):
                torch.compile(fn, backend="ferrocore")(x)
        else:
            # a float scalar promotes `where` to float: no conversion, nothing raised
            check(fn, x, allow_fallbacks=True)
    assert raised >= 3


def test_fill_values_at_the_edge_of_the_dtype_compile():
    # c10's limits: unsigned types take negatives down to -max (they wrap); floats into integers
    # below max + 1 on the CPU (its fill truncates first), at most max on the GPU; a half type's
    # one-element fill converts unchecked on the CPU (to inf)
    cpu = torch.get_default_device().type == "cpu"
    check(lambda t: t.masked_fill(t > 1, -255), torch.arange(4, dtype=torch.uint8))
    check(lambda t: t.masked_fill(t > 1, 127.9 if cpu else 127.0), torch.arange(4, dtype=torch.int8))
    check(lambda t: t.masked_fill(t > 1, -1.5), torch.arange(4, dtype=torch.int8))
    if cpu:
        check(lambda t: torch.cat([t, torch.full((1,), 70000.0, dtype=torch.float16)]), torch.arange(4, dtype=torch.float16))
    for n in (4,) if cpu else (1, 4):
        with pytest.raises(RuntimeError, match="cannot be converted to type c10::Half"):
            torch._dynamo.reset()
            torch.compile(lambda t: t + torch.full((n,), 70000.0, dtype=torch.float16), backend="ferrocore")(
                torch.arange(n, dtype=torch.float16))


@pytest.mark.parametrize("case", ["adaptive1d", "adaptive2d", "adaptive3d", "window6x6"])
def test_max_pool_indices_of_windows_of_minus_infinity(case):
    # the window's first element, as eager (a window reduction's index started at 0)
    ninf = float("-inf")
    fn, x = {
        "adaptive1d": (lambda t: F.adaptive_max_pool1d(t, 2, return_indices=True), torch.full((1, 1, 6), ninf)),
        "adaptive2d": (lambda t: F.adaptive_max_pool2d(t, 2, return_indices=True), torch.full((1, 1, 4, 4), ninf)),
        "adaptive3d": (lambda t: F.adaptive_max_pool3d(t, 2, return_indices=True), torch.full((1, 1, 4, 4, 4), ninf)),
        "window6x6": (lambda t: F.max_pool2d(t, 6, return_indices=True), torch.full((1, 1, 12, 12), ninf)),
    }[case]
    x = torch.cat([x, torch.randn(x.shape, generator=torch.Generator().manual_seed(0), device="cpu").to(x.device)], 1)
    check(fn, x)


def test_float_constants_keep_every_bit():
    # the exchange format's parser rounded some constants by an ulp: nan_to_num's -FLT_MAX came
    # out past float32's range, and the fill fell back to an ATen call that raised
    consts = [torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.1, 1 / 3, 2.0**-1074,
              1.7976931348623157e308, 123456.78901234567, -9.87654321e-300]
    x = torch.zeros(3, dtype=torch.float64)
    for c in consts:
        torch._dynamo.reset()
        got = torch.compile(lambda t: t + c, backend="ferrocore")(x)
        assert torch.equal(got, x + c), (c, got[0].item())
    t = torch.tensor([[7, 2], [-4, -2]])
    check(lambda v: torch.nan_to_num(torch.cos(v) / 0), t)


def test_a_cpu_result_of_a_gpu_graph_is_computed_on_the_cpu():
    # `torch.arange(n)` without a device beside CUDA tensors: a Triton kernel wrote the CPU
    # result through a host pointer (an illegal address that broke the CUDA context)
    if torch.get_default_device().type == "cpu":
        pytest.skip("needs a GPU graph")
    x = torch.randn(6)
    check(lambda t: (torch.arange(5, device="cpu") * 3, t.sin(), torch.ones(3, device="cpu").cumsum(0) + 1), x,
          allow_fallbacks=True)


def test_fuzz_findings_at_the_edges_of_types():
    # found by the fuzzer's 10,000-program run, each wrong before:
    # an integer converted to float is +0.0 (g++ folded `(float)(int)x` into trunc(x): -0.0,
    # and atan2(-0.0, -0.0) is -pi)
    x = torch.tensor([0.1, -4.2, -1.5, -2.2, -1.1, -5.3, -3.9, 2.2, 1.1, 1.9, 0.955, -2.1, -2.2, 4.4, -0.549])
    check(lambda t: torch.atan2(t.to(torch.int32), t.to(torch.int32)), x)
    check(lambda t: torch.atan2(t.double().to(torch.int64).double(), t.double().to(torch.int64).double()), x)
    # an integer tensor meets a bfloat16 one in bfloat16 (32767 is 32768 there)
    a = torch.tensor([32767, -32768, 300, 257, 7], dtype=torch.int16)
    b = torch.tensor([0.7, 1.3, -2.5, 3.3, 0.1], dtype=torch.bfloat16)
    check(lambda p, q: (torch.remainder(p, q), p + q, p < q), a, b)
    # hardtanh's float bounds beyond uint8's range bound nothing (CUDA eager refuses the call)
    u = torch.tensor([0, 1, 2, 5, 200], dtype=torch.uint8)
    if u.device.type == "cpu":
        check(lambda t: F.hardtanh(t), u)


def test_gpu_fuzz_findings_on_rounding():
    # found by the Triton fuzz run on an H200, each wrong there before: x // x truncated the
    # 2-ulp quotient 0.99999994 to 0; a contracted FMA in a fused variance gave a one-element
    # row a nonzero deviation (std inf, eager NaN); libdevice flushed erfc's denormal result to
    # zero (lgamma inf, eager 102.6)
    x = torch.randn(64, 33) * 3
    check(lambda t: torch.div(t, t, rounding_mode="trunc") + torch.div(t * 3, t, rounding_mode="trunc"), x)
    check(lambda t: torch.std(F.gelu(t), [0], correction=1), torch.tensor([-0.7]), allow_constant=True)
    check(lambda t: (torch.special.erfc(t), torch.lgamma(torch.special.erfc(t))), torch.tensor([-2.0, 0.5, 3.0, 9.3, 9.5, 9.6]))


def test_kernels_of_one_text_and_other_dtypes_are_launched_apart():
    # found by the Triton fuzz run on an H200: two index_adds of one shape and other dtypes have
    # one kernel text (Triton's names no types); the second launched the first's binary, which
    # copied 3 bytes where 12 were due (values of whatever the memory held)
    idx = torch.tensor([2, 0, 2])
    check(lambda a, b, c, s: (torch.index_add(a, 0, idx, s, alpha=2), torch.index_add(b, 0, idx, s.double()),
                              torch.index_add(c, 0, idx, s.int())),
          torch.randn(3), torch.randn(3, dtype=torch.float64), torch.arange(3, dtype=torch.int32), torch.randn(3))


def test_wide_values_selected_by_index_bounds_in_large_blocks():
    # found by the Triton fuzz run on an H200 (programs 0:6564 and 0:6565 as one graph): an
    # int64 pad fused beside a stack and an asinh into one program block of 4096 elements
    # stored 7 of its 2112 values wrong (Triton 3.6 miscompiles such 64-bit stores under a
    # partial mask); blocks of 2048 are right
    def f(e, r, c, a, b):
        e.mul_(e)
        stacked = torch.stack([a, b, a], 2)
        return (r.flip([0]) + c, torch.asinh(c), F.pad(b, [1, -1, 1, 0, 2, 2], value=0),
                torch.neg(stacked.view([7, 12, 2, 2, 2, 2, -1])))

    a = torch.randint(-12, 13, (2, 2, 7, 32)).permute(3, 2, 1, 0)
    b = torch.randint(-12, 13, (32, 7, 2, 2))
    empty = torch.randn(2, 1).narrow(1, 0, 0)
    check(f, empty, torch.tensor([5]).expand(65), torch.tensor([3]), a, b, allow_constant=True)


def test_empty_inputs_are_never_read():
    # a load of an empty input hoisted before its loop of no iteration read a null pointer
    # (SIGSEGV), and a write into an empty input failed to compile
    empty = torch.zeros(0, dtype=torch.int64)
    big = torch.randn(6, 6249)
    check(lambda e, x: (torch.all(e.unsqueeze(-2), 1, keepdim=True), x.argmax()), empty, big, allow_constant=True)

    def write(e, k):
        e[:, -2:3].mul_(k)
        return e.to(torch.float32) + 1

    check(write, torch.zeros(7, 1, 0, dtype=torch.uint8), torch.tensor(3), allow_constant=True)
