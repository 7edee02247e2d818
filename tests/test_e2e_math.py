"""Math functions over their whole float range, edges included (ferrocore has its own exp)."""

import torch

from helpers import check


def test_exp_over_the_float_range():
    x = torch.cat(
        [
            torch.linspace(-110, 95, 20001),
            torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 88.72, -87.5, -103.9]),
        ]
    )
    check(lambda t: (t.exp(), torch.sigmoid(t), torch.softmax(t.view(1, -1)[:, :20000], -1)), x, rtol=2e-6, atol=0)


def test_masked_softmax_rows():
    scores = torch.randn(64, 128)
    mask = torch.ones(128, 128, dtype=torch.bool).tril()[:64]
    check(lambda s, m: torch.softmax(s.masked_fill(~m, float("-inf")), -1), scores, mask)
