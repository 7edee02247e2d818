"""Math functions over their whole float range, edges included (ferrocore has its own exp)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import check, is_ferrocore


def test_exp_over_the_float_range():
    x = torch.cat(
        [
            torch.linspace(-110, 95, 20001),
            torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 88.72, -87.5, -103.9]),
        ]
    )
    # atol: one unit of the subnormal range, where a float32 has fewer than 24 bits; eager's own
    # vectorized exp rounds subnormal results differently on AVX2 and AVX-512 machines
    check(lambda t: (t.exp(), torch.sigmoid(t), torch.softmax(t.view(1, -1)[:, :20000], -1)), x, rtol=2e-6,
          atol=2.0 ** -149)


def test_masked_softmax_rows():
    scores = torch.randn(64, 128)
    mask = torch.ones(128, 128, dtype=torch.bool).tril()[:64]
    check(lambda s, m: torch.softmax(s.masked_fill(~m, float("-inf")), -1), scores, mask)


def test_square_cube_and_reciprocal_powers_are_bit_identical_to_eager():
    # ATen computes pow(x, 2) as x*x, pow(x, 3) as x*x*x (the square rounded in bfloat16, and in
    # float16 on the GPU) and pow(x, -1) as 1/x; a general pow differs in the last bit
    import ferrocore

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = (torch.randn(257) * 3).to(dtype)
        x[:3] = torch.tensor([-0.0, float("inf"), float("-inf")]).to(dtype)
        for e in (2, -1, 2.0, -1.0, 3, 3.0):
            torch._dynamo.reset()
            fn = lambda t: t.pow(e) + 0  # noqa: E731
            got, want = torch.compile(fn, backend="ferrocore")(x), fn(x)
            assert got.dtype == want.dtype
            assert torch.equal(got, want), (dtype, e)
            text = open(ferrocore.metrics.last["module_path"]).read()
            # after the prelude (C++ or Triton), before `call` (whose comments quote the model's line)
            kernel = text[text.index("_poi_fused"):text.index("def call(")]
            assert "pow(" not in kernel


@pytest.mark.cpu_only("the C++ kernels' contraction: Triton kernels contract a product into a sum as CUDA "
                      "eager's nvcc-built kernels may (ARCHITECTURE.md, known deviations)")
def test_products_are_rounded_before_the_subtraction_as_eager_does():
    # no FMA contraction in the C++ kernels: with x = 1 + 2^-12, x*x rounds to 1 + 2^-11 in
    # float32 (a tie to even), so x*x - (1 + 2^-11) is 0 in eager; a fused multiply-add gives 2^-24
    x = torch.full((16,), 1.0 + 2.0**-12)
    c = torch.full((16,), 1.0 + 2.0**-11)
    fn = lambda t, u: t * t - u  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ferrocore")(x, c)
    assert torch.equal(got, fn(x, c)), got


@pytest.mark.cpu_only("the C++ kernels' contraction: Triton kernels contract a product into a sum as CUDA "
                      "eager's nvcc-built kernels may (ARCHITECTURE.md, known deviations)")
def test_variance_of_mixed_precision_products_matches_eager_exactly():
    # float32 * float64 promotes to float64; the one-element variance is 0/0 (NaN in eager, inf
    # when the mean's subtraction was fused with the product), and the variance of constant data
    # is exactly 0 (1.4e-17 when fused)
    one_x, one_y = torch.tensor([0.3]), torch.tensor([0.7], dtype=torch.float64)
    const_x, const_y = torch.full((7,), 0.3), torch.full((7,), 0.7, dtype=torch.float64)
    fns = [
        lambda x, y: torch.var(x * y, dim=0),
        lambda x, y: torch.var(x * y),
        lambda x, y: torch.std(x * y, dim=0),
        lambda x, y: torch.std(x * y),
        lambda x, y: torch.var_mean(x * y, dim=0),
        lambda x, y: torch.var_mean(x * y),
    ]
    for i, fn in enumerate(fns):
        for x, y in ((one_x, one_y), (const_x, const_y)):
            torch._dynamo.reset()
            got, want = torch.compile(fn, backend="ferrocore")(x, y), fn(x, y)
            got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape
                assert torch.equal(g, w) or (g.isnan().all() and w.isnan().all()), (i, x.numel(), g, w)


@pytest.mark.skipif(not is_ferrocore() or os.environ.get("FERROCORE_TEST_DEVICE", "cpu") != "cpu"
                    or shutil.which("nm") is None, reason="ferrocore's C++ kernels' library, read with binutils' nm")
def test_sin_and_cos_of_one_value_stay_vector_calls(tmp_path):
    # g++ merges the builtins' sin(x) and cos(x) of one argument into a scalar sincosf call (no
    # vector variant), and the fused loop stops vectorizing: 7x slower than Inductor
    import ferrocore

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    x = torch.randn(1000)
    for dtype in (torch.float32, torch.float64):
        gm = make_fx(lambda t: torch.sin(t) * torch.cos(t))(x.to(dtype))
        out = ferrocore.compile_graph(gm, [x.to(dtype)], {"backend": "cpp", "cache_dir": str(cache)})
        torch.testing.assert_close(out(x.to(dtype))[0], torch.sin(x.to(dtype)) * torch.cos(x.to(dtype)))
    libs = [p for p in cache.rglob("*.so") if not p.name.startswith(".")]
    assert libs
    calls = "\n".join(subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True,
                                     check=True).stdout for lib in libs)
    assert "sincos" not in calls, calls
    for fn in ("sinf", "cosf", "sin", "cos"):
        assert re.search(rf"_ZGV\w+_{fn}\b", calls), (fn, calls)


@pytest.mark.cpu_only("the C++ prelude")
def test_half_conversions_without_float16_type_match_the_compilers(tmp_path):
    # clang < 15 has no _Float16 on x86 (every kernel failed to compile under CXX=clang++): the
    # prelude's integer conversions must round as _Float16's do, checked here under g++
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    prelude = (Path(__file__).resolve().parent.parent / "crates/ferrocore/src/codegen/cpp/prelude.h").read_text()
    fallback = re.search(r"#ifdef __FLT16_MAX__\n.*?#else\n(.*?)#endif\n", prelude, re.S).group(1)
    harness = tmp_path / "half.cpp"
    harness.write_text("#include <cstdint>\n#include <cstdio>\n#include <cstring>\n" + fallback + r"""
int main() {
  long bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 ref; uint16_t hh = (uint16_t)h; memcpy(&ref, &hh, 2);
    float mine = ferro_h2f(hh), want = (float)ref;
    bad += memcmp(&mine, &want, 4) != 0 && !(mine != mine && want != want);
  }
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    uint32_t bits = (uint32_t)u; float f; memcpy(&f, &bits, 4);
    _Float16 r = (_Float16)f; uint16_t want; memcpy(&want, &r, 2);
    uint16_t mine = ferro_f2h(f);
    bad += f != f ? ((mine & 0x7c00) != 0x7c00 || (mine & 0x3ff) == 0) : mine != want;
  }
  printf("%ld\n", bad);
}
""")
    exe = tmp_path / "half"
    subprocess.run([cxx, "-O2", "-march=native", str(harness), "-o", str(exe)], check=True, timeout=120)
    assert subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True).stdout.strip() == "0"
