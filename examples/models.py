"""The models the demo, the benchmark and the end-to-end tests share.

- `TransformerBlock`: a pre-norm transformer block built from a `BlockConfig` with random weights
  (nothing is downloaded): LayerNorm, multi-head causal self-attention written out with matmuls
  and softmax (no SDPA, so the compiler sees every op), a GELU MLP and residual connections.
- `elementwise_reduction`: a plain function mixing pointwise ops and row reductions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BlockConfig:
    d_model: int = 256
    n_heads: int = 4
    seq_len: int = 128
    batch: int = 4
    mlp_ratio: int = 4
    causal: bool = True
    gelu_approximate: str = "none"  # or "tanh"
    eps: float = 1e-5


SMALL_CONFIG = BlockConfig(d_model=64, n_heads=4, seq_len=16, batch=2)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of n_heads {cfg.n_heads}")
        self.cfg = cfg
        d, hidden = cfg.d_model, cfg.d_model * cfg.mlp_ratio
        self.ln1 = nn.LayerNorm(d, eps=cfg.eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=cfg.eps)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.act = nn.GELU(approximate=cfg.gelu_approximate)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.cfg.n_heads
        q, k, v = self.qkv(x).split(c, dim=-1)
        # (b, t, c) -> (b, h, t, c/h)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        if self.cfg.causal:
            scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        y = (probs @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        x = x + self.fc2(self.act(self.fc1(self.ln2(x))))
        return x


def make_block(cfg: BlockConfig = BlockConfig(), seed: int = 0) -> TransformerBlock:
    """A block in eval mode with seeded random weights (LayerNorm affines randomized too)."""
    gen = torch.Generator().manual_seed(seed)
    block = TransformerBlock(cfg)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.copy_(_randn(p.shape, gen) * 0.02)
            elif p.dim() == 1:  # LayerNorm weight
                p.copy_(1.0 + _randn(p.shape, gen) * 0.1)
            else:
                p.copy_(_randn(p.shape, gen) / math.sqrt(p.shape[1]))
    return block.eval()


def make_block_input(cfg: BlockConfig = BlockConfig(), seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return _randn((cfg.batch, cfg.seq_len, cfg.d_model), gen)


def elementwise_reduction(x: torch.Tensor, y: torch.Tensor):
    """Pointwise math feeding three row reductions (sum, max, variance)."""
    z = torch.sigmoid(x) * torch.tanh(y) + 0.5 * x
    z = torch.where(z > 0, z, 0.1 * z)
    centered = z - z.mean(dim=-1, keepdim=True)
    return z.sum(dim=-1), z.amax(dim=-1), (centered * centered).mean(dim=-1)


def make_elementwise_inputs(rows: int = 1024, cols: int = 1024, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    return _randn((rows, cols), gen), _randn((rows, cols), gen)


def _randn(shape, gen: torch.Generator) -> torch.Tensor:
    """Seeded values drawn on the CPU (the same on every machine), placed on the default device."""
    return torch.randn(shape, generator=gen, device="cpu").to(torch.get_default_device())
