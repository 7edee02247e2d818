"""FlexAttention (`torch.nn.attention.flex_attention`) compiles: the call is traced as torch's
dense form (what eager runs), and the attention pass fuses it into one attention call where it
proves the mask and the score modification (a causal `mask_mod` as `is_causal`, an additive
`score_mod` as the bias; in half precision on a GPU, a float32 `score_mod` or a mask built from
positions as ferrocore's own attention kernel: Triton on a GPU, C++ on the CPU); other
modifications run as generated kernels.
No graph falls back.
Values, shapes, strides and dtypes as eager's, gradients too."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import ferrocore
from conftest import TEST_DEVICE
from helpers import check

pytestmark = pytest.mark.ferrocore_only

# 2^19 scores: the CPU fuses from there
B, H, S, D = 2, 4, 256, 16


def qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g, device="cpu").to(TEST_DEVICE, dtype) for _ in range(3)]


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 32)


def alibi(score, b, h, q, kv):
    return score + (h + 1) * 0.125 * (kv - q)


def soft_cap(score, b, h, q, kv):
    return 20 * torch.tanh(score / 20)


def block_mask(mask_mod):
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=S, KV_LEN=S, device=TEST_DEVICE)


@pytest.fixture
def attention_log(compile_log):
    return compile_log("attention")


@pytest.mark.parametrize("mask_mod, score_mod, fused", [
    (causal, None, "causal, safe softmax)"),
    (causal, alibi, "causal, masked, safe softmax)"),
    (sliding_window, None, "masked, safe softmax)"),
    (None, alibi, "masked, safe softmax)"),
], ids=["causal", "causal_alibi", "sliding_window", "alibi"])
def test_flex_attention_runs_as_one_fused_call(attention_log, mask_mod, score_mod, fused):
    mask = block_mask(mask_mod) if mask_mod else None
    check(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=mask), *qkv(), atol=1e-5, rtol=1e-5)
    log = attention_log()
    assert "fused:" in log and fused in log, log
    # one library call, or ferrocore's attention kernel (Triton kernels on a GPU: a mask or bias
    # computed per tile, which a library call would read stored)
    in_kernel = "_overrideable" in log
    assert sum("scaled_dot_product" in op for op in ferrocore.metrics.last["extern_ops"]) == (0 if in_kernel else 1)


def test_a_document_mask_read_from_a_tensor(attention_log):
    document = (torch.arange(S, device=TEST_DEVICE) // 96)

    def same_document(b, h, q, kv):
        return (document[q] == document[kv]) & (q >= kv)

    mask = block_mask(same_document)
    check(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), *qkv(), atol=1e-5, rtol=1e-5)


def kernel_case(name: str, dtype=torch.bfloat16):
    """A FlexAttention call the attention kernels take (bfloat16 inputs on a GPU, float32 on the
    CPU), by name: the call and its inputs (grouped-query: 2 key heads for 4 query heads, read
    where they lie)."""
    document = torch.arange(S, device=TEST_DEVICE) // 96
    mask_mod, score_mod = {
        "alibi": (None, alibi),
        "causal_alibi": (causal, alibi),
        "document_alibi": (lambda b, h, q, kv: (document[q] == document[kv]) & (q >= kv), alibi),
        "document": (lambda b, h, q, kv: (document[q] == document[kv]) & (q >= kv), None),
        "sliding_window": (sliding_window, None),
        "grouped_query_sliding_window": (sliding_window, None),
    }[name]
    mask = block_mask(mask_mod) if mask_mod else None
    inputs = qkv(dtype)
    grouped = name.startswith("grouped_query")
    if grouped:
        inputs = [inputs[0], inputs[1][:, :2].contiguous(), inputs[2][:, :2].contiguous()]
    return (lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=grouped)), inputs


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="the attention kernel is a Triton template")
@pytest.mark.parametrize("name", ["alibi", "causal_alibi", "document_alibi", "document", "sliding_window",
                                  "grouped_query_sliding_window"])
def test_runs_in_the_attention_kernel(attention_log, name):
    """Inference in bfloat16: a float32 score_mod (and the mask beside it), or a mask computed
    from positions or a document id per position, is computed inside ferrocore's attention
    kernel (no library call, no stored scores, one kernel beside the document mask's key
    ranges). The kernel keeps the scores in float32 where eager rounds them to bfloat16 first,
    so each is measured against a float64 run: ferrocore's error at most eager's (and shapes,
    strides and dtype as eager's)."""
    f, inputs = kernel_case(name)
    expected = f(*inputs)
    got = torch.compile(f, backend="ferrocore")(*inputs)
    assert not ferrocore.metrics.last["extern_ops"], ferrocore.metrics.last["extern_ops"]
    kernels = 2 if name.startswith("document") else 1  # (a document mask's key ranges: one kernel)
    assert ferrocore.metrics.last["kernels"] == kernels, ferrocore.metrics.last["kernels"]
    assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype)
    exact = f(*[x.double() for x in inputs])
    eager_error = (expected.double() - exact).abs().max().item()
    error = (got.double() - exact).abs().max().item()
    assert error <= eager_error, (error, eager_error)
    assert "fused_attention_overrideable" in attention_log()


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="the attention kernels are Triton templates")
@pytest.mark.parametrize("name", ["alibi", "causal_alibi", "document", "sliding_window", "grouped_query_sliding_window"])
def test_trains_in_the_attention_kernels(attention_log, name):
    """Training in bfloat16: the forward writes each row's log-sum-exp beside its output, and
    the backward is ferrocore's two attention kernels (the queries' gradient; the keys' and the
    values'), no library call and no stored scores. Output and gradients measured against a
    float64 run: ferrocore's error at most twice eager's (each is a few bfloat16 steps)."""
    f, inputs = kernel_case(name)
    grad = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(3), device="cpu").to(TEST_DEVICE, torch.bfloat16)

    def run(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out, *[x.grad for x in leaves]]

    exact, expected = run(f, torch.float64), run(f, torch.bfloat16)
    got = run(torch.compile(f, backend="ferrocore"), torch.bfloat16)
    assert not ferrocore.metrics.last["extern_ops"], ferrocore.metrics.last["extern_ops"]
    for what, g, e, x in zip(["output", "dq", "dk", "dv"], got, expected, exact):
        assert (g.shape, g.stride(), g.dtype) == (e.shape, e.stride(), e.dtype), what
        error, eager_error = (g.double() - x).abs().max().item(), (e.double() - x).abs().max().item()
        assert error <= 2 * eager_error, (what, error, eager_error)
    assert "fused_attention_overrideable" in attention_log()


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's attention kernel is C++")
@pytest.mark.parametrize("name", ["alibi", "causal_alibi", "document_alibi", "document", "sliding_window",
                                  "grouped_query_sliding_window"])
def test_runs_in_the_cpu_attention_kernel(attention_log, name):
    """Inference in float32 on the CPU: a score_mod computed from positions, or a mask that
    differs between queries (a band, a document id per position), is computed inside
    ferrocore's C++ attention kernel: no library call, no stored scores, one kernel (beside the
    document mask's key ranges). Values, shapes, strides and dtype as eager's."""
    f, inputs = kernel_case(name, torch.float32)
    kernels = 2 if name.startswith("document") else 1
    check(f, *inputs, atol=1e-5, rtol=1e-5, expect_kernels=kernels)
    assert not ferrocore.metrics.last["extern_ops"], ferrocore.metrics.last["extern_ops"]
    assert "fused_attention_overrideable" in attention_log()


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's attention kernels are C++")
@pytest.mark.parametrize("grouped", [False, True], ids=["heads", "grouped_query"])
def test_written_out_attention_trains_in_the_cpu_attention_kernels(attention_log, grouped):
    """Training on the CPU (eager FlexAttention has no CPU backward: the attention is written
    out): a sliding window and an ALiBi bias built from positions. The forward writes each
    row's log-sum-exp beside its output; the backward is `delta` and ferrocore's two C++
    attention kernels (the queries' gradient; the keys' and the values'). Output and
    gradients as eager's."""
    def f(q, k, v):
        # (positions built in the graph: the band is proven, no key ranges computed)
        i, j = torch.arange(S, device=q.device)[:, None], torch.arange(S, device=q.device)[None, :]
        slope = (torch.arange(H, device=q.device).view(1, H, 1, 1) + 1) * 0.125
        if grouped:  # (2 key heads for 4 query heads, as models repeat them)
            k, v = k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1)
        s = q @ k.transpose(-1, -2) * 0.25
        s = s.masked_fill(~((i >= j) & (i - j <= 32)), float("-inf")) + slope * (j - i)
        return torch.softmax(s, -1) @ v

    inputs = qkv()
    grad = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(3)).to(TEST_DEVICE)
    leaves = [x.clone().requires_grad_() for x in inputs]
    expected = f(*leaves)
    expected.backward(grad)
    twins = [x.clone().requires_grad_() for x in inputs]
    got = torch.compile(f, backend="ferrocore")(*twins)
    got.backward(grad)
    assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(twins, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    # (grouped: the repeated heads' key and value gradients summed per key head, two more)
    kernels = 5 if grouped else 3
    assert ferrocore.metrics.last["kernels"] == kernels and not ferrocore.metrics.last["extern_ops"], ferrocore.metrics.last
    assert "fused_attention_overrideable" in attention_log()


def test_the_attention_hook_runs_outside_the_kernels():
    """A graph holding torch's attention hook that runs eagerly (a graph fallback) computes what
    ferrocore's attention kernels compute: values and gradients as autograd's through the
    written-out softmax, a row with every key closed giving 0."""
    from torch._subclasses import FakeTensorMode

    from ferrocore import attention_hook

    with FakeTensorMode():  # (as a trace registers it: the kernels are still registered)
        attention_hook.register()
    q, k, v = [x.requires_grad_() for x in qkv()]
    i, j = torch.arange(S, device=TEST_DEVICE)[:, None], torch.arange(S, device=TEST_DEVICE)[None, :]
    bias = torch.where((j <= i) & (i > 0), 0.0, float("-inf")) + 0.01 * (j - i)  # (row 0: every key closed)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, k, v, bias[None, None], scale=0.25)
    closed = (bias == float("-inf")).all(-1, keepdim=True)  # (the safe softmax: 0 there)
    probs = torch.softmax((q @ k.transpose(-1, -2) * 0.25 + bias).masked_fill(closed, 0.0), -1).masked_fill(closed, 0.0)
    expected = probs @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == float("-inf")).all()
    grad = torch.randn_like(out)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward(
        grad, q, k, v, bias[None, None], [True, True, True, False], out, lse, None, None, S, S, 0.0, False, lse, lse,
        scale=0.25)
    torch.testing.assert_close((dq, dk, dv), torch.autograd.grad(expected, (q, k, v), grad), rtol=1e-4, atol=1e-4)


def test_a_soft_capped_score_runs_as_generated_kernels(attention_log):
    mask = block_mask(causal)
    check(lambda q, k, v: flex_attention(q, k, v, score_mod=soft_cap, block_mask=mask), *qkv(), atol=1e-5, rtol=1e-5)
    assert "not fused" in attention_log()


def test_a_training_trace_of_flex_attention_has_the_fused_backward():
    """A training graph traces the fused call and its backward (causal, ALiBi as the bias).
    Eager FlexAttention has no CPU backward, so Dynamo's graph is traced here directly."""
    from ferrocore import decompositions, direct_trace

    mask = block_mask(causal)
    joints = []

    def backend(gm, example_inputs):
        grads = [x.detach().requires_grad_() for x in example_inputs[:3]] + list(example_inputs[3:])
        joints.append(direct_trace.trace_joint(gm, grads, decompositions.decompositions(training=True)))
        return gm

    torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=alibi, block_mask=mask), backend=backend)(*qkv())
    targets = [str(n.target) for n in joints[0].graph.graph.nodes]
    assert any("scaled_dot_product" in t and "backward" in t for t in targets), targets
    assert not any("bmm" in t for t in targets), targets


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="eager FlexAttention has no CPU backward to compare with")
def test_flex_attention_trains(attention_log):
    """The training graph differentiates the dense form (no fallback); gradients as eager's."""
    mask = block_mask(causal)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=alibi, block_mask=mask)

    inputs = qkv()
    leaves = [x.clone().requires_grad_() for x in inputs]
    f(*leaves).square().sum().backward()
    twins = [x.clone().requires_grad_() for x in inputs]
    got = torch.compile(f, backend="ferrocore")(*twins)
    got.square().sum().backward()
    torch.testing.assert_close(got, f(*inputs), rtol=1e-5, atol=1e-5)
    for a, b in zip(twins, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    assert not ferrocore.metrics.last.get("graph_fallbacks")


def test_a_block_mask_created_under_compile(attention_log):
    def f(q, k, v):
        mask = create_block_mask(causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device=q.device)
        return flex_attention(q, k, v, block_mask=mask)

    check(f, *qkv(), atol=1e-5, rtol=1e-5)
    assert "causal, safe softmax)" in attention_log()


def test_a_score_mod_reading_a_bias_table():
    """A relative-position table indexed by `q - kv` (a captured buffer)."""
    table = torch.randn(2 * S, device=TEST_DEVICE)

    def relative(score, b, h, q, kv):
        return score + table[q - kv + S]

    check(lambda q, k, v: flex_attention(q, k, v, score_mod=relative), *qkv(), atol=1e-5, rtol=1e-5)


def test_grouped_query_attention():
    q, k, v = qkv()
    check(lambda q, k, v: flex_attention(q, k[:, :2], v[:, :2], block_mask=block_mask(causal), enable_gqa=True),
          q, k, v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_a_float32_score_mod_over_half_precision_inputs_is_not_rounded(attention_log, training):
    """Eager adds a score_mod's values in float32; a bfloat16 call's bias would round ALiBi's
    slope x distance (up to 127 here, a step of 0.5), so the scores stay float32."""
    if training and TEST_DEVICE == "cpu":
        pytest.skip("eager FlexAttention has no CPU backward to compare with")
    inputs = qkv(torch.bfloat16)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=alibi)

    leaves = [x.clone().requires_grad_(training) for x in inputs]
    expected = f(*leaves)
    twins = [x.clone().requires_grad_(training) for x in inputs]
    got = torch.compile(f, backend="ferrocore")(*twins)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    if training:
        expected.float().square().sum().backward()
        got.float().square().sum().backward()
        for a, b in zip(twins, leaves):
            torch.testing.assert_close(a.grad, b.grad, rtol=5e-2, atol=5e-2)
    elif TEST_DEVICE == "cpu":
        assert "would round" in attention_log()
    else:  # ferrocore's attention kernel adds the bias in float32
        assert "fused_attention_overrideable" in attention_log()
