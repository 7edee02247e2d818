"""The compiled-graph cache: a second compile of a graph (a new process, or after
`torch._dynamo.reset()`) loads the first one's entry instead of running AOT autograd and
compiling; corrupt entries are rebuilt; graphs the cache cannot vouch for bypass it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo

from helpers import is_ferrocore

pytestmark = pytest.mark.skipif(not is_ferrocore(), reason="ferrocore's own cache")


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    return str(d)


def _compile(fn, cache_dir, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="ferrocore", options={"cache_dir": cache_dir, "logs": "graph_cache", **options})


def _log(capfd) -> str:
    return capfd.readouterr().err


def _entries(cache_dir) -> list:
    return sorted(Path(cache_dir, "compiled").rglob("*.json"))


def _block(x, w, b):
    h = torch.nn.functional.layer_norm(x @ w + b, (w.shape[1],))
    return torch.softmax(h, -1) * torch.tensor([2.0], device=x.device), h.sum(0)


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 16), torch.randn(16, 32), torch.randn(32)


def _check_same(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
        torch.testing.assert_close(g, w)


def test_second_compile_loads_the_entry(cache_dir, capfd):
    from ferrocore import metrics

    args = _inputs()
    want = _block(*args)
    with torch.no_grad():
        first = _compile(_block, cache_dir)(*args)
    assert "stored" in _log(capfd)
    assert len(_entries(cache_dir)) == 1
    metrics.reset()
    with torch.no_grad():
        second = _compile(_block, cache_dir)(*args)
    log = _log(capfd)
    assert "hit" in log, log
    assert metrics.last["graph_cache"] == "hit"
    assert "aot" not in metrics.last["timings_ms"] and "lowering" not in metrics.last["timings_ms"]
    assert metrics.last["kernels"] > 0
    _check_same(first, want)
    _check_same(second, want)


def _two_processes(script: str, cache_dir: str) -> list:
    """Runs `script` (argv: the cache, this folder) in two new processes, one after the other."""
    here = str(Path(__file__).resolve().parent)
    runs = [subprocess.run([sys.executable, "-c", script, cache_dir, here], capture_output=True, text=True,
                           env=os.environ.copy(), timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    return runs


def test_a_hit_shows_its_module_on_output_code_and_in_torch_trace(cache_dir, tmp_path):
    """A cache hit in a new process prints the module on `output_code` and records it (with a
    note of the hit) under TORCH_TRACE, as a compile would."""
    script = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, sys.argv[2])
        from test_graph_cache import _block, _inputs
        with torch.no_grad():
            torch.compile(_block, backend="ferrocore", options={"cache_dir": sys.argv[1], "logs": sys.argv[3]})(*_inputs())
        """
    )
    here = str(Path(__file__).resolve().parent)
    run = lambda logs, env: subprocess.run([sys.executable, "-c", script, cache_dir, here, logs],  # noqa: E731
                                           capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    # (the logs asked for are part of the key: the same in both)
    assert run("graph_cache,output_code", {}).returncode == 0
    hit = run("graph_cache,output_code", {"TORCH_TRACE": str(tmp_path / "trace")})
    assert hit.returncode == 0 and "hit " in hit.stderr, hit.stderr[-3000:]
    assert re.search(r"\[ferrocore:output_code\] block_\d+_\d+_inference \(", hit.stderr), hit.stderr[-3000:]
    trace = "".join(p.read_text() for p in (tmp_path / "trace").iterdir())
    assert re.search(r"ferrocore_block_\d+_\d+_inference_graph_cache", trace)
    assert re.search(r"ferrocore_block_\d+_\d+_inference_output_code", trace)


def test_a_new_process_hits_and_matches_eager(cache_dir):
    script = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, sys.argv[2])
        from test_graph_cache import _block, _inputs
        from ferrocore import metrics
        args = _inputs()
        with torch.no_grad():
            got = torch.compile(_block, backend="ferrocore", options={"cache_dir": sys.argv[1], "logs": "graph_cache"})(*args)
        want = _block(*args)
        for g, w in zip(got, want):
            assert g.stride() == w.stride() and g.dtype == w.dtype
            torch.testing.assert_close(g, w)
        print("cache", metrics.last.get("graph_cache", "compiled"))
        """
    )
    runs = _two_processes(script, cache_dir)
    assert "cache compiled" in runs[0].stdout
    assert "cache hit" in runs[1].stdout, runs[0].stderr[-2000:] + "\n----\n" + runs[1].stderr[-2000:]


def test_corrupt_or_truncated_entries_are_rebuilt(cache_dir, capfd):
    args = _inputs()
    want = _block(*args)
    with torch.no_grad():
        _compile(_block, cache_dir)(*args)
    (entry,) = _entries(cache_dir)
    for damage in (lambda b: b[: len(b) // 2], lambda b: b.replace(b"graph_", b"graph-", 1), lambda b: b""):
        entry.write_bytes(damage(entry.read_bytes()))
        _log(capfd)
        with torch.no_grad():
            got = _compile(_block, cache_dir)(*args)
        log = _log(capfd)
        assert "miss" in log and "stored" in log, log
        _check_same(got, want)
    with torch.no_grad():
        _compile(_block, cache_dir)(*args)
    assert "hit" in _log(capfd)


def test_the_key_follows_shapes_options_and_grad_mode(cache_dir, capfd):
    args = _inputs()
    with torch.no_grad():
        _compile(_block, cache_dir)(*args)
        _compile(_block, cache_dir)(torch.randn(4, 16), args[1], args[2])
        _compile(_block, cache_dir, check_inputs=False)(*args)
        _compile(_block, cache_dir)(args[0].t().contiguous().t(), args[1], args[2])
    log = _log(capfd)
    assert "hit" not in log, log
    assert len(_entries(cache_dir)) == 4


def test_input_mutation_inside_the_graph_is_cached(cache_dir, capfd):
    def f(x, y):
        x.mul_(2)
        return x + y

    for expect in ("stored", "hit"):
        x, y = torch.arange(6.0), torch.ones(6)
        with torch.no_grad():
            out = _compile(f, cache_dir)(x, y)
        assert expect in _log(capfd)
        torch.testing.assert_close(x, torch.arange(6.0) * 2)
        torch.testing.assert_close(out, torch.arange(6.0) * 2 + 1)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_graphs_the_cache_cannot_vouch_for_are_not_stored(cache_dir, capfd, grad):
    def fn(x):
        return x.view(2, 3), (x * x).sum()

    args = (torch.randn(6, requires_grad=grad),)
    for _ in range(2):
        got = _compile(fn, cache_dir)(*args)
        if grad:
            got[1].backward()
        log = _log(capfd)
        assert "not stored" in log and "alias" in log, log
    for g, w in zip(got, fn(*args)):
        torch.testing.assert_close(g, w)
    assert _entries(cache_dir) == []


class _TrainingNet(torch.nn.Module):
    """Convolution, batch norm (running statistics written by the graph), a non-differentiable
    output, an output whose gradient arrives transposed."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        y = self.fc(h)
        return y, y.argmax(-1), torch.tanh(h)


def _training_step(model, x):
    y, labels, h = model(x)
    (y.t() * torch.arange(5.0)[:, None]).sum().backward(retain_graph=True)
    h.sum().backward()
    return y, labels, h


def _training_case():
    torch.manual_seed(0)
    return _TrainingNet(), torch.randn(2, 3, 6, 6, requires_grad=True)


def _check_training(got_model, got, got_x, want_model, want, want_x):
    _check_same(got, want)
    torch.testing.assert_close(got_x.grad, want_x.grad)
    for (name, p), q in zip(want_model.named_parameters(), got_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: {m}")
    for b, c in zip(want_model.buffers(), got_model.buffers()):
        torch.testing.assert_close(c, b)
    assert got[0].requires_grad and not got[1].requires_grad and got[2].requires_grad


def test_training_graphs_hit_in_a_new_process(cache_dir):
    script = textwrap.dedent(
        """
        import copy, sys, torch
        sys.path.insert(0, sys.argv[2])
        from test_graph_cache import _check_training, _training_case, _training_step
        from ferrocore import metrics
        model, x = _training_case()
        eager, x_eager = copy.deepcopy(model), x.detach().clone().requires_grad_()
        want = _training_step(eager, x_eager)
        compiled = torch.compile(model, backend="ferrocore", options={"cache_dir": sys.argv[1]})
        got = _training_step(compiled, x)
        _check_training(model, got, x, eager, want, x_eager)
        traced = any(k in metrics.total["timings_ms"] for k in ("aot", "trace"))
        print("cache", metrics.total["graph_cache"].get("hit", 0), "traced", traced)
        """
    )
    runs = _two_processes(script, cache_dir)
    assert "cache 0 traced True" in runs[0].stdout
    assert "cache 2 traced False" in runs[1].stdout  # forward and backward
    assert len(_entries(cache_dir)) == 1


def test_a_training_hit_retains_graphs_and_refuses_double_backward(cache_dir, capfd):
    def f(x, w):
        return (torch.tanh(x @ w) * 3).sum()

    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    (once,) = torch.autograd.grad(f(x, w), w)
    for expect in ("stored", "hit"):
        compiled = _compile(f, cache_dir)
        loss = compiled(x, w)
        loss.backward(retain_graph=True)
        loss.backward()
        assert expect in _log(capfd)
        torch.testing.assert_close(w.grad, 2 * once)
        w.grad = None
        (g,) = torch.autograd.grad(compiled(x, w), w, create_graph=True)
        torch.testing.assert_close(g, once)
        # refused: torch 2.15 names double backward, older releases find no graph to differentiate
        with pytest.raises(RuntimeError, match="double backward|does not require grad"):
            g.sum().backward()


def test_user_functions_in_the_graph_bypass(cache_dir, capfd):
    @torch._dynamo.allow_in_graph
    def opaque(x):
        return x + 1

    with torch.no_grad():
        _compile(lambda x: opaque(x) * 2, cache_dir)(torch.randn(4))
    assert "bypass" in _log(capfd)
    assert _entries(cache_dir) == []


def test_off_switch(cache_dir, capfd):
    with torch.no_grad():
        _compile(_block, cache_dir, graph_cache=False)(*_inputs())
    assert "graph_cache" not in _log(capfd)
    assert _entries(cache_dir) == []
