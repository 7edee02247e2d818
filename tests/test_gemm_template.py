"""GEMMs as matrix-product templates with their epilogues, against eager: values, shapes, strides,
dtypes, and the epilogue in the product's kernel. On the GPU (`gemm_template="always"`) they are
Triton kernels; without a GPU the same kernels run under Triton's interpreter
(tests/triton_cases.py, `gemm_template_*`). On the CPU, float32 GEMMs up to the C++ rule's size
are C++ kernels by default (codegen/cpp/gemm.rs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TEST_DEVICE
from helpers import check

gpu = pytest.mark.skipif(TEST_DEVICE == "cpu", reason="templates are Triton's: the GPU (interpreter: triton_cases.py)")
cpu = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the C++ matrix-product kernels")


def gemm_calls() -> int:
    import ferrocore

    return sum("mm" in op for op in ferrocore.metrics.last["extern_ops"])


@pytest.fixture
def templates(monkeypatch):
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "always")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_bias_gelu_is_one_kernel(templates, dtype):
    x, w, b = torch.randn(300, 256, dtype=dtype), torch.randn(384, 256, dtype=dtype) / 16, torch.randn(384, dtype=dtype)
    check(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), x, w, b, expect_kernels=1)


@gpu
def test_residual_and_returned_product(templates):
    x, w, r = torch.randn(4, 100, 192, dtype=torch.bfloat16), torch.randn(192, 192, dtype=torch.bfloat16) / 14, torch.randn(4, 100, 192, dtype=torch.bfloat16)
    check(lambda x, w, r: (x @ w, (x @ w) + r), x, w, r)


@gpu
def test_batched_transposed_operands(templates):
    q, k = torch.randn(12, 257, 64, dtype=torch.bfloat16), torch.randn(12, 200, 64, dtype=torch.bfloat16)
    check(lambda q, k: torch.bmm(q, k.transpose(1, 2)) * 0.125, q, k, expect_kernels=1)


@gpu
@pytest.mark.parametrize("mkn", [(1, 4096, 1024), (1000, 1000, 1000), (8, 3, 50257), (2048, 8, 16)])
def test_odd_shapes(templates, mkn):
    m, k, n = mkn
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    check(lambda a, b: torch.relu(a @ b), a, b, expect_kernels=1)


@gpu
def test_long_inner_dim_sums_in_float32(templates):
    # 65536 terms: the float32 accumulator keeps the sum as accurate as cuBLAS's
    a, b = torch.randn(64, 65536), torch.randn(65536, 48)
    check(lambda a, b: a @ b, a, b, atol=2e-3, rtol=1e-4)


@gpu
def test_measured_choice_is_cached_and_matches_eager(monkeypatch):
    # max-autotune's setting: each GEMM timed both ways; the timings are cached on disk
    import os
    from pathlib import Path

    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "measured")
    monkeypatch.setenv("FERROCORE_AUTOTUNE", "1")
    x, w, b = torch.randn(512, 384, dtype=torch.bfloat16), torch.randn(768, 384, dtype=torch.bfloat16) / 20, torch.randn(768, dtype=torch.bfloat16)
    check(lambda x, w, b: F.silu(F.linear(x, w, b)) * 2, x, w, b)
    entries = list((Path(os.environ["FERROCORE_CACHE_DIR"]) / "gemm_template").rglob("*.json"))
    assert entries, "no measurement was cached"


@gpu
def test_default_mode_takes_the_cached_choice(monkeypatch, tmp_path):
    # a measurement cached by max-autotune decides the default mode's compile; with nothing
    # cached the GEMM stays a library call (nothing is timed outside max-autotune)
    import ferrocore
    from ferrocore import gemm_choice

    monkeypatch.setattr(gemm_choice, "MIN_GAIN", 1e9)  # the template wins whatever was timed
    monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")
    x, w, b = torch.randn(256, 128, dtype=torch.bfloat16), torch.randn(320, 128, dtype=torch.bfloat16) / 12, torch.randn(320, dtype=torch.bfloat16)

    def f(x, w, b):
        return torch.relu(F.linear(x, w, b)) - 1

    def gemm_calls():
        return sum("mm" in op for op in ferrocore.metrics.last["extern_ops"])

    for mode, cache, calls in (("cached", tmp_path / "empty", 1), ("measured", tmp_path / "c", 0), ("cached", tmp_path / "c", 0)):
        monkeypatch.setenv("FERROCORE_CACHE_DIR", str(cache))
        monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", mode)
        torch._dynamo.reset()
        check(f, x, w, b, expect_kernels=1)
        assert gemm_calls() == calls, (mode, ferrocore.metrics.last["extern_ops"])


@gpu
@pytest.mark.parametrize("stride", [1, 2])
def test_convolution_template_with_its_epilogue(templates, stride):
    # an implicit-GEMM convolution (channels-last graph), its bias, SiLU and a residual in the
    # template's epilogue: two kernels (the weight copied with its channels innermost, then the
    # convolution), no library call
    import ferrocore

    cl = torch.channels_last
    x = torch.randn(4, 64, 30, 30, dtype=torch.bfloat16).to(memory_format=cl)
    w, b = torch.randn(96, 64, 3, 3, dtype=torch.bfloat16) / 24, torch.randn(96, dtype=torch.bfloat16)
    r = torch.randn(4, 96, 30 // stride, 30 // stride, dtype=torch.bfloat16).to(memory_format=cl)
    # (a sum in another order than cuDNN's may round the bfloat16 result one unit apart: 1/64 at 2 to 4)
    check(lambda x, w, b, r: F.silu(F.conv2d(x, w, b, stride=stride, padding=1)) + r, x, w, b, r,
          atol=2e-2, rtol=2e-2, expect_kernels=2)
    assert ferrocore.metrics.last["extern_ops"] == [], ferrocore.metrics.last["extern_ops"]


@gpu
def test_depthwise_convolution_template(templates):
    # a MobileNet-style depthwise convolution (channels-last, one filter per channel) with its
    # bias and hard-swish: one kernel, no library call
    import ferrocore

    x = torch.randn(8, 96, 28, 28, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w, b = torch.randn(96, 1, 3, 3, dtype=torch.bfloat16) / 3, torch.randn(96, dtype=torch.bfloat16)
    check(lambda x, w, b: F.hardswish(F.conv2d(x, w, b, stride=2, padding=1, groups=96)), x, w, b,
          atol=2e-2, rtol=2e-2, expect_kernels=1)
    assert ferrocore.metrics.last["extern_ops"] == [], ferrocore.metrics.last["extern_ops"]


@gpu
def test_measured_convolution_choice_matches_eager(monkeypatch):
    # max-autotune's setting: the convolution timed as a template and as cuDNN's call, with its
    # epilogue; either way the values are eager's
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "measured")
    monkeypatch.setenv("FERROCORE_AUTOTUNE", "1")
    cl = torch.channels_last
    x = torch.randn(8, 128, 32, 32, dtype=torch.bfloat16).to(memory_format=cl)
    w, b = torch.randn(128, 128, 3, 3, dtype=torch.bfloat16) / 34, torch.randn(128, dtype=torch.bfloat16)
    check(lambda x, w, b: F.silu(F.conv2d(x, w, b, padding=1)), x, w, b)


def test_measured_regions_are_a_gemm_and_its_pointwise_readers():
    # what max-autotune times against the library: the GEMM, the view and the pointwise nodes
    # over its result (the residual is an input of the cut-out graph), not the softmax after them
    from torch.fx.experimental.proxy_tensor import make_fx

    from ferrocore import gemm_choice

    def f(x, w, b, r):
        h = F.gelu(torch.addmm(b, x.view(-1, 16), w).view(2, 4, 8)) + r
        return torch.softmax(h, -1)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 4, 16), torch.randn(16, 8), torch.randn(8), torch.randn(2, 4, 8))
    addmm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default)
    region = gemm_choice._Region.of(addmm)
    names = [str(n.target) for n in region.nodes]
    assert names == ["aten.addmm.default", "aten.view.default", "aten.gelu.default", "aten.add.Tensor"], names
    assert [list(t.shape) for t in region.inputs] == [[8], [8, 16], [16, 8], [2, 4, 8]]
    # the same region traced again is the same cache entry
    again = gemm_choice._Region.of(next(n for n in make_fx(f, tracing_mode="fake")(
        torch.randn(2, 4, 16), torch.randn(16, 8), torch.randn(8), torch.randn(2, 4, 8)).graph.nodes
        if n.target is torch.ops.aten.addmm.default))
    assert again.key == region.key


def test_measured_gpu_regions_take_the_operands_prologue():
    # on the GPU an operand computed for the GEMM alone (a weight's cast and transpose, a
    # scaling) is cut out with it: the template computes it per tile, the library call reads it
    # from a kernel of its own; an operand that is only a view of an input is not
    from torch.fx.experimental.proxy_tensor import make_fx

    from ferrocore import gemm_choice

    def f(x, w):
        return torch.relu((x * 0.5).view(-1, 16) @ w.to(torch.bfloat16).t())

    fake = torch.empty(2, 4, 16, dtype=torch.bfloat16, device="meta"), torch.empty(8, 16, device="meta")
    gm = make_fx(f, tracing_mode="fake")(*fake)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    names = sorted(str(n.target) for n in gemm_choice._Region.of(mm).nodes)
    assert names == sorted(["aten.mul.Tensor", "aten.view.default", "aten._to_copy.default", "aten.t.default",
                            "aten.mm.default", "aten.relu.default"]), names
    gm = make_fx(lambda x, w: x.view(-1, 16) @ w.t(), tracing_mode="fake")(*fake[:1], torch.empty(8, 16, dtype=torch.bfloat16, device="meta"))
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert [str(n.target) for n in gemm_choice._Region.of(mm).nodes] == ["aten.mm.default"]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_computed_operands_are_read_in_the_product_kernel(templates, dtype):
    # a float32 weight cast and transposed, an activation scaled: computed per tile in the
    # product's kernel (k = 200: a last partial step, where x * 0.5 + 1 is not zero)
    x, w = torch.randn(300, 200, dtype=dtype), torch.randn(384, 200) / 16
    check(lambda x, w: torch.relu((x * 0.5 + 1) @ w.to(dtype).t()), x, w, expect_kernels=1)


# ---- the C++ matrix-product kernels (float32, CPU) -------------------------------------------


@cpu
def test_cpu_linear_bias_gelu_is_one_kernel():
    # a linear layer's weight is read transposed: the kernel packs the activations' rows instead
    x, w, b = torch.randn(2, 32, 64), torch.randn(192, 64) / 8, torch.randn(192)
    check(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), x, w, b, expect_kernels=1)
    assert gemm_calls() == 0


@cpu
def test_cpu_residual_and_returned_product():
    x, w, r = torch.randn(4, 10, 48), torch.randn(48, 40) / 7, torch.randn(4, 10, 40)
    check(lambda x, w, r: (x @ w, (x @ w) + r), x, w, r)
    assert gemm_calls() == 0


@cpu
def test_cpu_batched_transposed_operands():
    q, k = torch.randn(12, 57, 16), torch.randn(12, 40, 16)
    check(lambda q, k: torch.bmm(q, k.transpose(1, 2)) * 0.125, q, k, expect_kernels=1)


@cpu
@pytest.mark.parametrize("mkn", [(1, 7, 5), (13, 70, 33), (8, 3, 503), (2048, 8, 16), (130, 40, 300)])
def test_cpu_odd_shapes(mkn):
    # tiles cut at rows of 64 and columns of 256; the last of each partial; (130, 40, 300) spans
    # six tiles and is large enough to split them across threads
    m, k, n = mkn
    a, b = torch.randn(m, k), torch.randn(k, n)
    check(lambda a, b: torch.relu(a @ b), a, b, expect_kernels=1)
    assert gemm_calls() == 0


@cpu
def test_cpu_strided_operands():
    # a transposed and a column-sliced operand read in place, each element at its stride
    a, b = torch.randn(70, 33), torch.randn(80, 90)
    check(lambda a, b: a.t() @ b[:70, ::3] - 1, a, b, expect_kernels=1)


@cpu
def test_cpu_long_sum_and_large_product_with_templates_always(monkeypatch):
    # past the default rule: k in several packed panels of 256, many tiles over the threads
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "always")
    a, b = torch.randn(8, 5000), torch.randn(5000, 24)
    check(lambda a, b: a @ b, a, b, atol=2e-4, rtol=1e-4)
    a, b, c = torch.randn(300, 500), torch.randn(500, 700), torch.randn(700)
    check(lambda a, b, c: torch.addmm(c, a, b).sigmoid(), a, b, c, expect_kernels=1, atol=1e-5, rtol=1e-5)
    assert gemm_calls() == 0


@cpu
def test_cpu_large_gemm_stays_a_library_call():
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    check(lambda a, b: torch.relu(a @ b), a, b)
    assert gemm_calls() == 1


@cpu
def test_cpu_linear_training_gradients():
    # the backward's GEMMs read the saved activations and the output gradient transposed
    lin = torch.nn.Linear(48, 40)
    x = torch.randn(6, 48, requires_grad=True)

    def f(x):
        return F.silu(lin(x)).sum(0)

    import ferrocore  # noqa: F401  (registers the backend)

    compiled = torch.compile(f, backend="ferrocore")
    out, ref = compiled(x), f(x)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (x, lin.weight, lin.bias), g)
    want = torch.autograd.grad(f(x), (x, lin.weight, lin.bias), g)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        torch.testing.assert_close(a, b)


@cpu
@pytest.mark.parametrize("template_wins", [True, False])
def test_cpu_max_autotune_takes_the_measured_choice(monkeypatch, template_wins):
    # `measured` (max-autotune's setting) times each float32 GEMM with its epilogue both ways,
    # caches the timings, and the lowering follows them, not the size rule
    import os
    from pathlib import Path

    from ferrocore import gemm_choice

    monkeypatch.setattr(gemm_choice, "MIN_GAIN", 1e9 if template_wins else 0.0)
    monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "measured")
    x, w, b = torch.randn(24, 40), torch.randn(56, 40) / 6, torch.randn(56)
    check(lambda x, w, b: torch.tanh(F.linear(x, w, b)) * 3, x, w, b, expect_kernels=1 if template_wins else None)
    assert gemm_calls() == (0 if template_wins else 1)
    entries = list((Path(os.environ["FERROCORE_CACHE_DIR"]) / "gemm_template").rglob("*.json"))
    assert entries, "no measurement was cached"
