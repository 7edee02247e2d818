"""Fusion and caching, observed from outside: how many kernels a function compiles to, and a
warm compile-cache hit. Kernel counts are asserted for backends that report them (ferrocore, and
inductor, whose design ferrocore follows); the cache test needs ferrocore's metrics."""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from helpers import check, compile_fn, ferrocore_metrics


@pytest.mark.kernel_count
def test_kernel_count_relu_add_sum_is_one_kernel():
    check(lambda x: x.relu().add(1).sum(-1), torch.randn(32, 48), expect_kernels=1)


@pytest.mark.kernel_count
def test_kernel_count_softmax_last_dim_at_most_two():
    check(lambda x: torch.softmax(x, -1), torch.randn(32, 64), max_kernels=2)


@pytest.mark.kernel_count
def test_kernel_count_ten_op_pointwise_chain_is_one_kernel():
    def chain(x, y):
        z = x * 2 + y  # 2
        z = z.sin() - 0.5  # 4
        z = z.abs().sqrt()  # 6
        z = (z * y).tanh()  # 8
        return torch.sigmoid(z + 1)  # 10

    check(chain, torch.randn(32, 48), torch.randn(32, 48), expect_kernels=1)


@pytest.mark.kernel_count
def test_kernel_count_layer_norm_at_most_two():
    x, w, b = torch.randn(32, 64), torch.randn(64), torch.randn(64)
    check(lambda x, w, b: F.layer_norm(x, (64,), w, b), x, w, b, max_kernels=2)


@pytest.mark.kernel_count
def test_kernel_count_multiple_outputs_share_one_kernel():
    # Two pointwise outputs of the same shape and their common input: one loop nest.
    check(lambda x: (x.exp() + 1, x.exp() * 2), torch.randn(32, 48), expect_kernels=1)


def test_many_small_outputs_fuse_into_kernels_a_call_can_take():
    # 1,100 small results of one input would fuse into one kernel of 1,101 buffer
    # parameters; a C++ kernel is called through ctypes (at most 1024 arguments): kernels take
    # at most 512 buffers
    def many(x):
        return [x[i] * (i + 1) for i in range(1100)]

    check(many, torch.randn(1100, 4))


@pytest.mark.ferrocore_only
def test_kernels_that_differ_only_in_name_are_defined_once(monkeypatch):
    # the same bias+GELU kernel after each of three matmuls: one definition in the source the
    # compiler builds (C++ or Triton), launched three times, each launch naming its own nodes
    # (the matmuls library calls: on the CPU they are otherwise kernels with the bias and GELU)
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "never")
    metrics = ferrocore_metrics()
    w = torch.randn(16, 16) * 0.3

    def layers(x, b):
        for _ in range(3):
            x = F.gelu(x @ w + b)
        return x

    check(layers, torch.randn(8, 16), torch.randn(16))
    with open(metrics.last["module_path"]) as f:
        module = f.read()
    launches = re.findall(r"^    (\w*fused_add_gelu\w*)[(\[]", module, re.M)
    assert len(launches) == 3 and len(set(launches)) == 1, launches
    definitions = re.findall(r"(?:int|def) (\w*fused_add_gelu\w*)\(", module)
    assert definitions == [launches[0].removeprefix("launch_")], definitions  # (Triton's launcher)
    for nodes in ("add, gelu", "add_1, gelu_1", "add_2, gelu_2"):
        assert f"# graph nodes: {nodes}\n" in module, nodes


@pytest.mark.ferrocore_only
@pytest.mark.cpu_only("asserts the C++ compile cache")
def test_warm_cache_hit(tmp_path, monkeypatch):
    metrics = ferrocore_metrics()
    cache_dir = tmp_path / "ferrocore-cache"
    monkeypatch.setenv("FERROCORE_CACHE_DIR", str(cache_dir))
    # A constant unique to this run keeps the first compile from hitting any earlier cache entry.
    c = round(random.uniform(1.0, 2.0), 6)

    def fn(x):
        return (x * c).sin().sum(-1)

    x = torch.randn(16, 32)
    expected = fn(x)

    for attempt, expect_hit in (("cold", False), ("warm", True)):
        torch._dynamo.reset()
        metrics.reset()
        compiled, counting = compile_fn(fn)
        torch.testing.assert_close(compiled(x), expected)
        assert counting.graphs >= 1
        last = metrics.last
        assert not last["graph_fallback"], f"{attempt} compile ran eagerly"
        assert last["kernels"] >= 1
        assert last["cpp_cache_hit"] is expect_hit, (
            f"{attempt} compile: cpp_cache_hit={last['cpp_cache_hit']}, expected {expect_hit}"
        )
        assert cache_dir.is_dir() and any(cache_dir.rglob("*")), (
            f"FERROCORE_CACHE_DIR={cache_dir} was not used"
        )
