"""FERROCORE_LOGS prints each stage; FERROCORE_DEBUG_DIR writes them, one folder per graph."""

import os

import pytest
import torch

import ferrocore


def _compile_and_run(fn, *args):
    torch._dynamo.reset()
    out = torch.compile(fn, backend="ferrocore", dynamic=False)(*args)
    torch.testing.assert_close(out, fn(*args))


@pytest.mark.cpu_only("asserts on the C++ backend's output")
def test_logs_print_every_requested_stage(monkeypatch, capfd):
    monkeypatch.setenv("FERROCORE_LOGS", "graph,ir_pre_fusion,ir_post_fusion,fusion,output_code")
    _compile_and_run(lambda x: torch.softmax(x * 2, -1), torch.randn(8, 32))
    err = capfd.readouterr().err
    for channel in ("graph", "ir_pre_fusion", "ir_post_fusion", "fusion", "output_code"):
        assert f"[ferrocore:{channel}]" in err, channel
    assert "aten._softmax.default" in err  # the imported graph
    assert "Reduction ranges=[8] reduce=[32]" in err  # the loop IR
    assert 'extern "C" int cpp_red_fused' in err  # the generated kernel
    assert "local: " in err  # a fusion decision with its reason


@pytest.mark.cpu_only("the C++ prelude")
def test_output_code_prints_the_cpp_prelude_once(monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("FERROCORE_LOGS", "output_code")
    monkeypatch.setenv("FERROCORE_DEBUG_DIR", str(tmp_path))
    _compile_and_run(lambda x: x.cos() + 1, torch.randn(8))
    _compile_and_run(lambda x: (x.sin() * 2).sum(), torch.randn(8))
    err = capfd.readouterr().err
    # the first graph this process printed shows it (another test may have printed it already)
    assert err.count("// ferrocore C++ kernel prelude") <= 1
    assert "// (the C++ prelude: " in err and ", as printed with graph_" in err
    assert 'extern "C" int cpp_' in err.split("// (the C++ prelude: ")[1]  # the kernels still printed
    dumps = list(tmp_path.glob("*/output_code.py"))
    assert len(dumps) == 2
    for dump in dumps:  # the dumps keep it whole
        assert "// ferrocore C++ kernel prelude" in dump.read_text()


@pytest.mark.cpu_only("asserts on the C++ backend's output")
def test_torch_logs_turn_on_ferrocores_channels_of_the_same_name(monkeypatch, capfd):
    monkeypatch.delenv("FERROCORE_LOGS", raising=False)
    torch._logging.set_logs(output_code=True, fusion=True)
    try:
        _compile_and_run(lambda x: torch.softmax(x * 3, -1), torch.randn(8, 32))
    finally:
        torch._logging.set_logs()
    err = capfd.readouterr().err
    assert "[ferrocore:output_code]" in err and 'extern "C" int cpp_red_fused' in err
    assert "[ferrocore:fusion]" in err
    _compile_and_run(lambda x: torch.softmax(x * 4, -1), torch.randn(8, 32))
    assert "[ferrocore:" not in capfd.readouterr().err  # off again with torch's


def test_fallback_channel_names_the_op(monkeypatch, capfd):
    monkeypatch.setenv("FERROCORE_LOGS", "fallback")
    _compile_and_run(lambda x: torch.cummax(x, 0)[0] + 1, torch.randn(6, 5))
    assert "aten.cummax.default" in capfd.readouterr().err
    assert ferrocore.metrics.last["fallbacks"] == 1
    assert ferrocore.metrics.last["fallback_ops"] == ["aten.cummax.default"]
    assert ferrocore.metrics.last["kernels"] == 1  # the add still compiles


@pytest.mark.cpu_only("asserts on the C++ backend's output")
def test_debug_dir_has_one_folder_per_graph(monkeypatch, tmp_path):
    monkeypatch.setenv("FERROCORE_DEBUG_DIR", str(tmp_path))
    _compile_and_run(lambda x: (x.relu() + 1).sum(-1), torch.randn(4, 16))
    _compile_and_run(lambda x: x.exp().t(), torch.randn(3, 5))
    folders = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(folders) == 2
    for f in folders:
        names = set(os.listdir(f))
        assert {"graph.txt", "ir_pre_fusion.txt", "ir_post_fusion.txt", "fusion.txt", "output_code.py", "kernels.cpp"} <= names


def test_stage_timings_are_recorded():
    _compile_and_run(lambda x: x.sin() * 2, torch.randn(10))
    t = ferrocore.metrics.last["timings_ms"]
    for stage in ("import", "lowering", "scheduling", "codegen", "wrapper"):
        assert stage in t and t[stage] >= 0


def test_storage_viewed_by_a_fallback_result_is_not_reused():
    # a bitcast view (view.dtype) has no lowering: its ATen result is a view of `a`'s buffer,
    # which must stay intact even though `b` (same layout, computed after `a` is last used)
    # could take its storage
    def fn(x, w):
        a = x * 2
        u = a.view(torch.int32)
        b = x * (u[0, 0] % 7).float()
        return u, b @ w

    x, w = torch.randn(9, 4), torch.randn(4, 3)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ferrocore", dynamic=False)(x, w)
    assert ferrocore.metrics.last["fallback_ops"] == ["aten.view.dtype"]
    want = fn(x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
