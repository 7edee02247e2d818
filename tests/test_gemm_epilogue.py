"""A half-precision linear layer's ReLU or tanh-GELU on the GPU runs in the GEMM's epilogue
(`rewrite/epilogue.rs`: one `_addmm_activation` call); elsewhere the addmm stays. Eager's values,
shapes, strides and dtypes."""

import pytest
import torch
import torch.nn as nn

import ferrocore
from conftest import TEST_DEVICE
from helpers import check

pytestmark = pytest.mark.ferrocore_only


def externs():
    return ferrocore.metrics.last["extern_ops"]


def layers(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), act, nn.Linear(256, 64)).to(TEST_DEVICE)


ACTIVATIONS = {"relu": nn.ReLU(), "gelu_tanh": nn.GELU(approximate="tanh")}


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the epilogue is cuBLASLt's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_the_activation_runs_in_the_gemm_epilogue(act, dtype):
    model = layers(ACTIVATIONS[act]).to(dtype)
    x = torch.randn(128, 64, device="cpu").to(TEST_DEVICE, dtype)
    with torch.no_grad():
        check(model, x)
    assert sum("_addmm_activation" in op for op in externs()) == 1, externs()


@pytest.mark.parametrize("act", ["gelu_exact", "relu_float32"])
def test_what_the_epilogue_cannot_take_keeps_its_addmm(act):
    """Exact (erf) GELU is not cuBLASLt's; float32 keeps addmm (and the CPU never fuses)."""
    model = layers(nn.GELU() if act == "gelu_exact" else nn.ReLU())
    dtype = torch.bfloat16 if act == "gelu_exact" and TEST_DEVICE == "cuda" else torch.float32
    model = model.to(dtype)
    x = torch.randn(128, 64, device="cpu").to(TEST_DEVICE, dtype)
    with torch.no_grad():
        check(model, x)
    assert not any("_addmm_activation" in op for op in externs()), externs()


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the epilogue is cuBLASLt's")
def test_a_product_read_twice_keeps_its_addmm():
    lin = nn.Linear(64, 128).to(TEST_DEVICE, torch.bfloat16)

    def both(x):
        y = lin(x)
        return torch.relu(y), y.sum()

    x = torch.randn(32, 64, device="cpu").to(TEST_DEVICE, torch.bfloat16)
    with torch.no_grad():
        check(both, x)
    assert not any("_addmm_activation" in op for op in externs()), externs()
