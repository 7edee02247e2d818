"""GPU kernels' binaries: compiled by worker processes, cached (signed, verified) and launched
through ferrocore's CUDA launcher. The compile needs Triton but no GPU (the target is named);
launching needs one (FERROCORE_TEST_DEVICE=cuda)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import is_ferrocore

pytestmark = pytest.mark.skipif(not is_ferrocore(), reason="ferrocore's own kernels")
triton = pytest.importorskip("triton")
ON_GPU = os.environ.get("FERROCORE_TEST_DEVICE", "cpu") == "cuda"


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    return str(d)


def _wrapper_module(cache_dir):
    """A compiled graph of Triton kernels and its wrapper module (rendered for CPU tensors: only
    its source is used)."""
    import ferrocore
    from ferrocore.static_compile import _import_module

    def f(x, y):
        return (x * 2 + y).relu().sum(1), torch.sigmoid(x)

    args = [torch.randn(64, 32, device="cpu"), torch.randn(64, 32, device="cpu")]
    with torch.device("cpu"):
        gm = make_fx(f)(*args)
    ferrocore.compile_graph(gm, args, {"backend": "triton", "cache_dir": cache_dir})
    path = ferrocore.metrics.last["module_path"]
    compiled = json.loads(Path(ferrocore.metrics.last["artifact_path"]).read_text())
    return compiled, _import_module(path, "kernel_binaries_test", Path(path).read_text(), None)


def test_a_worker_compiles_a_launchable_binary_that_the_cache_keeps(cache_dir):
    from ferrocore import artifact
    from ferrocore.runtime import kernel_binaries

    compiled, module = _wrapper_module(cache_dir)
    unit = artifact.unit_source(compiled)
    assert unit is not None and "@ferro_jit" in unit and "import torch" not in unit
    pool = kernel_binaries.compile_pool(1)
    assert pool is not None
    for entry in artifact.triton_kernels(compiled, module)[0]:
        fn, signature, constexprs, launch = entry
        binary = kernel_binaries.result(pool.submit(kernel_binaries.job(unit, entry, 90)), fn.__name__)
        assert binary is not None, fn.__name__
        assert binary["name"] == fn.__name__ and binary["cubin"][:4] == b"\x7fELF"
        assert binary["num_warps"] == launch["num_warps"] and 0 <= binary["trailing_nulls"] <= 2
        k = kernel_binaries.key(signature, constexprs, launch, 90)
        assert kernel_binaries.key(signature, constexprs, launch, 80) != k
        kernel_binaries.store(cache_dir, k, binary)
        assert kernel_binaries.load(cache_dir, k) == binary
    # an edited entry is a miss, never a binary
    entry = next(Path(cache_dir, "kernels").rglob("*.json"))
    data = json.loads(entry.read_text())
    data["binary"]["shared"] += 1
    entry.write_text(json.dumps(data))
    assert kernel_binaries.load(cache_dir, entry.stem) is None


def test_a_failed_job_or_a_dead_worker_falls_back_without_hanging(cache_dir, capfd):
    from ferrocore.runtime import kernel_binaries

    pool = kernel_binaries.CompilePool(1)
    try:
        bad = pool.submit(("compile", "x = (", "k", {}, {}, 4, 1, 90, 32))
        assert kernel_binaries.result(bad, "k") is None
        assert "SyntaxError" in capfd.readouterr().err
        pool.processes[0].kill()
        pool.processes[0].wait()
        for _ in range(2):  # the dead worker's thread fails every later job at once
            assert kernel_binaries.result(pool.submit(("compile", "", "k", {}, {}, 4, 1, 90, 32)), "k") is None
        assert "is gone" in capfd.readouterr().err
    finally:
        pool.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_without_a_gpu_the_launcher_is_an_error_not_a_crash():
    from ferrocore import _ferrocore

    with pytest.raises(_ferrocore.FerrocoreError, match="CUDA driver"):
        _ferrocore.CudaDriver()


def _model(x, w):
    h = torch.nn.functional.gelu(x @ w)
    return torch.softmax(h, -1) + 1, h.sum(0)


@pytest.mark.skipif(not ON_GPU, reason="launching needs a GPU (FERROCORE_TEST_DEVICE=cuda)")
def test_a_new_process_launches_the_cached_binaries(cache_dir):
    script = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, sys.argv[2])
        from test_kernel_binaries import _model
        from ferrocore import metrics
        torch.manual_seed(0)
        x, w = torch.randn(64, 96, device="cuda"), torch.randn(96, 200, device="cuda")
        with torch.no_grad():
            compiled = torch.compile(_model, backend="ferrocore", options={"cache_dir": sys.argv[1]})
            # looking the backend up started the workers (this process uses the GPU): let them
            # warm up, so that they, not this process, compile the kernels
            import time
            from ferrocore.runtime import kernel_binaries
            deadline = time.time() + 120
            while not any(p.ready for p in list(kernel_binaries._pools.values())) and time.time() < deadline:
                time.sleep(0.05)
            got = compiled(x, w)
            # a buffer off 16-byte alignment takes Triton's JIT path, with the same values
            xs = torch.randn(64 * 96 + 1, device="cuda")[1:].view(64, 96)
            shifted = compiled(xs, w)
        for g, want in zip(list(got) + list(shifted), list(_model(x, w)) + list(_model(xs, w))):
            assert g.stride() == want.stride() and g.dtype == want.dtype
            torch.testing.assert_close(g, want)
        t = metrics.total
        print("counts", t["kernels"], t["kernel_binary_hits"], t["compiled_in_workers"])
        """
    )
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "FERROCORE_LOGS": "kernel_compile"}
    runs = [subprocess.run([sys.executable, "-c", script, cache_dir, here], capture_output=True, text=True,
                           env=env, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    cold, warm = (tuple(map(int, r.stdout.split("counts")[1].split())) for r in runs)
    assert cold[0] > 0 and cold[2] > 0, cold  # compiled by the workers
    assert warm[1] > 0 and warm[2] == 0, warm  # loaded from the cache, nothing compiled
    # the timeline names where each kernel compiled, and when the workers were ready
    assert "[ferrocore:kernel_compile]" in runs[0].stderr and "(worker " in runs[0].stderr, runs[0].stderr[-3000:]
    assert "workers: " in runs[0].stderr and " 0 Triton kernels compiled" in runs[1].stderr


def test_kernels_go_to_the_workers_dearest_first():
    from ferrocore.runtime import kernel_binaries

    plain = "    tmp0 = tmp1 + tmp2\n" * 40
    longer = "    tmp0 = tmp1 + tmp2\n" * 80
    rotary = "    tmp0 = tl.math.cos(tmp1)\n    tmp2 = tl.math.sin(tmp1)\n" * 4
    assert kernel_binaries.compile_cost(longer) > kernel_binaries.compile_cost(plain)
    assert len(rotary) < len(plain)
    assert kernel_binaries.compile_cost(rotary) > kernel_binaries.compile_cost(longer)
    assert kernel_binaries.compile_cost("") == 0  # a kernel without source text


def test_a_module_import_makes_no_jit_function_until_one_is_needed(cache_dir):
    """`triton.jit` tokenizes each function's source: a wrapper module defers it, and a warm start
    (cached binaries) never needs it; the cache key is the same before and after."""
    from ferrocore import artifact
    from ferrocore.runtime import kernel_binaries, triton_support

    compiled, module = _wrapper_module(cache_dir)
    fn, signature, constexprs, launch = artifact.triton_kernels(compiled, module)[0][0]
    assert type(fn).__name__ == "DeferredJit" and type(module.ferro_max).__name__ == "DeferredJit"
    before = kernel_binaries.key(signature, constexprs, launch, 90)
    source = launch["text"]
    assert source.startswith("@ferro_jit\ndef " + fn.__name__ + "(") and "tl.store(" in source
    jit = triton_support.jit_function(fn)
    assert isinstance(jit, triton.runtime.jit.JITFunction) and jit.__name__ == fn.__name__
    # the callees too, where Triton's compiler looks them up
    assert isinstance(module.ferro_max, triton.runtime.jit.JITFunction)
    assert kernel_binaries.key(signature, constexprs, launch, 90) == before
    assert jit.src in source and fn.arg_names == jit.arg_names
