"""Small models end to end: an MLP, matmul/bmm/addmm with epilogues, and the demo's transformer
block (imported from examples/, not duplicated)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check
from torch import nn

from examples.demo import TransformerBlock, make_block
from examples.models import SMALL_CONFIG, BlockConfig, elementwise_reduction, make_block_input


def make_mlp(approximate: str = "none") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(approximate=approximate), nn.Linear(64, 16)
    ).eval()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_inference(approximate):
    mlp = make_mlp(approximate)
    with torch.no_grad():
        check(mlp, torch.randn(8, 32))


def test_mlp_forward_with_grad_enabled():
    # Parameters require grad: AOT autograd hands the backend the forward of a training graph.
    mlp = make_mlp()
    check(mlp, torch.randn(8, 32))


def test_mlp_3d_input():
    mlp = make_mlp()
    with torch.no_grad():
        check(mlp, torch.randn(2, 5, 32))


MATMULS = {
    "mm": (lambda a, b: a @ b, [(16, 32), (32, 24)]),
    "mm_transposed_lhs": (lambda a, b: a.t() @ b, [(32, 16), (32, 24)]),
    "mm_transposed_rhs": (lambda a, b: a @ b.t(), [(16, 32), (24, 32)]),
    "bmm": (torch.bmm, [(4, 8, 16), (4, 16, 12)]),
    "matmul_3d_2d": (torch.matmul, [(3, 8, 16), (16, 12)]),
    "matmul_broadcast_batch": (torch.matmul, [(2, 1, 8, 16), (3, 16, 5)]),
    "matmul_vector": (lambda a, v: (a @ v, v @ a.t()), [(12, 16), (16,)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b), [(24,), (16, 32), (32, 24)]),
    "addmm_alpha_beta": (
        lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
        [(16, 24), (16, 32), (32, 24)],
    ),
    "baddbmm": (
        lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.25),
        [(4, 8, 12), (4, 8, 16), (4, 16, 12)],
    ),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(10, 32), (24, 32), (24,)]),
    "mm_epilogue": (
        lambda a, b, c: ((a @ b) * 0.5 + c).relu().sum(-1),
        [(16, 32), (32, 24), (24,)],
    ),
    "mm_prologue": (lambda a, b: (a.sin() * 2) @ (b + 1).t(), [(16, 32), (24, 32)]),
    "chained_mm": (lambda a, b, c: torch.softmax(a @ b, -1) @ c, [(16, 32), (32, 24), (24, 8)]),
}


@pytest.mark.parametrize("name", sorted(MATMULS))
def test_matmul(name):
    fn, shapes = MATMULS[name]
    check(fn, *[torch.randn(s) for s in shapes], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_matmul_other_dtypes(dtype):
    a, b = torch.randn(16, 32).to(dtype), torch.randn(32, 24).to(dtype)
    check(lambda a, b: (a @ b).tanh(), a, b)


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL_CONFIG,
        BlockConfig(
            d_model=48, n_heads=3, seq_len=12, batch=3, causal=False, gelu_approximate="tanh"
        ),
    ],
    ids=["causal", "noncausal_tanh"],
)
def test_transformer_block(cfg):
    block = make_block(cfg)
    assert isinstance(block, TransformerBlock)
    with torch.no_grad():
        check(block, make_block_input(cfg), rtol=1e-4, atol=1e-4)


def test_demo_elementwise_reduction():
    x, y = torch.randn(24, 40), torch.randn(24, 40)
    check(elementwise_reduction, x, y)
