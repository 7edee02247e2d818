"""Compile-time stages of very wide graphs: a `cat` / `stack` of thousands of inputs.

    python bench/wide_graphs.py     # cat of 1000, 2000, 5000, 10000; stack of 3000; 10,000 outputs
    python bench/wide_graphs.py cat:10000 stack:3000 outs:10000 --dynamo

Each graph is compiled once in this process (in a fresh cache directory unless `--warm-cache`,
so the C++ compile runs) and the per-stage milliseconds (`ferrocore.metrics.last["timings_ms"]`) are printed as a table,
with the whole compile's wall time. By default the graph is traced with `make_fx` and compiled
with `ferrocore.compile_graph` (no dynamo: its tracing of thousands of arguments takes longer
than ferrocore); `--dynamo` goes through `torch.compile(backend="ferrocore")` instead.
The scheduler's target: a 10,000-input `cat` schedules in under a second (`--check` fails
otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ferrocore

STAGES = ("serialize", "import", "lowering", "scheduling", "codegen", "wrapper", "cpp_compile", "load")


def build(kind: str, n: int):
    if kind == "cat":
        return (lambda *xs: torch.cat(xs)), [torch.randn(4) for _ in range(n)]
    if kind == "stack":
        return (lambda *xs: torch.stack(xs)), [torch.randn(4) for _ in range(n)]
    if kind == "outs":  # n small results: side by side in one kernel
        return (lambda *xs: [x * 2 for x in xs]), [torch.randn(4) for _ in range(n)]
    raise SystemExit(f"unknown graph kind {kind!r} (cat, stack, outs)")


def measure(kind: str, n: int, dynamo: bool) -> tuple[dict, float]:
    fn, xs = build(kind, n)
    expected = fn(*xs)
    start = time.perf_counter()
    if dynamo:
        torch._dynamo.reset()
        out = torch.compile(fn, backend="ferrocore")(*xs)
    else:
        gm = make_fx(fn)(*xs)
        start = time.perf_counter()
        outs = ferrocore.compile_graph(gm, xs)(*xs)  # a list of the graph's outputs
        out = list(outs) if isinstance(expected, list) else outs[0]
    total = (time.perf_counter() - start) * 1e3
    torch.testing.assert_close(out, expected)
    return dict(ferrocore.metrics.last["timings_ms"]), total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="*", default=["cat:1000", "cat:2000", "cat:5000", "cat:10000", "stack:3000", "outs:10000"])
    ap.add_argument("--dynamo", action="store_true", help="compile through torch.compile (includes dynamo's time)")
    ap.add_argument("--warm-cache", action="store_true", help="keep FERROCORE_CACHE_DIR (C++ compiles may hit its cache)")
    ap.add_argument("--check", action="store_true", help="fail if a 10,000-input cat schedules in 1 s or more")
    opts = ap.parse_args()
    if not opts.warm_cache:  # a fresh cache: the C++ compile runs
        os.environ["FERROCORE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ferrocore-wide-")
    print(f"{'graph':<12}" + "".join(f"{s:>12}" for s in STAGES) + f"{'total':>12}   (ms)")
    failed = False
    for spec in opts.graphs:
        kind, n = spec.split(":")
        timings, total = measure(kind, int(n), opts.dynamo)
        print(f"{spec:<12}" + "".join(f"{timings.get(s, float('nan')):>12.1f}" for s in STAGES) + f"{total:>12.1f}",
              flush=True)
        if opts.check and kind == "cat" and int(n) >= 10000 and timings.get("scheduling", 0) >= 1000:
            failed = True
    if failed:
        sys.exit("a 10,000-input cat took a second or more to schedule")


if __name__ == "__main__":
    main()
