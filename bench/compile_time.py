"""Compile time of the model benchmark's models, Inductor against ferrocore, as a user meets it.

For each model, task and backend, three measurements, each of the first step (a forward, or a
training step: forward and backward):
- cold: a new process with empty caches (ferrocore's, Inductor's, Triton's);
- warm: another new process with the caches the cold one left;
- recompile: in the cold process, after `torch._dynamo.reset()` (caches and imports warm).

Each process first runs one eager step, so that the libraries' first-use setup (cuBLAS, cuDNN)
is not counted as compile time. Each step's time is split into Dynamo's own (its compile, less the backend call, from torch's
`compilation_time_metrics`), the backend's share (the first step's time less Dynamo's and less
a steady-state step: everything after Dynamo hands over the graph, a backward compiled at its
first call included), and for ferrocore the share's parts from `ferrocore.metrics.compile_time()`.
The bars (issue 14): cold backend share at most 1/20 of Inductor's on the CPU (1/10 on the GPU),
geometric mean over the models; a warm start at most Dynamo's time * 1.1 + 0.2 s.

    .venv/bin/python bench/compile_time.py --device cpu
    .venv/bin/python bench/compile_time.py --device cuda --tasks inference
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("inductor", "ferrocore")
# ferrocore's parts of the backend's share, in the table's order (ferrocore.metrics.compile_time)
PARTS = ("aot", "trace", "front", "stages", "cpp_compile", "triton_compile", "load", "graph_cache")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--models", default="", help="comma list (default: all of model_zoo.MODELS)")
    ap.add_argument("--tasks", default="inference,training")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--phases", default="cold,recompile,warm",
                    help="cold (a new process with empty caches), recompile (in it, after dynamo's reset), warm "
                         "(another process on the caches the cold one left); the bars' ratio needs cold alone")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--profile", default=None,
                    help="write cProfile reports of each first step (cold and warm) into this folder")
    ap.add_argument("--stderr", default=None,
                    help="write each process's stderr into this folder (with FERROCORE_LOGS=kernel_compile: "
                         "the Triton compile's timeline)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.size = opts.size or ("tiny" if opts.device == "cpu" else "full")
    opts.dtype = opts.dtype or ("float32" if opts.device == "cpu" else "bfloat16")
    return opts


# ---- one process: compile and run a model's first steps ---------------------------------------


def child(spec: dict) -> dict:
    """Runs in a fresh process: the first step (compiled), a steady step, then the recompile."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import torch
    import torch._dynamo
    from torch._dynamo.utils import compilation_time_metrics

    import model_zoo
    from models import Runner

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    dev = spec["device"]
    torch.manual_seed(0)
    case = model_zoo.build(spec["model"], spec["size"], dev, getattr(torch, spec["dtype"]))
    task, backend = spec["task"], spec["backend"]
    module = case.model if task == "inference" else case.train
    if module is None:
        return {"skipped": "no training loss"}
    module.train(task == "training")
    inputs = case.make_inputs() if task == "inference" else case.make_train_inputs()
    params = list(case.model.parameters())

    def sync():
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    # one eager step first: the libraries' first-use setup (cuBLAS and cuDNN handles, their
    # heuristics, the caching allocator's first blocks) is the model's, not the compiler's
    Runner(module, task, params, inputs, case.output).step()
    sync()

    def timed_first() -> dict:
        if backend == "ferrocore":
            import ferrocore

            ferrocore.metrics.reset()
        compilation_time_metrics.clear()
        torch._dynamo.reset()
        runner = Runner(torch.compile(module, backend=backend), task, params, inputs, case.output)
        sync()
        profiler = _profiler(spec)
        t = time.perf_counter()
        runner.step()
        sync()
        first = time.perf_counter() - t
        if profiler is not None:
            _report(profiler, spec)
        steady = []
        for _ in range(3):
            t = time.perf_counter()
            runner.step()
            sync()
            steady.append(time.perf_counter() - t)
        dynamo = sum(compilation_time_metrics.get("_compile.compile_inner", ())) \
            - sum(compilation_time_metrics.get("OutputGraph.call_user_compiler", ()))
        out = {"first_s": first, "steady_s": min(steady), "dynamo_s": dynamo,
               "backend_s": max(first - dynamo - min(steady), 0.0)}
        if backend == "ferrocore":
            import ferrocore

            out["parts_s"] = ferrocore.metrics.compile_time()
            out["stages_ms"] = dict(ferrocore.metrics.total["timings_ms"])  # each part's stages
            out["graph_cache"] = ferrocore.metrics.total.get("graph_cache", {})
        return out

    result = {"first": timed_first()}
    if spec["recompile"]:
        result["recompile"] = timed_first()
    return result


def _profiler(spec: dict):
    if not spec.get("profile"):
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _report(profiler, spec: dict) -> None:
    """The first step's hottest functions, by their own time and with their callees."""
    import io
    import pstats

    profiler.disable()
    spec["profile_done"] = spec.get("profile_done", 0) + 1  # the recompile's step is not written
    if spec["profile_done"] > 1:
        return
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats("ferrocore", 40)  # the backend's own, under Dynamo's
    name = f"{spec['model']}-{spec['task']}-{spec['backend']}-{spec['phase']}.txt"
    Path(spec["profile"]).mkdir(parents=True, exist_ok=True)
    (Path(spec["profile"]) / name).write_text(text.getvalue())


# ---- the driver -------------------------------------------------------------------------------


def run_child(spec: dict, caches: Path, stderr_dir: str | None = None) -> dict:
    env = dict(os.environ)
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("FERROCORE_CACHE_DIR", "ferrocore"),
                     ("TRITON_CACHE_DIR", "triton")):
        env[var] = str(caches / sub)
    (caches / "ferrocore").mkdir(mode=0o700, parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if stderr_dir:
        Path(stderr_dir).mkdir(parents=True, exist_ok=True)
        name = f"{spec['model']}-{spec['task']}-{spec['backend']}-{spec['phase']}.txt"
        (Path(stderr_dir) / name).write_text(r.stderr)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"failed": " | ".join(tail)[:300]}
    return json.loads(lines[-1])


def measure(opts, model: str, task: str, backend: str, root: Path) -> dict:
    caches = root / f"{model}-{task}-{backend}"
    spec = {"model": model, "task": task, "backend": backend, "device": opts.device, "size": opts.size,
            "dtype": opts.dtype, "threads": opts.threads, "recompile": "recompile" in opts.phases.split(","),
            "profile": opts.profile, "phase": "cold"}
    cold = run_child(spec, caches, opts.stderr)
    if "failed" in cold or "skipped" in cold:
        return cold
    if "warm" not in opts.phases.split(","):
        return {"cold": cold["first"], "recompile": cold.get("recompile", {}), "warm": None, "warm_failed": None}
    warm = run_child({**spec, "recompile": False, "phase": "warm"}, caches, opts.stderr)
    return {"cold": cold["first"], "recompile": cold.get("recompile", {}), "warm": warm.get("first"),
            "warm_failed": warm.get("failed")}


def geomean(xs: list) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def tables(rows: list, dev: str) -> str:
    out = [f"### Compile time, {dev} (seconds; backend = the share after Dynamo hands over the graph)", "",
           "| model | task | dynamo | inductor cold | ferrocore cold | ratio | inductor warm | ferrocore warm "
           "| warm bar | ferrocore recompile |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    ratios, warm_ok = [], []
    for r in rows:
        ind, fc = r.get("inductor", {}), r.get("ferrocore", {})
        ic, fcold = ind.get("cold", {}).get("backend_s"), fc.get("cold", {}).get("backend_s")
        dyn = fc.get("warm", {}).get("dynamo_s") if fc.get("warm") else None
        fw = fc.get("warm", {}).get("backend_s") if fc.get("warm") else None
        bar = dyn * 0.1 + 0.2 if dyn is not None else None
        ratio = ic / fcold if ic and fcold else None
        if ratio:
            ratios.append(ratio)
        if fw is not None and bar is not None:
            warm_ok.append(fw <= bar)
        notes = [f"{b}: {r[b]['failed']}" for b in r if isinstance(r[b], dict) and "failed" in r[b]]
        out.append(f"| {r['model']} | {r['task']} | {_s(fc.get('cold', {}).get('dynamo_s'))} | {_s(ic)} | {_s(fcold)} "
                   f"| {'-' if ratio is None else f'{ratio:.1f}x'} | {_s(ind.get('warm', {}).get('backend_s') if ind.get('warm') else None)} "
                   f"| {_s(fw)} | {_s(bar)} | {_s(fc.get('recompile', {}).get('backend_s'))} |"
                   + (f" {'; '.join(notes)}" if notes else ""))
    g = geomean(ratios)
    out += ["", f"Inductor's cold backend share / ferrocore's, geometric mean over {len(ratios)}: "
                f"{'-' if g is None else f'{g:.1f}x'}; warm starts within the bar: {sum(warm_ok)} of {len(warm_ok)}", ""]
    out += [f"### ferrocore's share by part, {dev} (seconds: cold / warm)", "",
            "| model | task | " + " | ".join(PARTS) + " |", "|---|---|" + "---|" * len(PARTS)]
    for r in rows:
        fc = r.get("ferrocore", {})
        cold = fc.get("cold", {}).get("parts_s", {})
        warm = (fc.get("warm") or {}).get("parts_s", {})
        cells = [f"{cold.get(p, 0):.2f} / {warm.get(p, 0):.2f}" for p in PARTS]
        out.append(f"| {r['model']} | {r['task']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.child:
        print(json.dumps(child(json.loads(opts.child))))
        return 0
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import model_zoo

    models = [m for m in opts.models.split(",") if m] or list(model_zoo.MODELS)
    backends = [b for b in opts.backends.split(",") if b]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferrocore-compile-time-") as tmp:
        for model in models:
            for task in [t for t in opts.tasks.split(",") if t]:
                row = {"model": model, "task": task}
                for backend in backends:
                    row[backend] = measure(opts, model, task, backend, Path(tmp))
                if any("skipped" in v for v in row.values() if isinstance(v, dict)):
                    continue
                rows.append(row)
                print(json.dumps(row), flush=True)
    text = tables(rows, opts.device)
    print("\n" + text)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"rows": rows, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
