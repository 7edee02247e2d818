#!/usr/bin/env python
"""Getting started: compile a small CNN for inference on the CPU and check it against eager.

    python examples/cpu_inference.py

Inference runs under `torch.no_grad()`; without it a model whose parameters require gradients
is compiled for training (its backward is compiled only if backward runs).
"""

import time

import torch

import ferrocore


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    ).eval()
    images = torch.randn(8, 3, 32, 32)
    compiled = torch.compile(model, backend="ferrocore")
    with torch.no_grad():
        start = time.perf_counter()
        logits = compiled(images)  # the first call compiles
        compile_s = time.perf_counter() - start
        expected = model(images)
    error = (logits - expected).abs().max().item()
    print(f"first call (compile and run): {compile_s:.2f} s; max abs error against eager: {error:.2e}")
    print(f"graphs compiled: {ferrocore.metrics.total['graphs']}, kernels in the last: {ferrocore.metrics.last['kernels']}, "
          f"ATen fallbacks: {ferrocore.metrics.total['fallbacks']}")
    assert error < 1e-4, error
    print("OK")


if __name__ == "__main__":
    main()
