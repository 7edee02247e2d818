#!/usr/bin/env python
"""Getting started: one function called with inputs of changing sizes.

    python examples/dynamic_shapes.py

With `dynamic=True` Dynamo traces the function once with symbolic sizes; ferrocore compiles
that graph for each new input signature it meets (the `recompiles` log names what changed).
"""

import torch

import ferrocore


def layer_norm_gelu(x, weight):
    return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, x.shape[-1:], weight))


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64)
    compiled = torch.compile(layer_norm_gelu, backend="ferrocore", dynamic=True,
                             options={"logs": "recompiles"})
    for rows in (3, 17, 100, 17):
        x = torch.randn(rows, 64)
        error = (compiled(x, weight) - layer_norm_gelu(x, weight)).abs().max().item()
        print(f"{rows:3d} rows: max abs error against eager {error:.2e}")
        assert error < 1e-5, error
    print(f"compiles for new signatures: {ferrocore.metrics.total['recompiles']}")
    print("OK")


if __name__ == "__main__":
    main()
