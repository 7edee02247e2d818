#!/usr/bin/env python
"""ferrocore demo: compile a transformer block and an elementwise/reduction function.

For each model: compile with `torch.compile(backend="ferrocore")`, check the result against eager
(max abs error, PASS/FAIL), print the generated code and the compile time by stage, and compare
the runtime with eager and with `torch.compile(backend="inductor")`.

    python examples/demo.py                  # d_model=256, heads=4, seq=128, batch=4
    python examples/demo.py --small --reps 5 # quick
    python examples/demo.py --backend inductor --no-inductor  # check the demo itself

Exits with status 1 if any check fails. Weights are random (seeded); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from examples.models import (  # noqa: E402,F401  (re-exported: `from examples.demo import ...`)
    SMALL_CONFIG,
    BlockConfig,
    TransformerBlock,
    elementwise_reduction,
    make_block,
    make_block_input,
    make_elementwise_inputs,
)

RTOL, ATOL = 1e-4, 1e-4


def _flat_tensors(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def max_abs_error(expected, actual) -> float:
    errs = [
        (a.double() - e.double()).abs().max().item() if e.numel() else 0.0
        for e, a in zip(_flat_tensors(expected), _flat_tensors(actual))
    ]
    return max(errs, default=0.0)


def outputs_match(expected, actual) -> bool:
    exp, act = _flat_tensors(expected), _flat_tensors(actual)
    if len(exp) != len(act):
        return False
    for e, a in zip(exp, act):
        if e.shape != a.shape or e.dtype != a.dtype:
            return False
        if not torch.allclose(a, e, rtol=RTOL, atol=ATOL, equal_nan=True):
            return False
    return True


def time_interleaved(
    fns: dict[str, Callable], args, reps: int, warmup: int = 3
) -> dict[str, float]:
    """Median milliseconds per call; one rep of each function per round, rotating the order."""
    for _ in range(warmup):
        for fn in fns.values():
            fn(*args)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            fns[name](*args)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


STAGE_ORDER = (
    "aot",
    "serialize",
    "import",
    "lowering",
    "scheduling",
    "codegen",
    "wrapper",
    "cpp_compile",
    "load",
)


def ordered_stages(timings: dict) -> list[tuple[str, float]]:
    """ferrocore's stages in pipeline order, unknown ones after."""
    known = [(k, timings[k]) for k in STAGE_ORDER if k in timings]
    return known + [(k, v) for k, v in timings.items() if k not in STAGE_ORDER]


def ferrocore_last() -> dict | None:
    try:
        import ferrocore
    except ImportError:
        return None
    return dict(ferrocore.metrics.last) if ferrocore.metrics.last else None


def _without_prelude(lines: list) -> list:
    """The C++ prelude is the same in every module: show it as one line."""
    marker = "KERNEL_SOURCE = r" + "'" * 3
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(marker))
        end = next(i for i in range(start, len(lines)) if lines[i].startswith('extern "C" int'))
    except StopIteration:
        return lines
    skipped = f"// ... {end - start} lines of the shared kernel prelude (see the file)"
    return lines[:start] + [marker, skipped] + lines[end:]


def print_generated_code(last: dict | None, limit: int | None) -> None:
    if last is None:
        return
    path = last.get("module_path")
    source = last.get("module_source")
    if path and os.path.exists(path):
        source = Path(path).read_text()
        print(f"--- generated wrapper module: {path}")
    elif source:
        print("--- generated wrapper module (source)")
    else:
        print("--- no module path in ferrocore.metrics.last; rerun with FERROCORE_LOGS=output_code")
        return
    lines = _without_prelude(source.splitlines())
    shown = lines if limit is None else lines[:limit]
    print("\n".join(shown))
    if len(shown) < len(lines):
        print(f"... ({len(lines) - len(shown)} more lines; --code-lines 0 prints all)")
    print("--- end of generated module")


def run_case(name: str, fn: Callable, args: tuple, opts) -> bool:
    print(f"\n=== {name} ===")
    torch._dynamo.reset()
    expected = fn(*args)

    compiled = torch.compile(fn, backend=opts.backend, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    actual = compiled(*args)
    compile_s = time.perf_counter() - start
    last = ferrocore_last() if opts.backend == "ferrocore" else None

    err = max_abs_error(expected, actual)
    ok = outputs_match(expected, actual)
    ran_eagerly = bool(last and last.get("graph_fallback"))
    verdict = "PASS" if ok and not ran_eagerly else "FAIL"
    print(f"check vs eager: max abs error {err:.3e} (rtol {RTOL}, atol {ATOL}): {verdict}")
    if ran_eagerly:
        print("  the graph ran eagerly (graph_fallback): nothing was compiled")

    if last is not None:
        print(
            f"kernels {last.get('kernels')}, externs {last.get('externs')}, "
            f"fallbacks {last.get('fallbacks')} {last.get('fallback_ops') or ''}, "
            f"cpp cache hit {last.get('cpp_cache_hit')}"
        )
        if opts.code_lines != -1:
            print_generated_code(last, opts.code_lines or None)
        timings = last.get("timings_ms") or {}
        print(f"compile time by stage (first call took {compile_s * 1e3:.1f} ms):")
        for stage, ms in ordered_stages(timings):
            print(f"  {stage:<12} {ms:10.2f} ms")
        print(f"  {'total':<12} {sum(timings.values()):10.2f} ms")
    else:
        print(f"compile time (first call, backend {opts.backend}): {compile_s * 1e3:.1f} ms")

    fns = {"eager": fn, opts.backend: compiled}
    if not opts.no_inductor and opts.backend != "inductor":
        inductor = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)
        start = time.perf_counter()
        inductor(*args)
        print(f"inductor compile (first call): {(time.perf_counter() - start) * 1e3:.1f} ms")
        fns["inductor"] = inductor
    times = time_interleaved(fns, args, opts.reps)
    base = times["eager"]
    print(f"runtime, median of {opts.reps} (ms):")
    for label, ms in times.items():
        print(f"  {label:<10} {ms:10.3f}   {base / ms:5.2f}x vs eager")
    return verdict == "PASS"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backend", default="ferrocore", help="backend to demo (default ferrocore)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per backend")
    ap.add_argument("--small", action="store_true", help="a small block and inputs")
    ap.add_argument("--no-inductor", action="store_true", help="skip the inductor comparison")
    ap.add_argument(
        "--code-lines",
        type=int,
        default=0,
        help="lines of generated code to print per model (0: all, -1: none)",
    )
    opts = ap.parse_args(argv)

    if opts.backend == "ferrocore":
        import ferrocore  # noqa: F401  (registers the backend; fails loudly if not built)

    cfg = SMALL_CONFIG if opts.small else BlockConfig()
    rows, cols = (64, 128) if opts.small else (1024, 1024)
    block = make_block(cfg)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; block {cfg}; "
        f"elementwise inputs {rows}x{cols}"
    )

    results = {}
    with torch.no_grad():
        results["transformer block"] = run_case(
            "transformer block", block, (make_block_input(cfg),), opts
        )
        results["elementwise + reduction"] = run_case(
            "elementwise + reduction",
            elementwise_reduction,
            make_elementwise_inputs(rows, cols),
            opts,
        )

    print("\n=== summary ===")
    for name, ok in results.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
