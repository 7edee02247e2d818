"""A fused attention call whose mask the graph builds from positions (`rewrite/causal.rs`) runs
with `is_causal` and no mask when the mask is proven causal, and without a mask when it keeps
every key; any other mask is kept. Values, shapes, strides and dtypes as eager's."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE
from helpers import check

pytestmark = pytest.mark.ferrocore_only

B, H, S, D = 2, 4, 64, 16


@pytest.fixture
def causal_log(compile_log):
    return compile_log("causal_mask")


def qkv(dtype=torch.float32, seq=S):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, seq, D, generator=g, device="cpu").to(TEST_DEVICE, dtype) for _ in range(3)]


def position_mask(q_len, kv_len, device, fill, diagonal=0):
    """Hugging Face's spelling: positions from `arange`, packed sequences found from their steps,
    a key open where its position is at most the query's (plus `diagonal`) in the same sequence."""
    pos = torch.arange(kv_len, device=device)[None].expand(B, -1)
    steps = torch.cat([pos[:, :1] - 1, pos], dim=-1).diff(dim=-1)
    seq_id = (steps != 1).cumsum(-1)
    b = torch.arange(B, device=device)[:, None, None, None]
    qi = torch.arange(kv_len - q_len, kv_len, device=device)[None, None, :, None]
    kj = torch.arange(kv_len, device=device)[None, None, None, :]
    keep = (pos[b, kj] <= pos[b, qi] + diagonal) & (seq_id[b, qi] == seq_id[b, kj])
    return torch.where(keep, 0.0, fill)


def attend(q, k, v, fill=float("-inf"), diagonal=0):
    mask = position_mask(q.shape[-2], k.shape[-2], q.device, fill, diagonal).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", [float("-inf"), "min"])
def test_a_position_built_causal_mask_becomes_is_causal(causal_log, fill, dtype):
    fill = torch.finfo(dtype).min if fill == "min" else fill
    check(lambda q, k, v: attend(q, k, v, fill), *qkv(dtype))
    assert "is_causal instead of mask" in causal_log()


def test_written_out_causal_attention_runs_causal(monkeypatch, capfd):
    """`ones().tril()` in the forward: the attention pass fuses it into a causal call, no bias."""
    monkeypatch.setenv("FERROCORE_LOGS", "attention")
    monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")
    def written_out(q, k, v):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))
        return scores.softmax(-1) @ v

    q, k, v = qkv(seq=256)  # the CPU fuses from 2^19 scores
    check(written_out, q, k, v)
    assert "float32, scale 0.25, causal)" in capfd.readouterr().err


def test_a_mask_with_a_diagonal_offset_is_kept(causal_log):
    check(lambda q, k, v: attend(q, k, v, diagonal=1), *qkv())
    log = causal_log()
    assert "causal with diagonal offset 1" in log and "is_causal instead" not in log


def test_a_small_finite_fill_is_kept(causal_log):
    # -100 does not close a key: the scores there still count
    check(lambda q, k, v: attend(q, k, v, fill=-100.0), *qkv())
    assert "is_causal instead" not in causal_log()


def test_fewer_queries_than_keys_keep_the_mask(causal_log):
    q, _, _ = qkv(seq=16)
    _, k, v = qkv()
    check(attend, q, k, v)
    assert "is_causal instead" not in causal_log()


def test_a_mask_from_an_input_is_kept(causal_log):
    pos = torch.arange(S, device="cpu").to(TEST_DEVICE)

    def from_input(q, k, v, pos):
        keep = pos[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    check(from_input, *qkv(), pos)
    assert "not built from positions alone" in causal_log()


def test_hugging_face_decoder_attention_runs_causal(causal_log):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import model_zoo

    with torch.device("cpu"):
        case = model_zoo.build("llama", "tiny", TEST_DEVICE, torch.float32)
        inputs = case.make_inputs()
    model = case.model.eval()
    with torch.no_grad():
        expected = model(*inputs).logits
        got = torch.compile(model, backend="ferrocore")(*inputs).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    log = causal_log()
    assert log.count("is_causal instead of mask") == 2 and "kept" not in log, log


def causal_and_padding(q, k, v, keep_keys, fill):
    """A `tril` built in the forward and a key padding mask: the kernel applies the causal one."""
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~causal, float("-inf"))
    if fill is None:
        scores = scores + (1.0 - keep_keys[:, None, None, :].to(q.dtype)) * -1e4
    else:
        scores = scores.masked_fill(~keep_keys[:, None, None, :], fill)
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("fill", [None, float("-inf")])
def test_written_out_causal_with_padding_runs_causal_with_the_padding_as_bias(monkeypatch, capfd, fill):
    monkeypatch.setenv("FERROCORE_LOGS", "attention")
    monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")
    q, k, v = qkv(seq=256)
    keep = torch.rand(B, 256, generator=torch.Generator().manual_seed(5), device="cpu") > 0.2
    if fill is None:
        # every query sees key 0: a row whose keys are all at -1e4 is ill-conditioned in eager
        keep[:, 0] = True
    else:
        keep[1, :40] = False  # batch 1's first 40 queries see no key: NaN rows
    check(lambda q, k, v, keep: causal_and_padding(q, k, v, keep, fill), q, k, v, keep.to(TEST_DEVICE))
    assert "causal, masked" in capfd.readouterr().err
    if fill is not None:
        got = torch.compile(lambda q, k, v, keep: causal_and_padding(q, k, v, keep, fill), backend="ferrocore")(q, k, v, keep.to(TEST_DEVICE))
        assert got[1, :, :40].isnan().all() and not got[0].isnan().any()


def check_training(fn, *inputs, tol=1e-5):
    """`fn`'s output and its inputs' gradients, compiled against eager."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    expected = fn(*leaves)
    expected.square().sum().backward()
    twins = [x.detach().clone().requires_grad_() for x in inputs]
    got = torch.compile(fn, backend="ferrocore")(*twins)
    got.square().sum().backward()
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    for a, b in zip(twins, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)


def test_a_training_graph_is_traced_with_is_causal_for_a_position_built_mask(causal_log):
    """The backward is traced from the call without the mask: both run the causal kernel."""
    check_training(attend, *qkv())
    log = causal_log()
    assert "is_causal instead of mask" in log and "traced so" in log, log


def test_a_training_graph_is_traced_without_a_mask_that_keeps_every_key(causal_log):
    def open_mask(q, k, v):  # Hugging Face ViT's mask under compile
        keep = (torch.arange(k.shape[-2], device=q.device) + 0 >= 0).expand(q.shape[0], 1, q.shape[-2], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, float("-inf")).to(q.dtype))

    check_training(open_mask, *qkv())
    assert "no mask (every key open) instead of mask" in causal_log()


def test_a_training_graph_keeps_a_mask_it_cannot_prove(causal_log):
    keep = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(1), device="cpu") > 0.3
    keep[..., 0] = True
    bias = torch.where(keep, 0.0, float("-inf")).to(TEST_DEVICE)
    check_training(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), *qkv(), bias)
    log = causal_log()
    assert "kept: the mask is an input" in log and "traced so" not in log, log


def test_written_out_attention_in_a_training_graph_runs_as_the_fused_call(compile_log):
    """Traced as the fused call, so its backward is the fused call's: no saved probabilities."""
    read_log = compile_log("attention")
    keep_keys = torch.ones(B, 256, dtype=torch.bool, device=TEST_DEVICE)
    keep_keys[1, 200:] = False
    check_training(lambda q, k, v: causal_and_padding(q, k, v, keep_keys, None), *qkv(seq=256), tol=1e-4)
    log = read_log()
    assert "(training trace): softmax" in log and "fused:" in log and "causal, masked" in log, log
