#!/usr/bin/env python
"""Getting started: a training loop with a compiled model and a compiled AdamW step.

    python examples/training_loop.py

`torch.compile(model)` compiles the forward and (at the first `backward()`) the backward;
`torch.compile(optimizer.step)` compiles the parameter update into one loop per parameter.
"""

import torch

import ferrocore


def main(steps: int = 20) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled_model = torch.compile(model, backend="ferrocore")

    @torch.compile(backend="ferrocore")
    def step():
        optimizer.step()

    x = torch.randn(256, 32)
    y = x[:, :1].sin() + 0.1 * x[:, 1:2]
    first = last = None
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(compiled_model(x), y)
        loss.backward()
        step()
        first = loss.item() if first is None else first
        last = loss.item()
        if i % 5 == 0:
            print(f"step {i:2d}: loss {last:.4f}")
    print(f"loss {first:.4f} -> {last:.4f}; ATen fallbacks: {ferrocore.metrics.total['fallbacks']}")
    assert last < first
    print("OK")


if __name__ == "__main__":
    main()
