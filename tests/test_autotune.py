"""Autotuning (mode="max-autotune", FERROCORE_AUTOTUNE=1): candidate configurations from the
Triton backend, the tuner's choice and its on-disk cache. The tuner's timing runs on a GPU; here
a stand-in times the candidates, so the choice and the cache are checked without one."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

import ferrocore
from ferrocore import artifact, options
from ferrocore.runtime import autotune

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_option_and_env(monkeypatch):
    monkeypatch.delenv("FERROCORE_AUTOTUNE", raising=False)
    assert options.build_options()["autotune"] is False
    monkeypatch.setenv("FERROCORE_AUTOTUNE", "1")
    assert options.build_options()["autotune"] is True


def test_triton_kernels_list_valid_candidates(tmp_path, monkeypatch):
    # the compiled graph lists each kernel's candidates, heuristic first, with its buffers' sizes
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: torch.softmax(x, -1) + 1)(torch.randn(64, 300))
    ferrocore.compile_graph(gm, options={"backend": "triton", "cache_dir": str(tmp_path)})
    compiled = json.loads(open(ferrocore.metrics.last["artifact_path"]).read())
    names = {k["name"] for k in compiled["kernels"]}
    module = types.SimpleNamespace(**{n: None for n in names}, **{"launch_" + n: None for n in names})
    ((_, _, constexprs, launch),), _ = artifact.triton_kernels(compiled, module)
    cands = [tuple(c) for c in launch["candidates"]]
    assert cands[0] == (launch["grid"], (("XBLOCK", constexprs["XBLOCK"]),), launch["num_warps"], launch["num_stages"])
    assert len(cands) > 1 and len(set(cands)) == len(cands)
    assert {dict(c[1])["XBLOCK"] for c in cands} == {constexprs["XBLOCK"] // 2, constexprs["XBLOCK"], constexprs["XBLOCK"] * 2}
    for grid, blocks, warps, stages in cands:
        xblock = dict(blocks)["XBLOCK"]
        # 64 rows of 300 (a persistent block of 512): the grid covers the rows, blocks fit
        assert grid == -(-64 // xblock) and xblock * 512 <= 8192 and warps in (1, 2, 4, 8, 16)
    assert launch["arg_numel"] == [64 * 300, 64 * 300]


class _FakeLauncher:
    def __init__(self):
        self.grid, self.constexprs, self.num_warps, self.num_stages, self._fast = 1, {"XBLOCK": 1}, 4, 1, None
        self.bound = None

    def bind(self, compiled, index):
        self.bound = compiled


def _tuner(tmp_path, times, monkeypatch):
    """A tuner whose 'kernel' records the configuration launched and whose timer reads `times`."""
    last = {}

    def bound(fn, signature, config):
        return (lambda *args: last.update(config=config)), f"binary{config}"

    def timer(run):
        run()
        return times[last["config"]]

    tuner = autotune.Autotuner(torch.device("cpu"), tmp_path / "autotune", timer=timer, device_name="test GPU")
    monkeypatch.setattr(tuner, "_bound", bound)
    return tuner


class _Fn:
    __name__ = "k"
    src = "def k(in_ptr0, out_ptr0, XBLOCK): ..."


def test_tuner_picks_the_fastest_and_caches_it(tmp_path, monkeypatch):
    cands = [(64, (("XBLOCK", 1),), 4, 1), (32, (("XBLOCK", 2),), 4, 1), (64, (("XBLOCK", 1),), 8, 1)]
    entry = (_Fn(), {"in_ptr0": "*fp32", "out_ptr0": "*fp32"}, {"XBLOCK": 1},
             {"grid": 64, "num_warps": 4, "num_stages": 1, "candidates": cands, "arg_numel": [64, 64]})
    tuner = _tuner(tmp_path, {cands[0]: 3.0, cands[1]: 1.0, cands[2]: 2.0}, monkeypatch)
    launcher = _FakeLauncher()
    assert tuner.tune(entry, launcher) is False  # timed, not cached
    assert (launcher.grid, launcher.constexprs, launcher.num_warps) == (32, {"XBLOCK": 2}, 4)
    assert launcher.bound == f"binary{cands[1]}"
    files = list((tmp_path / "autotune").rglob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["best"] == json.loads(json.dumps(cands[1]))
    # a second compile reads the winner without timing anything
    tuner2 = _tuner(tmp_path, {}, monkeypatch)
    launcher2 = _FakeLauncher()
    assert tuner2.tune(entry, launcher2) is True
    assert launcher2.grid == 32
    # a truncated entry is detected, timed again and rewritten whole
    files[0].write_text(files[0].read_text()[:10])
    tuner3 = _tuner(tmp_path, {cands[0]: 1.0, cands[1]: 5.0, cands[2]: 5.0}, monkeypatch)
    launcher3 = _FakeLauncher()
    assert tuner3.tune(entry, launcher3) is False
    assert launcher3.grid == 64 and json.loads(files[0].read_text())["best"] == json.loads(json.dumps(cands[0]))
    assert not [f for f in os.listdir(files[0].parent) if f.startswith(".tmp-")]
    # another device or other sizes are other entries
    other = (entry[0], entry[1], entry[2], {**entry[3], "arg_numel": [128, 128]})
    assert tuner.key(entry[0], entry[1], other[3]) != tuner.key(entry[0], entry[1], entry[3])
    elsewhere = autotune.Autotuner(torch.device("cpu"), None, device_name="another GPU")
    assert elsewhere.key(entry[0], entry[1], entry[3]) != tuner.key(entry[0], entry[1], entry[3])


@cuda
def test_max_autotune_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FERROCORE_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    x = torch.randn(512, 1000, device="cuda")
    f = lambda t: torch.softmax(t * 2, -1).sum(0)  # noqa: E731
    g = torch.compile(f, backend="ferrocore", mode="max-autotune-no-cudagraphs")
    torch.testing.assert_close(g(x), f(x), rtol=1e-4, atol=1e-4)
    assert ferrocore.metrics.last["autotuned"] >= 1
    assert list((tmp_path / "autotune").rglob("*.json"))
    torch._dynamo.reset()
    g = torch.compile(f, backend="ferrocore", mode="max-autotune-no-cudagraphs")
    torch.testing.assert_close(g(x), f(x), rtol=1e-4, atol=1e-4)
    assert ferrocore.metrics.last["autotune_cache_hits"] == ferrocore.metrics.last["autotuned"]
