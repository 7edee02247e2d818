"""Differential fuzzer: random programs compiled by ferrocore against eager PyTorch.

    python bench/fuzz.py --backend cpp --count 10000 --seed 0 --jobs 2 --report fuzz_report.md
    python bench/fuzz.py --backend triton --count 200            # Triton under the interpreter
    python bench/fuzz.py --backend triton --device cuda --count 2000
    python bench/fuzz.py --show 0:17                             # print program 17 of seed 0
    python bench/fuzz.py --minimize 0:17 --backend cpp           # shrink one failing program

Programs are generated in this process and run in worker processes (a crash is caught), a batch
of `--batch` programs compiled as one graph. See docs/fuzzing.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzzer.generate import generate  # noqa: E402
from fuzzer.minimize import Minimizer, fewest_partners, signature  # noqa: E402
from fuzzer.program import batch_repro  # noqa: E402
from fuzzer.runner import Worker, WorkerDied, check_one, is_failure, run_fuzz  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("cpp", "triton", "auto"), default="cpp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first program index")
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="programs compiled as one graph")
    p.add_argument("--threads", type=int, default=1, help="OpenMP / torch threads per worker")
    p.add_argument("--max-ops", type=int, default=6)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per batch before it counts as hung")
    p.add_argument("--minimize-per-class", type=int, default=3, help="failures minimized per class")
    p.add_argument("--max-checks", type=int, default=150, help="minimizer runs per failure")
    p.add_argument("--report", type=Path, help="write a markdown report here")
    p.add_argument("--budget", type=float, help="seconds after which no new batch starts (a device's time limit)")
    p.add_argument("--show", metavar="SEED:INDEX", help="print one program's repro and exit")
    p.add_argument("--minimize", metavar="SEED:INDEX", help="check and minimize one program")
    return p.parse_args(argv)


def _ident(text: str) -> tuple:
    seed, index = text.split(":")
    return int(seed), int(index)


def minimize_failure(worker: Worker, program, result: dict, max_checks: int, args=None):
    """(the repro script of the minimized failure, checks used). A `batch_only` failure keeps
    its program and the fewest programs of its batch it still fails together with."""
    if result["class"].startswith("batch_only:") and args is not None:
        partners, checks = shrink_batch(worker, program, result["class"].removeprefix("batch_only:"), args)
        return batch_repro(partners, args.backend, args.device), checks
    want = signature(result)
    m = Minimizer(lambda q: signature(check_one(worker, q)) == want, max_checks)
    small = m.run(program)
    return small.repro(args.backend if args else "cpp", args.device if args else "cpu"), m.checks


def batch_of(program, args) -> list:
    """The programs a run with these --seed/--start/--count/--batch compiled together with
    `program` (itself included), in order."""
    seed, i = _ident(program.ident)
    first = args.start + (i - args.start) // args.batch * args.batch
    last = min(first + args.batch, args.start + args.count) if i < args.start + args.count else first + args.batch
    return [generate(seed, j, max_ops=args.max_ops) for j in range(first, last)]


def failing_in(worker: Worker, group: list, program, cls: str) -> bool:
    """Whether `program` gets class `cls` when `group` (which holds it) is one graph."""
    try:
        results = worker.run(group)["results"]
    except WorkerDied as died:
        return died.cls == cls
    return results[[p.ident for p in group].index(program.ident)]["class"] == cls


def shrink_batch(worker: Worker, program, cls: str, args) -> tuple:
    """(the program with the fewest partners from its batch that still give it `cls`, checks)."""
    batch = batch_of(program, args)
    others = [p for p in batch if p.ident != program.ident]
    order = {p.ident: k for k, p in enumerate(batch)}

    def together(partners: list) -> list:
        return sorted([program, *partners], key=lambda p: order[p.ident])

    kept, checks = fewest_partners(others, lambda ps: failing_in(worker, together(ps), program, cls),
                                   args.max_checks)
    return together(kept), checks


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.show:
        print(generate(*_ident(args.show), max_ops=args.max_ops).repro(args.backend, args.device))
        return 0
    worker = Worker(args.backend, args.device, args.threads, args.timeout)
    if args.minimize:
        program = generate(*_ident(args.minimize), max_ops=args.max_ops)
        result = check_one(worker, program)
        print(f"# {program.ident}: {result['class']}\n# {result.get('detail', '')[:800]}")
        if result["class"] == "pass" and args.batch > 1:
            # it may fail only beside the programs a run compiles with it
            batch = batch_of(program, args)
            cls = next((r["class"] for r in worker.run(batch)["results"] if is_failure(r["class"])), None)
            if cls is not None and failing_in(worker, batch, program, cls):
                result = {"class": f"batch_only:{cls}", "detail": f"fails in its batch of {len(batch)}"}
                print(f"# in its batch (--start {args.start} --batch {args.batch}): {cls}")
        if is_failure(result["class"]):
            text, checks = minimize_failure(worker, program, result, args.max_checks, args)
            print(f"# minimized in {checks} runs\n{text}")
        worker.close()
        return 0
    programs = (generate(args.seed, i, max_ops=args.max_ops) for i in range(args.start, args.start + args.count))
    totals = run_fuzz(programs, backend=args.backend, device=args.device, jobs=args.jobs, batch=args.batch,
                      threads=args.threads, timeout=args.timeout, progress=_progress, budget=args.budget)
    print(file=sys.stderr)
    minimized = _minimize_all(worker, totals, args)
    worker.close()
    report = render_report(totals, minimized, args)
    if args.report:
        args.report.write_text(report)
    print(report if not args.report else summary(totals))
    return 0 if not totals.failures else 1


def _progress(totals) -> None:
    print(f"\r{totals.programs} programs, {len(totals.failures)} failures", end="", file=sys.stderr, flush=True)


def _minimize_all(worker: Worker, totals, args) -> dict:
    """ident -> (minimized program, checks), for the first few failures of each class."""
    done: Counter = Counter()
    out = {}
    for program, result in sorted(totals.failures, key=lambda f: _ident(f[0].ident)):
        cls = result["class"]
        if done[cls] >= args.minimize_per_class:
            continue
        done[cls] += 1
        out[program.ident] = minimize_failure(worker, program, result, args.max_checks, args)
    return out


def summary(totals) -> str:
    c = totals.classes
    fails = len(totals.failures)
    return (f"{totals.programs} programs, {totals.ops} ops, {c['pass']} passed, {fails} failures, "
            f"{sum(v for k, v in c.items() if k.startswith('deviation:'))} documented deviations, "
            f"{sum(v for k, v in c.items() if k.startswith('torch:'))} errors of torch's own, "
            f"{c['graph_fallback']} graph fallbacks, {c['invalid']} invalid, {totals.seconds:.0f} s")


def render_report(totals, minimized: dict, args) -> str:
    lines = [f"# Fuzz report: backend {args.backend}, device {args.device}",
             "",
             f"Seed {args.seed}, programs {args.start}..{args.start + args.count - 1}, batch {args.batch}, "
             f"jobs {args.jobs}, {time.strftime('%Y-%m-%d %H:%M')}." + (
                 f" The time budget ({args.budget:.0f} s) ran out: {totals.skipped} programs were not run, "
                 f"the last run is {totals.last}." if totals.skipped else ""),
             "",
             summary(totals),
             "",
             "| class | programs |",
             "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(totals.classes.items(), key=lambda kv: (-kv[1], kv[0]))]
    if totals.fallback_ops:
        lines += ["", "Node fallbacks to ATen (batches whose graph had one): " +
                  ", ".join(f"{k} {v}" for k, v in totals.fallback_ops.most_common())]
    if totals.graph_fallbacks:
        lines += ["", "Graphs ferrocore ran eagerly (not failures; the program is untested):"]
        lines += [f"- {v}: {k}" for k, v in totals.graph_fallbacks.most_common()]
    if totals.torch_batches:
        lines += ["", "Batches torch's own pipeline fails as a whole, alike without ferrocore (each of their "
                  "programs was checked in a smaller graph):"]
        for program, detail in sorted(totals.torch_batches, key=lambda f: _ident(f[0].ident)):
            first = next((ln for ln in detail.splitlines()[1:] if ln.strip()), detail)
            lines.append(f"- the batch of {program.ident}: {first[:200]}")
    if totals.excused:
        lines += ["", "## Documented deviations and torch's errors", "",
                  "Not failures: `deviation:*` are described in docs/fuzzing.md; `torch:*` "
                  "programs fail the same way under AOT autograd with ferrocore's decompositions and no "
                  "ferrocore code.", ""]
        for program, result in sorted(totals.excused, key=lambda f: _ident(f[0].ident)):
            first = next((ln for ln in result.get("detail", "").splitlines() if ln.strip()), "")
            lines.append(f"- {program.ident} `{result['class']}`: {first[:300]}")
    lines += ["", "## Failures", ""]
    if not totals.failures:
        lines.append("None.")
    for program, result in sorted(totals.failures, key=lambda f: _ident(f[0].ident)):
        lines += [f"### {program.ident}: {result['class']}", "", "```", result.get("detail", "")[:1500], "```", ""]
        if program.ident in minimized:
            text, checks = minimized[program.ident]
            lines += [f"Minimized ({checks} runs):", "", "```python", text, "```", ""]
        else:
            lines += [f"Not minimized (`python bench/fuzz.py --minimize {program.ident} --backend {args.backend}`).", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
