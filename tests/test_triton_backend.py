"""The Triton backend without a GPU: end-to-end graphs with the backend forced on CPU tensors under
Triton's interpreter, compared with eager (values, shapes, strides, dtypes), and every generated
kernel compiled ahead of time for sm_90 (PTX + cubin; Triton bundles ptxas).

The cases live in tests/triton_cases.py and run in one subprocess, so that TRITON_INTERPRET=1 is
set before triton is imported and never leaks into the other test modules; a second subprocess
(without the interpreter) compiles the kernels those cases generated.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import re

import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("triton_cases", HERE / "triton_cases.py")
triton_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(triton_cases)

pytest.importorskip("triton")


def _cache_dir() -> Path:
    return Path(os.environ.get("FERROCORE_CACHE_DIR") or HERE.parent / ".ferrocore-cache-test").resolve()


def _run(args, out: Path, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "triton_cases.py"), *args],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0 and out.exists(), f"worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


# the interpreted cases run in this many processes at once (CI's two cores; the interpreter is
# single-threaded)
SHARDS = 2


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("triton")
    env = dict(os.environ, FERROCORE_CACHE_DIR=str(_cache_dir()))
    outs = [d / f"cases{i}.json" for i in range(SHARDS)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "triton_cases.py"), str(out), f"{i}/{SHARDS}"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i, out in enumerate(outs)]
    results: dict = {}
    try:
        for proc, out in zip(procs, outs):
            # (cold: about two minutes of cases in one process on this project's 2-core machine,
            # with the interpreter's reductions as numpy calls: triton_cases.py)
            _, err = proc.communicate(timeout=2400)
            assert proc.returncode == 0 and out.exists(), f"worker failed ({proc.returncode}):\n{err[-6000:]}"
            results.update(json.loads(out.read_text()))
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.fixture(scope="module")
def compiled_sm90(interpreted, tmp_path_factory) -> dict:
    pytest.importorskip("triton.backends.nvidia")
    d = tmp_path_factory.mktemp("triton_aot")
    cases = d / "cases.json"
    cases.write_text(json.dumps(interpreted))
    out = d / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(_cache_dir() / "triton")
    return _run(["--aot", str(cases), str(out)], out, env)


@pytest.mark.parametrize("name", list(triton_cases.CASES))
def test_matches_eager_under_interpreter(interpreted, name):
    r = interpreted[name]
    assert r["ok"], r["detail"]


@pytest.mark.parametrize("name", [n for n, c in triton_cases.CASES.items() if not c["fallback"] and not c["raises"]])
def test_kernels_compile_for_sm90(compiled_sm90, name):
    kernels = {k: v for k, v in compiled_sm90.items() if k.split(":")[0] == name}
    assert kernels, f"no Triton kernels were generated for {name}"
    failed = {k: v["detail"] for k, v in kernels.items() if not v["ok"]}
    assert not failed, failed


def test_kernel_names_and_configs(interpreted):
    """Descriptive kernel names, and a looped reduction where the row does not fit a block."""
    src = "".join(Path(p).read_text() for p in interpreted["sum_looped"]["modules"])
    assert "def triton_red_fused_sum_amax_add_0(" in src
    assert "for r0offset in range(0, 10000, 1024):" in src
    src = "".join(Path(p).read_text() for p in interpreted["pointwise_chain"]["modules"])
    assert "def triton_poi_fused_" in src and "tl.program_id(0) * XBLOCK" in src
    # indices provably below 2**31: int32 index math; the values themselves are int64
    src = "".join(Path(p).read_text() for p in interpreted["int64_arange_exact"]["modules"])
    assert "xoffset = tl.program_id(0) * XBLOCK" in src and "tl.full([1], 1000000000, tl.int64)" in src


def test_gemm_templates_fuse_their_epilogue(interpreted):
    # the product, its bias, relu and residual add: one matrix-product kernel, one launch
    src = "".join(Path(p).read_text() for p in interpreted["gemm_template_addmm_relu_residual"]["modules"])
    assert re.findall(r"^def (triton_\w+)\(", src, re.M) == ["triton_mm_fused_addmm_relu_add_0"], src
    assert "acc = tl.dot(a, b, acc, input_precision=\"ieee\")" in src and "torch.ops.aten" not in src
    assert "'BLOCK_M': 64, 'BLOCK_N': 64, 'BLOCK_K': 32" in src
    # a product the softmax reads along its rows is stored by its kernel; the softmax is another
    src = "".join(Path(p).read_text() for p in interpreted["gemm_template_bmm_transposed_softmax"]["modules"])
    assert re.findall(r"^def (triton_\w+)\(", src, re.M)[0].startswith("triton_mm_fused_bmm")
    assert len(re.findall(r"^def (triton_\w+)\(", src, re.M)) == 2, src


def test_gemm_templates_compute_their_prologue(interpreted):
    # an operand computed from what the graph reads (a scaling, a cast and a transpose) is
    # computed per tile in the product's kernel, never stored
    for name in ("gemm_template_prologue_scale_shift", "gemm_template_prologue_weight_cast",
                 "gemm_template_prologue_both_batched"):
        src = "".join(Path(p).read_text() for p in interpreted[name]["modules"])
        assert len(re.findall(r"^def (triton_\w+)\(", src, re.M)) == 1, src
        assert "ka = k0 + rk" in src and "torch.ops.aten" not in src, src
    src = "".join(Path(p).read_text() for p in interpreted["gemm_template_prologue_scale_shift"]["modules"])
    assert "a = tl.broadcast_to(tl.where(a_mask, " in src, src
    # an operand's own conversion to float32 stays in its prologue (two products, two kernels)
    src = "".join(Path(p).read_text() for p in interpreted["gemm_template_prologue_ends_in_a_conversion"]["modules"])
    assert src.count("ka = k0 + rk") == 2 and "torch.ops.aten" not in src, src


def test_depthwise_convolutions_are_templates_with_their_epilogue(interpreted):
    # one filter per channel: the taps' loop multiplies each column by its own filter (no dot),
    # and the bias and hard-swish follow in the same kernel
    src = "".join(Path(p).read_text() for p in interpreted["conv_template_depthwise_hardswish"]["modules"])
    assert re.findall(r"^def (triton_\w+)\(", src, re.M) == ["triton_conv_fused_convolution_add_clamp_mul_div_0"], src
    assert "for tap in range(0, 25):" in src and "acc = acc + a.to(tl.float32) * b.to(tl.float32)[None, :]" in src, src


def test_narrow_reductions_split_in_two_stages(interpreted):
    # a full sum of 100003 elements: 48 first-stage programs of 2084 (a prime length: the last
    # chunk wraps around to load in bounds and is masked by position) into a [48] partial
    # buffer, then one program combining the 48
    src = "".join(Path(p).read_text() for p in interpreted["split_reductions"]["modules"])
    assert "empty_strided_cpu((48,), (1,), torch.float32)" in src
    assert "tl.load(in_ptr0 + ((2084*x0 + r0_1) % 100003)" in src and "r0mask = r0index < 2084" in src
    assert "xmask = xindex < 48" in src
    assert "r0index = tl.arange(0, 64)[None, :]" in src and "r0mask = r0index < 48" in src
    # 256 rows fill the device: one looped kernel, no partial buffer
    src = "".join(Path(p).read_text() for p in interpreted["sum_looped"]["modules"])
    assert src.count("@ferro_jit\ndef triton_red_") == 1


def test_long_variances_take_one_pass(interpreted):
    # the mean and the Welford M2 accumulate in the same loop over x; merged by ferro_welford
    src = "".join(Path(p).read_text() for p in interpreted["welford_variances"]["modules"])
    assert "ferro_welford)" in src and "_acc_m2 = tl.where(" in src
    kernels = re.findall(r"^def (triton_red_\w+)\(", src, re.M)
    # one kernel over x: every mean and M2 in one loop, then layer_norm's normalizing loop
    assert len(kernels) == 1, kernels
    assert src.count("    # group ") == 2 and src.count("for r0offset in range(0, 9000, 1024)") == 1, src


def test_split_variances_read_their_input_once(interpreted):
    # the chunks' Welford M2 and sum in one loop over the input; no second pass that reads the
    # mean back
    src = "".join(Path(p).read_text() for p in interpreted["split_variances"]["modules"])
    assert "ferro_welford)" in src
    first_stages = [k for k in src.split("@ferro_jit") if "for r0offset in range(" in k]
    assert first_stages and all("_acc_m2 = tl.where(" in k for k in first_stages), src


def test_in_place_writes_follow_the_other_reads(interpreted):
    # one kernel reads the GEMM result for the mask, then writes the doubled values over it
    src = "".join(Path(p).read_text() for p in interpreted["in_place_beside_a_mask"]["modules"])
    (kernel,) = [k for k in src.split("@ferro_jit")[1:] if "def triton_poi" in k]
    stores = re.findall(r"tl\.store\((\w+) ", kernel)
    loads = re.findall(r"tl\.load\((\w+) ", kernel)
    assert loads == ["out_ptr0"] and stores == ["out_ptr1", "out_ptr0"], kernel


def test_transposes_take_2d_tiles(interpreted):
    # a read contiguous along rows and one along columns: 64 x 64 tiles, each access coalesced
    src = "".join(Path(p).read_text() for p in interpreted["transpose_tiled"]["modules"])
    assert "x0 = yoffset + tl.arange(0, 64)[:, None]" in src
    assert "x1 = xoffset + tl.arange(0, XBLOCK)[None, :]" in src
    # the loops follow the output, laid out as eager lays out a.t() + b (column-major)
    assert "xmask = (x0 < 70) & (x1 < 100)" in src
    src = "".join(Path(p).read_text() for p in interpreted["head_split_transpose"]["modules"])
    assert "x0 = yoffset + tl.arange(0, 64)[:, None]" in src
    src = "".join(Path(p).read_text() for p in interpreted["pointwise_chain"]["modules"])
    assert "yoffset" not in src


def test_identical_kernels_are_defined_once(interpreted):
    src = "".join(Path(p).read_text() for p in interpreted["repeated_layer"]["modules"])
    defined = re.findall(r"^def (triton_\w+)\(", src, re.M)
    launched = re.findall(r"^\s+launch_(triton_\w+)\(", src, re.M)
    assert len(launched) == 3 and len(set(launched)) == 1, launched
    assert defined.count(launched[0]) == 1


def test_backend_option_and_env(monkeypatch):
    from ferrocore import options

    monkeypatch.delenv("FERROCORE_BACKEND", raising=False)
    assert options.build_options()["backend"] == "auto"
    assert options.build_options({"backend": "triton"})["backend"] == "triton"
    monkeypatch.setenv("FERROCORE_BACKEND", "Triton")
    assert options.build_options()["backend"] == "triton"
    monkeypatch.setenv("FERROCORE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="backend"):
        options.build_options()


@pytest.mark.cpu_only("its CPU graphs become CUDA graphs when the suite runs on the GPU")
def test_cpu_graphs_get_cpp_kernels_unless_triton_is_forced(monkeypatch):
    """In this process (no interpreter): the forced Triton module is generated and imported
    (defining its kernels needs no GPU) but not run; the default stays C++."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    import ferrocore

    monkeypatch.delenv("FERROCORE_BACKEND", raising=False)
    gm = make_fx(lambda a: (a.relu() + 1).sum(-1))(torch.randn(4, 8))
    x = torch.randn(4, 8)
    out = ferrocore.compile_graph(gm)(x)
    assert ferrocore.metrics.last["backend"] == "cpp"
    torch.testing.assert_close(out[0], (x.relu() + 1).sum(-1))
    ferrocore.compile_graph(gm, options={"backend": "triton"})
    last = ferrocore.metrics.last
    assert last["backend"] == "triton" and last["kernels"] == 1 and not last["graph_fallback"]
    source = Path(last["module_path"]).read_text()
    compiled = json.loads(Path(last["artifact_path"]).read_text())
    assert "@ferro_jit\ndef triton_red_fused_" in source and compiled["language"] == "triton"
    assert [k["launch"]["kind"] for k in compiled["kernels"]] == ["grid"]


def test_bound_launcher_calls_the_binary_directly(monkeypatch):
    # after precompile: the binary's launcher with (grid, 1, 1, stream, ...) and every parameter,
    # XBLOCK last; Triton's JIT call for unaligned addresses or a launcher of another convention
    import torch

    from ferrocore.runtime.triton_support import triton_options
    from ferrocore.runtime.triton_launch import TritonLaunch

    calls = []

    class Jit:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(("jit", grid, a, kw))

    class Binary:
        function, packed_metadata = "fn", "meta"

        def _init_handles(self):
            calls.append("init")

        def run(self, *a):
            calls.append(("run", a))

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1000 + i, raising=False)
    launch = TritonLaunch(Jit(), 7, {"XBLOCK": 64}, 4, 1)
    x, y = torch.zeros(8), torch.zeros(8)
    launch(x, y)
    # Triton's compile options go with every JIT launch (no FMA contraction: triton_options)
    assert calls.pop() == ("jit", (7,), (x, y), {"XBLOCK": 64, "num_warps": 4, "num_stages": 1, **triton_options()})
    launch.bind(Binary(), 2)
    assert calls.pop() == "init"
    launch(x, y)
    assert calls.pop() == ("run", (7, 1, 1, 1002, "fn", "meta", None, None, None, x, y, 64))
    launch(x, y[1:])  # 4 bytes past an aligned address
    assert calls.pop()[0] == "jit"

    def wrong_convention(*a):
        raise TypeError("launcher takes 11 arguments")

    Binary.run = staticmethod(wrong_convention)
    launch.bind(Binary(), 0)
    launch(x, y)
    assert calls.pop()[0] == "jit" and launch._fast is None
