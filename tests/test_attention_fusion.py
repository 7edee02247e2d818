"""Attention written out (matmul, scale, mask, softmax, matmul) runs as one fused attention call
(`rewrite/attention.rs`): eager's values, shapes, strides and dtypes, NaN and zero rows where
every score is masked included; spellings it cannot prove equal stay matmuls and a softmax."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ferrocore
from conftest import TEST_DEVICE
from helpers import check

pytestmark = pytest.mark.ferrocore_only

# 2^19 scores: the CPU fuses from there (smaller ones run faster as matmuls and a softmax)
B, H, S, D = 2, 4, 256, 16


def qkv(dtype=torch.float32, seq=S, head=D):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, seq, head, generator=g, device="cpu").to(TEST_DEVICE, dtype) for _ in range(3)]


def fused_calls() -> int:
    return sum("scaled_dot_product" in op for op in ferrocore.metrics.last["extern_ops"])


def matmuls() -> int:
    return sum(op.endswith("bmm.default") for op in ferrocore.metrics.last["extern_ops"])


def causal(q, k, v):
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(~mask, float("-inf"))
    return att.softmax(dim=-1) @ v


def divided_with_additive_mask(q, k, v, bias):
    return torch.softmax(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1]) + bias, dim=-1).matmul(v)


def unscaled(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def projected(x, w_qkv, w_out):
    """Heads split from one projection and merged back: the inputs are strided views."""
    b, s, d = x.shape
    q, k, v = (x @ w_qkv).view(b, s, 3, H, d // H).permute(2, 0, 3, 1, 4)
    y = causal(q, k, v).transpose(1, 2).reshape(b, s, d)
    return y @ w_out


@pytest.mark.parametrize("fn", [causal, unscaled])
def test_attention_runs_as_one_fused_call(fn):
    check(fn, *qkv())
    assert fused_calls() == 1 and matmuls() == 0, ferrocore.metrics.last["extern_ops"]


def test_an_additive_mask_becomes_the_bias():
    bias = torch.randn(B, 1, S, S, device="cpu").to(TEST_DEVICE)
    check(divided_with_additive_mask, *qkv(), bias)
    assert fused_calls() == 1 and matmuls() == 0


def test_heads_viewed_out_of_one_projection():
    g = torch.Generator().manual_seed(1)
    x, w, o = (torch.randn(*s, generator=g, device="cpu").to(TEST_DEVICE) for s in ((B, S, 64), (64, 192), (64, 64)))
    check(projected, x, w * 0.1, o * 0.1)
    assert fused_calls() == 1


def test_fully_masked_rows_are_nan_as_in_eager():
    q, k, v = qkv()
    mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(2), device="cpu") > 0.3
    mask[:, :, 5] = False  # row 5 masked entirely: eager's softmax gives NaN there
    mask = mask.to(TEST_DEVICE)

    def masked(q, k, v, mask):
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")), -1) @ v

    out = check(masked, q, k, v, mask)
    assert fused_calls() == 1, out
    got = torch.compile(masked, backend="ferrocore")(q, k, v, mask)
    assert got[:, :, 5].isnan().all() and not got[:, :, 4].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_math_attention_is_fused_with_safe_softmax_rows(dtype):
    """torch's own math path (upcast to float32 for bfloat16, safe softmax: a fully masked row is 0)."""
    q, k, v = qkv(dtype)
    mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(3), device="cpu") > 0.3
    mask[:, :, 7] = False
    mask = mask.to(TEST_DEVICE)

    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    with sdpa_kernel([SDPBackend.MATH]):
        check(sdpa, q, k, v, mask)
        assert fused_calls() == 1 and matmuls() == 0, ferrocore.metrics.last["extern_ops"]
        got = torch.compile(sdpa, backend="ferrocore")(q, k, v, mask)
    assert (got[:, :, 7] == 0).all()


def test_a_finite_fill_value_stays_matmuls():
    """masked_fill(-1e9) differs from a -inf bias on rows it fills entirely: not fused."""
    def finite_fill(q, k, v, mask):
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~mask, -1e9), -1) @ v

    mask = (torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(4), device="cpu") > 0.3).to(TEST_DEVICE)
    mask[:, :, 3] = False
    check(finite_fill, *qkv(), mask)
    assert fused_calls() == 0 and matmuls() == 2


def test_probabilities_returned_too_stay_matmuls():
    def with_probs(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), -1)
        return p @ v, p

    check(with_probs, *qkv())
    assert fused_calls() == 0 and matmuls() == 2


def test_attention_scores_returned_stay_a_softmax():
    def scores(q, k):
        return torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1)

    q, k, _ = qkv()
    check(scores, q, k)
    assert fused_calls() == 0 and matmuls() == 1


def test_value_head_dim_other_than_the_keys_stays_matmuls():
    q, k, _ = qkv()
    v = torch.randn(B, H, S, 24, device="cpu").to(TEST_DEVICE)
    check(unscaled, q, k, v)
    assert fused_calls() == 0


@pytest.mark.cpu_only("the CPU's size threshold")
def test_small_attention_on_the_cpu_stays_matmuls(monkeypatch):
    # (GEMMs as library calls: on the CPU GEMMs this small are otherwise kernels of their own)
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "never")
    q, k, v = (t[:, :, :64] for t in qkv())
    check(causal, q.contiguous(), k.contiguous(), v.contiguous())
    assert fused_calls() == 0 and matmuls() == 2


def grads_against_eager(fn, *inputs, tol=1e-4):
    """`fn`'s outputs and its inputs' gradients, compiled against eager; the compiled outputs."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    expected = fn(*leaves)
    expected = expected if isinstance(expected, tuple) else (expected,)
    sum(e.square().sum() for e in expected).backward()
    twins = [x.detach().clone().requires_grad_() for x in inputs]
    got = torch.compile(fn, backend="ferrocore")(*twins)
    got = got if isinstance(got, tuple) else (got,)
    forward_calls = fused_calls()
    sum(g.square().sum() for g in got).backward()
    for a, b in zip(got + tuple(t.grad for t in twins), expected + tuple(t.grad for t in leaves)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return forward_calls


class NanoGptAttention(torch.nn.Module):
    """nanoGPT's attention: a registered `tril` buffer (an input of the graph, so its mask is
    replayed as the call's bias rather than proven causal)."""

    def __init__(self, seq):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, q, k, v):
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return torch.nn.functional.softmax(att, dim=-1) @ v


@pytest.mark.parametrize("fn", [causal, NanoGptAttention(S).to(TEST_DEVICE)], ids=["tril", "buffer"])
def test_training_attention_is_traced_as_the_fused_call(fn):
    """The forward runs the fused call and the backward its backward (no saved probabilities)."""
    assert grads_against_eager(fn, *qkv()) == 1 and matmuls() == 0
    backward_ops = ferrocore.metrics.last["extern_ops"]
    assert any("scaled_dot_product" in op and "backward" in op for op in backward_ops), backward_ops


def test_training_attention_whose_probabilities_are_returned_too():
    """The probabilities stay written out for their reader; the result is the fused call's."""
    def both(q, k, v):
        att = ((q @ k.transpose(-2, -1)) * 0.25).softmax(-1)
        return att @ v, att

    grads_against_eager(both, *qkv())


def test_training_attention_with_a_learned_bias_stays_written_out(compile_log):
    """T5-style relative position bias takes a gradient, which the fused calls do not give."""
    read_log = compile_log("attention")
    position_bias = torch.randn(1, H, S, S, device=TEST_DEVICE)

    def t5_like(q, k, v, bias):
        return ((q @ k.transpose(-2, -1)) + bias).softmax(-1) @ v

    grads_against_eager(t5_like, *qkv(), position_bias)
    log = read_log()
    assert "(ValueError: the mask takes a gradient); the written-out ones stay" in log, log
