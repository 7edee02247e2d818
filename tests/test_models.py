"""Every model of the model benchmark (`bench/model_zoo.py`: Hugging Face transformers and
torchvision networks from configs with random weights) at its tiny size, in float32, inference
and a training step (the loss and every parameter's gradient), against a float64 copy of the
model with the benchmark's own rule (`bench/models.py`: at most 3x eager's error, or the
dtype's floor). With ferrocore, no node or graph may fall back to ATen."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import BACKEND, is_ferrocore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import model_zoo  # noqa: E402
import models as bench  # noqa: E402

DEVICE = str(torch.get_default_device()) if torch.get_default_device().type != "cpu" else "cpu"


CONV_MODELS = ("resnet50", "mobilenet_v3", "efficientnet_b0", "convnext_t")


@pytest.fixture(autouse=True)
def no_tf32():
    # float32 on a GPU: cuDNN and cuBLAS round operands to TF32 by default, and eager's NCHW
    # convolutions and the compiled NHWC ones get different algorithms, so a gradient that
    # cancels (MobileNetV3's, EfficientNet's) differs by TF32's rounding, not by the compiler's
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    # the context manager: another test module may have frozen cuDNN's global flags
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False):
        yield
    matmul.allow_tf32 = saved


def run(name: str, task: str) -> "bench.Row":
    opts = bench.parse_args(["--device", DEVICE, "--size", "tiny", "--dtype", "float32", "--reps", "1",
                             "--warmup", "0", "--no-profile", "--modes", "default", "--tasks", task,
                             "--backends", f"eager,{BACKEND}"])
    opts.tasks, opts.modes, opts.backends = [task], ["default"], ["eager", BACKEND]
    # built and drawn on the CPU (seeded CPU generators), then moved to the test device
    with torch.device("cpu"):
        case = model_zoo.build(name, "tiny", DEVICE, torch.float32)
        inputs = case.make_inputs() if task == "inference" else case.make_train_inputs()
    ref = bench.reference(case, task, inputs, DEVICE, torch.float32)
    return bench.run_config(case, name, task, "default", opts, ref, inputs)


@pytest.mark.parametrize("task", ["inference", "training"])
@pytest.mark.parametrize("name", list(model_zoo.MODELS))
def test_model(name, task):
    if BACKEND not in ("ferrocore", "inductor"):
        pytest.skip(f"the model benchmark compares compilers; backend is {BACKEND}")
    row = run(name, task)
    check = row.check.get(BACKEND)
    assert check is not None, row.notes
    assert check.ok, f"{name} {task}: {check.where} off by {check.worst:.1f}x what is allowed; {row.notes}"
    if is_ferrocore():
        fc = row.ferrocore
        assert fc.get("graphs", 0) >= 1, fc
        assert not fc.get("fallbacks") and not fc.get("graph_fallbacks"), fc


@pytest.mark.ferrocore_only
@pytest.mark.parametrize("task", ["inference", "training"])
@pytest.mark.parametrize("name", CONV_MODELS)
def test_conv_model_channels_last(name, task, monkeypatch):
    # the GPU's layout on any device: 4-D activations channels-last, saved activations handed to
    # the backward in that layout
    monkeypatch.setenv("FERROCORE_CONV_LAYOUT", "channels_last")
    row = run(name, task)
    check = row.check["ferrocore"]
    assert check.ok, f"{name} {task}: {check.where} off by {check.worst:.1f}x what is allowed; {row.notes}"
    assert not row.ferrocore.get("fallbacks") and not row.ferrocore.get("graph_fallbacks"), row.ferrocore
