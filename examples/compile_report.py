#!/usr/bin/env python
"""Getting started: why a graph compiled as it did. Writes the stage dumps and the HTML compile
report of each graph into a directory, and prints the fusion decisions.

    python examples/compile_report.py [DIRECTORY]   # default: ./ferrocore_debug
"""

import sys
from pathlib import Path

import torch

import ferrocore


def attention_scores(q, k, mask):
    return torch.softmax((q @ k.transpose(-1, -2)) / 8.0 + mask, dim=-1)


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "ferrocore_debug").resolve()
    q, k = torch.randn(2, 4, 32, 64), torch.randn(2, 4, 32, 64)
    mask = torch.zeros(32, 32).masked_fill(torch.ones(32, 32).triu(1).bool(), float("-inf"))
    compiled = torch.compile(attention_scores, backend="ferrocore",
                             options={"debug_dir": str(out_dir), "logs": "fusion"})
    compiled(q, k, mask)
    reports = sorted(out_dir.rglob("report.html"))
    print(f"compile reports: {[str(r) for r in reports]}")
    assert reports, f"no report under {out_dir}"
    print("open one in a browser: each kernel, what it fused and why, and the time per stage")
    print("OK")


if __name__ == "__main__":
    main()
