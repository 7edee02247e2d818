"""FERROCORE_LOGS prints each stage; FERROCORE_DEBUG_DIR writes them, one folder per graph."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

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
    assert "// (the C++ prelude: " in err and re.search(r", as printed with \w+\)", err)
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


@pytest.mark.cpu_only("asserts on the C++ backend's output")
def test_the_ferrocore_component_of_torchs_logging(monkeypatch, capfd):
    """`TORCH_LOGS=ferrocore` (INFO) shows what was redone or fell back; `+ferrocore` (DEBUG) every
    stage, each block naming its graph."""
    monkeypatch.delenv("FERROCORE_LOGS", raising=False)
    blocks = {}
    for level, scale in ((logging.INFO, 0.8125), (logging.DEBUG, 0.6875)):
        torch._logging.set_logs(modules={"ferrocore": level})
        try:
            _compile_and_run(lambda x: torch.softmax(x * scale, -1), torch.randn(8, 32))
        finally:
            torch._logging.set_logs()
        err = capfd.readouterr().err
        blocks[level] = {line.split("]")[0][len("[ferrocore:"):] for line in err.splitlines()
                         if line.startswith("[ferrocore:")}
    assert f"[ferrocore:output_code] {ferrocore.metrics.last['name']} (" in err
    assert "graph_cache" in blocks[logging.INFO] and "output_code" not in blocks[logging.INFO], blocks
    assert {"graph", "ir_pre_fusion", "fusion", "ir_post_fusion", "output_code"} <= blocks[logging.DEBUG], blocks
    _compile_and_run(lambda x: torch.softmax(x * 0.5625, -1), torch.randn(8, 32))
    assert "[ferrocore:" not in capfd.readouterr().err  # off again with torch's


@pytest.mark.cpu_only("asserts on the C++ backend's dumps")
def test_torch_compile_debug_puts_the_dumps_in_torchs_debug_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("FERROCORE_DEBUG_DIR", raising=False)
    monkeypatch.setenv("TORCH_COMPILE_DEBUG", "1")
    monkeypatch.setattr(torch._dynamo.config, "debug_dir_root", str(tmp_path))
    _compile_and_run(lambda x: (x.cos() * 3).sum(0), torch.randn(4, 6))
    _compile_and_run(lambda x: x.tanh() - 2, torch.randn(5))
    runs = list(tmp_path.glob("run_*"))
    assert len(runs) == 1, runs  # one run folder for the process
    dumps = sorted(runs[0].glob("ferrocore/*/output_code.py"))
    assert len(dumps) == 2 and "def call(args)" in dumps[0].read_text(), dumps


_TRACED_RUN = """
import torch, ferrocore
fn = torch.compile(lambda x: torch.softmax(x * 2, -1).relu(), backend="ferrocore")
fn(torch.randn(8, 32))
"""


@pytest.mark.cpu_only("a C++ graph's stages")
def test_torch_trace_records_each_stage_for_tlparse(tmp_path):
    """A TORCH_TRACE run (with `TORCH_LOGS=+ferrocore`) records ferrocore's stages as artifacts of
    the compile; tlparse lists them, and they hold the graph, the IR and the module."""
    env = {**os.environ, "TORCH_TRACE": str(tmp_path / "trace"), "TORCH_LOGS": "+ferrocore",
           "FERROCORE_GRAPH_CACHE": "0"}
    env.pop("FERROCORE_LOGS", None)
    run = subprocess.run([sys.executable, "-c", _TRACED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # the component turned every channel on; the graph is named after the lambda and compile 0/0
    assert "[ferrocore:output_code] lambda_0_0_inference (" in run.stderr
    tlparse = Path(sys.executable).with_name("tlparse")
    logs = list((tmp_path / "trace").iterdir())
    out = tmp_path / "tlparse"
    parsed = subprocess.run([str(tlparse), str(logs[0]), "-o", str(out), "--no-browser"], capture_output=True,
                            text=True, timeout=120)
    assert parsed.returncode == 0, parsed.stderr
    index = (out / "index.html").read_text()
    for stage in ("graph", "ir_pre_fusion", "fusion", "ir_post_fusion", "output_code", "module_path"):
        assert f"ferrocore_lambda_0_0_inference_{stage}_" in index, stage
    code = next(out.glob("*/ferrocore_lambda_0_0_inference_output_code_*.txt")).read_text()
    assert "def call(args)" in code and 'extern "C" int cpp_' in code
    assert "aten._softmax.default" in next(out.glob("*/ferrocore_lambda_0_0_inference_graph_*.txt")).read_text()
    module = next(out.glob("*/ferrocore_lambda_0_0_inference_module_path_*.txt")).read_text().strip()
    assert Path(module).read_text() == json.loads(json.dumps(code))  # the module as written


_NAMED_RUN = """
import torch, ferrocore
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
torch.compile(model, backend="ferrocore")(torch.randn(4, 8)).sum().backward()
def scaled(x):
    return (x * 2).softmax(-1)
f = torch.compile(scaled, backend="ferrocore", dynamic=False)
f(torch.randn(4, 8))
f(torch.randn(5, 8))  # a new size: Dynamo compiles the frame again (compile 1/1)
"""


@pytest.mark.cpu_only("counts the C++ graphs of a CPU run")
def test_graphs_are_named_by_function_compile_and_part_alike_in_every_process():
    env = {**os.environ, "FERROCORE_LOGS": "fusion", "FERROCORE_GRAPH_CACHE": "0"}
    names = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _NAMED_RUN], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        names.append(re.findall(r"\[ferrocore:fusion\] (\w+)", run.stderr))
    assert names[0] == names[1]
    assert sorted(names[0]) == ["Sequential_0_0_bw", "Sequential_0_0_fw", "scaled_1_0_inference", "scaled_1_1_inference"]


def test_every_kernel_and_library_call_names_its_model_source_lines():
    """The demo's transformer block: each launch and library call in the module is preceded by
    the graph nodes it computes and the lines of examples/models.py they came from."""
    from examples.models import BlockConfig, make_block, make_block_input

    cfg = BlockConfig()
    block, x = make_block(cfg), make_block_input(cfg)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(block, backend="ferrocore")(x), block(x), rtol=1e-4, atol=1e-4)
    last = ferrocore.metrics.last
    lines = Path(last["module_path"]).read_text().split("def call(args):")[1].splitlines()
    calls = [i for i, line in enumerate(lines) if line.startswith("    # graph nodes: ")]
    assert len(calls) == last["kernels"] + last["externs"] + last["fallbacks"], calls
    for i in calls:
        assert lines[i + 1].startswith("    # File ") and "examples/models.py\", line " in lines[i + 1], lines[i:i + 3]
    # a fused kernel is named after what it computes, not after the view that stores it
    names = [line.split("(")[0].strip() for line in lines if "_fused_" in line and "(" in line]
    assert names and not any(n.split("_fused_")[1].startswith("view") for n in names), names
    assert any("softmax" in n for n in names) and any("native_layer_norm" in n for n in names), names


@pytest.mark.parametrize("direct_trace", ["1", "0"], ids=["direct-trace", "aot-autograd"])
def test_backward_kernels_name_the_forward_lines_they_differentiate(monkeypatch, direct_trace):
    """A training step of the demo's block: every launch and library call of the backward names
    the model lines of the forward ops whose gradients it computes."""
    from examples.models import make_block, make_block_input

    monkeypatch.setenv("FERROCORE_DIRECT_TRACE", direct_trace)
    monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")
    block, x = make_block(), make_block_input()
    torch._dynamo.reset()
    torch.compile(block, backend="ferrocore")(x).sum().backward()
    last = ferrocore.metrics.last
    assert re.fullmatch(r"TransformerBlock_0_0_bw(_\d+)?", last["name"]), last["name"]  # (_n: compiled again)
    lines = Path(last["module_path"]).read_text().split("def call(args):")[1].splitlines()
    calls = [i for i, line in enumerate(lines) if line.startswith("    # graph nodes: ")]
    assert len(calls) == last["kernels"] + last["externs"] + last["fallbacks"] > 0
    for i in calls:
        assert lines[i + 1].startswith("    # File ") and "examples/models.py\", line " in lines[i + 1], lines[i:i + 3]


def test_dynamo_recompiles_are_announced_with_dynamos_reason(monkeypatch, capfd):
    monkeypatch.setenv("FERROCORE_LOGS", "recompiles")
    torch._dynamo.reset()
    before = ferrocore.metrics.total.get("recompiles", 0)

    def scaled(x):
        return (x * 2).softmax(-1)

    f = torch.compile(scaled, backend="ferrocore", dynamic=False)
    f(torch.randn(4, 8))
    assert "[ferrocore:recompiles]" not in capfd.readouterr().err  # a first compile is none
    f(torch.randn(5, 8))
    err = capfd.readouterr().err
    assert re.search(r"\[ferrocore:recompiles\] scaled_\d+_1: Dynamo compiles frame \d+ again \(compile \d+/1\): "
                     r".*size mismatch at index 0\. expected 4, actual 5", err), err
    assert ferrocore.metrics.total["recompiles"] == before + 1


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
