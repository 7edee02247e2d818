"""Random ops: checked by distribution and by reproducibility under torch.manual_seed."""

import pytest
import torch
import torch.nn.functional as F

import ferrocore


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="ferrocore", dynamic=False)


@pytest.mark.cpu_only("a factory call inside the compiled function: dynamo does not apply torch.set_default_device to it, so eager and compiled results land on different devices")
def test_rand_and_randn_distributions_and_seeding():
    fn = _compiled(lambda x: (torch.rand(256, 512) + x, torch.randn(300, 300, dtype=torch.float64) * 2))
    x = torch.zeros(256, 512)
    torch.manual_seed(7)
    u, n = fn(x)
    assert ferrocore.metrics.last["fallbacks"] == 0 and not ferrocore.metrics.last["graph_fallback"]
    assert u.dtype == torch.float32 and n.dtype == torch.float64 and u.shape == (256, 512)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.std().item() - 12 ** -0.5) < 0.01
    assert abs(n.mean().item()) < 0.03 and abs(n.std().item() - 2.0) < 0.03
    torch.manual_seed(7)
    u2, n2 = fn(x)
    assert torch.equal(u, u2) and torch.equal(n, n2)  # same seed, same numbers
    u3, _ = fn(x)
    assert not torch.equal(u, u3)  # the generator advanced


def test_dropout_mask_and_scaling():
    fn = _compiled(lambda x: F.dropout(x * 1, p=0.3, training=True))
    x = torch.randn(400, 500)
    torch.manual_seed(3)
    y = fn(x)
    assert ferrocore.metrics.last["fallbacks"] == 0
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01
    torch.testing.assert_close(y[kept], (x / 0.7)[kept])
    torch.manual_seed(3)
    assert torch.equal(fn(x), y)


def test_rand_like_randn_like_and_bernoulli():
    fn = _compiled(lambda x: (torch.rand_like(x), torch.randn_like(x) + 1, torch.bernoulli(x, 0.25), F.dropout2d(x, 0.5)))
    x = torch.zeros(64, 32, 20)
    torch.manual_seed(11)
    u, n, b, d = fn(x)
    assert ferrocore.metrics.last["fallbacks"] == 0 and not ferrocore.metrics.last["graph_fallback"]
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.01
    assert abs(n.mean().item() - 1.0) < 0.02 and abs(n.std().item() - 1.0) < 0.02
    assert set(b.unique().tolist()) == {0.0, 1.0} and abs(b.mean().item() - 0.25) < 0.01
    assert d.shape == x.shape
    torch.manual_seed(11)
    again = fn(x)
    assert all(torch.equal(a, c) for a, c in zip((u, n, b, d), again))


def test_rrelu_training_and_eval():
    x = torch.randn(300, 200)
    fn = _compiled(lambda t: F.rrelu(t, 0.1, 0.3, training=True))
    torch.manual_seed(5)
    y = fn(x)
    assert ferrocore.metrics.last["fallbacks"] == 0 and not ferrocore.metrics.last["graph_fallback"]
    pos = x > 0
    assert torch.equal(y[pos], x[pos])
    slope = y[~pos] / x[~pos]
    assert 0.1 <= slope.min() and slope.max() < 0.3 + 1e-6 and abs(slope.mean().item() - 0.2) < 0.01
    torch.manual_seed(5)
    assert torch.equal(fn(x), y)
    ev = _compiled(lambda t: F.rrelu(t, 0.1, 0.3, training=False))
    torch.testing.assert_close(ev(x), F.rrelu(x, 0.1, 0.3, training=False))
