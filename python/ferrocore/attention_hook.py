"""torch's backend hook for fused attention (`_scaled_dot_product_fused_attention_overrideable`
and its backward), which the compiler lowers to ferrocore's attention kernels, made runnable
outside them. torch gives the hook no CPU or CUDA kernel (it is for out-of-tree devices), and
before torch 2.12 its backward no fake kernel either. Where a graph holding the hook runs
eagerly (a graph fallback, a node the lowering leaves to ATen), these kernels compute what
ferrocore's do: float32 scores plus the bias, a row with every key closed giving 0 and a
log-sum-exp of -inf, the gradients recomputed from the log-sum-exp. The trace needs the fake
kernel. Registered once per process (`register`), only where torch has none.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

_ATEN = torch.ops.aten
_FORWARD = "_scaled_dot_product_fused_attention_overrideable"
_BACKWARD = "_scaled_dot_product_fused_attention_overrideable_backward"
_LIBRARY = None  # the registrations live as long as it does


def register() -> None:
    """Registers what torch lacks of the hook's kernels (idempotent)."""
    global _LIBRARY
    if _LIBRARY is not None or not hasattr(_ATEN, _BACKWARD):
        return
    _LIBRARY = torch.library.Library("aten", "IMPL")
    if getattr(_ATEN, _BACKWARD).default not in torch._decomp.meta_table:
        _LIBRARY.impl(_BACKWARD, _backward_meta, "Meta")
    if not _runs_on_cpu():
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(_FORWARD, _forward, key)
            _LIBRARY.impl(_BACKWARD, _backward, key)


def _runs_on_cpu() -> bool:
    # (outside the trace's modes: under a fake mode the hook's fake kernel would answer)
    with _disable_current_modes():
        q = torch.zeros(1, 1, 1, 8)
        try:
            getattr(_ATEN, _FORWARD)(q, q, q)
        except NotImplementedError:
            return False
    return True


def _backward_meta(grad_out, query, key, value, attn_bias, grad_input_mask, *rest, scale=None):
    bias = torch.empty_like(attn_bias) if attn_bias is not None else None
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), bias


def _probabilities(query, key, attn_bias, scale):
    """The float32 scores plus the bias, the log-sum-exp of each row and its probabilities."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.float()
    lse = torch.logsumexp(scores, -1)
    # a row with every key closed: -inf, probabilities 0
    p = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    return p, lse, scale


def _forward(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
             scale=None):
    if dropout_p != 0.0 or is_causal:
        raise NotImplementedError("ferrocore's attention hook takes no dropout and its mask in the bias")
    p, lse, _ = _probabilities(query, key, attn_bias, scale)
    out = (p @ value.float()).to(query.dtype)
    # laid out as the query (what the hook's fake kernel says)
    order = sorted(range(4), key=lambda i: -query.stride(i))
    laid = torch.empty([out.shape[i] for i in order], dtype=out.dtype, device=out.device).permute(
        [order.index(i) for i in range(4)])
    laid.copy_(out)
    seed = torch.empty((), dtype=torch.long, device=query.device)
    return laid, lse, None, None, query.shape[-2], key.shape[-2], seed, seed.clone(), None


def _backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
              max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    p, _, scale = _probabilities(query, key, attn_bias, scale)
    do = grad_out.float()
    dv = p.transpose(-1, -2) @ do
    dp = do @ value.float().transpose(-1, -2)
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ key.float()) * scale
    dk = (ds.transpose(-1, -2) @ query.float()) * scale
    dbias = ds.sum_to_size(attn_bias.shape).to(attn_bias.dtype) if attn_bias is not None and grad_input_mask[3] else None
    like = lambda g, t: torch.empty_like(t).copy_(g)  # noqa: E731 - strides as the fake kernel's
    return like(dq, query), like(dk, key), like(dv, value), dbias
