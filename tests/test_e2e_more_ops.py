"""Activations, data movement and library calls beyond the first set of lowerings."""

import torch
import torch.nn.functional as F

import ferrocore
from helpers import check


def test_elu_and_leaky_relu():
    x = torch.randn(7, 9)
    check(lambda t: (F.elu(t), F.elu(t, alpha=0.5), F.leaky_relu(t), F.leaky_relu(t, 0.2), F.selu(t), F.celu(t)), x)


def test_flip_and_repeat():
    x = torch.randn(4, 5, 3)
    check(lambda t: (t.flip(0), t.flip(-1, 1) * 2, t.repeat(2, 1, 3), t[0].repeat(3, 1, 2) + 1), x)


def test_as_strided_on_an_input_view_and_a_computed_tensor():
    base = torch.randn(40)
    x = base[3:]
    check(lambda t: (torch.as_strided(t, (3, 4), (5, 1), 7) * 2, torch.as_strided(t.exp(), (2, 3), (1, 2)) + 1), x)


def test_library_calls_count_as_externs_not_fallbacks():
    x = torch.randn(2, 3, 10, 10)
    w = torch.randn(4, 3, 3, 3)
    check(lambda a, b: F.relu(F.conv2d(a, b, padding=1)) + 1, x, w)
    assert ferrocore.metrics.last["externs"] >= 1
    v = torch.randn(5, 12)
    check(lambda t: (torch.sort(t, -1)[0] * 2, torch.topk(t, 3)[1], torch.topk(t, 3)[0].sum()), v)
    assert ferrocore.metrics.last["fallbacks"] == 0
