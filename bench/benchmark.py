#!/usr/bin/env python
"""Eager vs Inductor vs ferrocore on CPU, side by side in one process.

For each workload: runtime (median over --reps samples after warm-up, the backends' samples
interleaved round by round in rotating order so machine noise hits all of them alike), cold
compile time (the first call after `torch._dynamo.reset()`, with compile caches that start empty:
a fresh temporary TORCHINDUCTOR_CACHE_DIR and FERROCORE_CACHE_DIR are set before torch is
imported), ferrocore's compile time by stage (`ferrocore.metrics.last["timings_ms"]`), and the
ferrocore/inductor ratios. Ends with one markdown table.

    python bench/benchmark.py              # full sizes
    python bench/benchmark.py --quick      # small sizes, for smoke testing
    python bench/benchmark.py --reps 50 --backends eager,inductor
    python bench/benchmark.py --only math --threads 1,2   # every transcendental, 1 and 2 threads

Before the workloads, each compiler compiles one unrelated trivial function so that one-time
process start-up (imports, inductor's compile workers) is not charged to the first workload;
that warm-up compiles different code and cannot hit the caches.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPILERS = ("inductor", "ferrocore")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=30, help="timed samples per backend (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per backend (default 3)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for smoke testing")
    ap.add_argument(
        "--backends",
        default="eager,inductor,ferrocore",
        help="comma-separated subset of eager,inductor,ferrocore",
    )
    ap.add_argument("--only", default="", help="comma-separated workload names to run")
    ap.add_argument(
        "--min-sample-ms",
        type=float,
        default=2.0,
        help="calls are batched so one timed sample lasts at least this long",
    )
    ap.add_argument("--keep-caches", action="store_true", help="keep the temporary cache dirs")
    ap.add_argument(
        "--threads",
        default="",
        help="comma-separated thread counts: every workload compiled and timed under each "
        "(default: torch's)",
    )
    return ap.parse_args(argv)


ARGS = None
_TMP: Path | None = None
if __name__ == "__main__":
    ARGS = parse_args()
    # Fresh, empty compile caches, set before torch (and inductor's config) is imported.
    _TMP = Path(tempfile.mkdtemp(prefix="ferrocore-bench-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_TMP / "inductor")
    os.environ["FERROCORE_CACHE_DIR"] = str(_TMP / "ferrocore")

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from examples.models import (  # noqa: E402
    SMALL_CONFIG,
    BlockConfig,
    elementwise_reduction,
    make_block,
    make_block_input,
    make_elementwise_inputs,
)

# ------------------------------------------------------------------------------------------------
# Workloads.


def chain10(x):
    """Ten pointwise ops: mul add sin sub abs sqrt mul tanh add exp."""
    return ((((x * 2 + 1).sin() - 0.5).abs().sqrt() * x).tanh() + 1).exp()


def softmax_last(x):
    return torch.softmax(x, dim=-1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def mobile_block(x, dw, scale, shift, pw):
    """MobileNetV3's block core at its tiny size: 5x5 depthwise, folded batch norm, hardswish,
    1x1 to more channels (the model benchmark's gap: ~45 us per oneDNN call)."""
    y = F.conv2d(x, dw, None, 1, 2, 1, x.shape[1])
    return F.conv2d(F.hardswish(y * scale[:, None, None] + shift[:, None, None]), pw)


def full_sum(x):
    return x.sum()


def column_sum(x):
    return x.sum(0)


def row_var(x):
    return x.var(-1)


def cumsum_rows(x):
    return x.cumsum(-1)


# One fused loop per transcendental, and pairs of them over one value (g++ once merged sin(x) and
# cos(x) into a scalar sincos call: the loop stopped vectorizing, 7x Inductor's time). Inputs
# are in each function's domain.
MATH = {
    "sin": lambda x, y: torch.sin(x),
    "cos": lambda x, y: torch.cos(x),
    "tan": lambda x, y: torch.tan(x),
    "exp": lambda x, y: torch.exp(x),
    "log": lambda x, y: torch.log(y),
    "tanh": lambda x, y: torch.tanh(x),
    "erf": lambda x, y: torch.erf(x),
    "sigmoid": lambda x, y: torch.sigmoid(x),
    "pow": lambda x, y: torch.pow(y, x),
    "atan2": lambda x, y: torch.atan2(x, y - 1),
    "sin*cos": lambda x, y: torch.sin(x) * torch.cos(x),
    "sin*cos(2x)": lambda x, y: torch.sin(x) * torch.cos(2 * x),
    "exp*log": lambda x, y: torch.exp(x) * torch.log(y),
    "tanh*sigmoid": lambda x, y: torch.tanh(x) * torch.sigmoid(x),
    "erf*exp": lambda x, y: torch.erf(x) * torch.exp(-x * x),
}


def optimizer_step(opt):
    """`torch.compile(opt.step)`, the standard recipe (its state is updated in place)."""
    opt.step()


def make_optimizer(kind: str, width: int):
    """An MLP's parameters (4 layers of width x width, with LayerNorms) with gradients set, and
    optimizer `kind` over them."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    model = torch.nn.Sequential(*layers)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    make = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    }[kind]
    return (make(model.parameters()),)


def embedding_layer_norm(ids, table, pos, w, b):
    """GPT-2's first kernel at its tiny size: token + position embedding rows, LayerNorm."""
    return F.layer_norm(table[ids] + pos, (table.shape[1],), w, b)


@dataclass
class Workload:
    name: str
    fn: Callable
    make_args: Callable[[], tuple]
    rtol: float = 1e-4
    atol: float = 1e-4
    # an optimizer's step breaks its graph once (torch calls graph_break() before the update)
    fullgraph: bool = True


def workloads(quick: bool) -> list[Workload]:
    cfg = SMALL_CONFIG if quick else BlockConfig()
    n = (1 << 20) if quick else (1 << 24)
    sm = (512, 512) if quick else (4096, 4096)
    ln = (1024, 256) if quick else (8192, 1024)
    er = (256, 256) if quick else (1024, 1024)
    opt_width = 256 if quick else 1024
    gen = torch.Generator().manual_seed(0)
    return [
        Workload(
            f"transformer block d{cfg.d_model} h{cfg.n_heads} s{cfg.seq_len} b{cfg.batch}",
            make_block(cfg),
            lambda: (make_block_input(cfg),),
        ),
        Workload(
            f"elementwise+reduction {er[0]}x{er[1]}",
            elementwise_reduction,
            lambda: make_elementwise_inputs(*er),
        ),
        Workload(
            f"10-op chain {n / 2**20:g}M f32",
            chain10,
            lambda: (torch.randn(n, generator=gen),),
            # sqrt(|sin(.) - 0.5|) near 0 amplifies 1-ulp differences in sin (vectorized math
            # libraries differ from eager's): over 16M elements a few results move by ~5e-4.
            rtol=1e-3,
            atol=1e-3,
        ),
        Workload(
            f"softmax {sm[0]}x{sm[1]}", softmax_last, lambda: (torch.randn(sm, generator=gen) * 3,)
        ),
        Workload(
            f"layer_norm {ln[0]}x{ln[1]}",
            layer_norm,
            lambda: (
                torch.randn(ln, generator=gen),
                torch.randn(ln[1], generator=gen),
                torch.randn(ln[1], generator=gen),
            ),
        ),
        # long reductions and scans (their accumulation: see docs/accuracy.md)
        Workload(f"sum {n / 2**20:g}M f32", full_sum, lambda: (torch.rand(n, generator=gen),), rtol=1e-5),
        Workload(f"column sum {sm[0]}x{sm[1]}", column_sum, lambda: (torch.randn(sm, generator=gen),)),
        Workload(f"row var {sm[0]}x{sm[1]}", row_var, lambda: (torch.randn(sm, generator=gen),)),
        Workload(f"cumsum rows {sm[0]}x{sm[1]}", cumsum_rows, lambda: (torch.randn(sm, generator=gen),), rtol=1e-3, atol=1e-3),
        # the model benchmark's CPU gaps, at the tiny models' sizes in both modes
        Workload(
            "mobile block 2x24x16x16 dw5x5 + 1x1 to 72",
            mobile_block,
            lambda: (
                torch.randn(2, 24, 16, 16, generator=gen),
                torch.randn(24, 1, 5, 5, generator=gen),
                torch.rand(24, generator=gen) + 0.5,
                torch.randn(24, generator=gen),
                torch.randn(72, 24, 1, 1, generator=gen),
            ),
        ),
        *(
            Workload(f"{kind} step 4x{opt_width}x{opt_width}", optimizer_step,
                     lambda kind=kind: make_optimizer(kind, opt_width), fullgraph=False)
            for kind in ("SGD", "Adam", "AdamW")
        ),
        *(
            Workload(
                f"math {name} {n / 2**22:g}M f32",
                fn,
                lambda: (torch.randn(n // 4, generator=gen) * 2, torch.rand(n // 4, generator=gen) * 4 + 0.01),
                rtol=1e-4,
                atol=1e-5,
            )
            for name, fn in MATH.items()
        ),
        Workload(
            "embedding + layer_norm 2x64 rows of 64",
            embedding_layer_norm,
            lambda: (
                torch.randint(0, 509, (2, 64), generator=gen),
                torch.randn(509, 64, generator=gen),
                torch.randn(64, 64, generator=gen),
                torch.randn(64, generator=gen),
                torch.randn(64, generator=gen),
            ),
        ),
    ]


# ------------------------------------------------------------------------------------------------
# Measurement.


@dataclass
class Result:
    name: str
    runtime_ms: dict[str, float] = field(default_factory=dict)
    cold_s: dict[str, float] = field(default_factory=dict)
    stages_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def ferrocore_last() -> dict:
    import ferrocore

    return dict(ferrocore.metrics.last or {})


def outputs_close(expected, actual, rtol, atol) -> str | None:
    """None when the outputs match, else a short description of the first mismatch."""
    exp = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    act = [t for t in pytree.tree_leaves(actual) if isinstance(t, torch.Tensor)]
    if len(exp) != len(act):
        return f"{len(act)} outputs, eager {len(exp)}"
    for i, (e, a) in enumerate(zip(exp, act)):
        if e.shape != a.shape or e.dtype != a.dtype:
            return f"output {i}: {a.dtype}{list(a.shape)}, eager {e.dtype}{list(e.shape)}"
        if not torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
            err = (a.double() - e.double()).abs().max().item()
            return f"output {i}: max abs error {err:.2e}"
    return None


def time_interleaved(
    fns: dict[str, Callable], args: tuple, reps: int, warmup: int, min_sample_ms: float
) -> dict[str, float]:
    """Median ms per call for each function; samples interleaved in rotating order."""
    inner: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(max(warmup, 1)):
            start = time.perf_counter()
            fn(*args)
            one_ms = (time.perf_counter() - start) * 1e3
        inner[name] = max(1, int(min_sample_ms / max(one_ms, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn, n = fns[name], inner[name]
            start = time.perf_counter()
            for _ in range(n):
                fn(*args)
            samples[name].append((time.perf_counter() - start) * 1e3 / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def compile_cold(fn: Callable, args: tuple, backend: str, fullgraph: bool = True):
    """Compiles `fn` with `backend`; returns (compiled fn, output of the first call, seconds)."""
    compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=False)
    start = time.perf_counter()
    out = compiled(*args)
    return compiled, out, time.perf_counter() - start


def warm_up_compilers(compilers: list[str]) -> dict[str, float]:
    def trivial(x):
        return (x * 3.25 - 1).cos().amax(0)

    times = {}
    x = torch.randn(8, 8)
    for backend in compilers:
        torch._dynamo.reset()
        _, _, secs = compile_cold(trivial, (x,), backend)
        times[backend] = secs
    torch._dynamo.reset()
    return times


def run_workload(w: Workload, backends: list[str], opts) -> Result:
    res = Result(w.name)
    print(f"\n## {w.name}", flush=True)
    args = w.make_args()
    torch._dynamo.reset()
    expected = w.fn(*args)
    fns: dict[str, Callable] = {}
    if "eager" in backends:
        fns["eager"] = w.fn
    for backend in (b for b in COMPILERS if b in backends):
        try:
            compiled, out, secs = compile_cold(w.fn, args, backend, w.fullgraph)
        except Exception as e:  # a compiler failure is a result, not the end of the run
            res.notes.append(
                f"{backend} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            )
            print(f"  {backend}: compile FAILED", flush=True)
            traceback.print_exc(limit=3)
            continue
        res.cold_s[backend] = secs
        mismatch = outputs_close(expected, out, w.rtol, w.atol)
        if mismatch:
            res.notes.append(f"{backend} MISMATCH ({mismatch})")
        if backend == "ferrocore":
            last = ferrocore_last()
            res.stages_ms = dict(last.get("timings_ms") or {})
            if last.get("graph_fallback"):
                res.notes.append("ferrocore ran the graph eagerly")
            elif last.get("fallbacks"):
                res.notes.append(f"ferrocore ATen fallbacks: {last.get('fallback_ops')}")
            res.notes.append(
                f"ferrocore: {last.get('kernels')} kernels, {last.get('externs')} externs"
            )
        print(
            f"  {backend}: cold compile {secs:.2f} s{'  ' + mismatch if mismatch else ''}",
            flush=True,
        )
        fns[backend] = compiled
    if fns:
        res.runtime_ms = time_interleaved(fns, args, opts.reps, opts.warmup, opts.min_sample_ms)
        print(
            "  runtime ms: " + ", ".join(f"{k} {v:.3f}" for k, v in res.runtime_ms.items()),
            flush=True,
        )
    return res


# ------------------------------------------------------------------------------------------------
# Report.


STAGE_ORDER = (
    "aot",
    "trace",
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


def _ms(d: dict, key: str) -> str:
    return f"{d[key]:.3f}" if key in d else "n/a"


def _s(d: dict, key: str) -> str:
    return f"{d[key]:.2f}" if key in d else "n/a"


def _ratio(d: dict) -> str:
    if "ferrocore" in d and "inductor" in d and d["inductor"] > 0:
        return f"{d['ferrocore'] / d['inductor']:.2f}"
    return "n/a"


def markdown_table(results: list[Result]) -> str:
    head = (
        "| workload | eager ms | inductor ms | ferrocore ms | ferrocore/inductor runtime "
        "| inductor cold s | ferrocore cold s | ferrocore/inductor compile "
        "| ferrocore compile stages (ms) | notes |"
    )
    lines = [head, head_rule(head)]
    for r in results:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in ordered_stages(r.stages_ms)) or "n/a"
        lines.append(
            f"| {r.name} | {_ms(r.runtime_ms, 'eager')} | {_ms(r.runtime_ms, 'inductor')} "
            f"| {_ms(r.runtime_ms, 'ferrocore')} | {_ratio(r.runtime_ms)} "
            f"| {_s(r.cold_s, 'inductor')} | {_s(r.cold_s, 'ferrocore')} | {_ratio(r.cold_s)} "
            f"| {stages} | {'; '.join(r.notes) or ''} |"
        )
    return "\n".join(lines)


def head_rule(head: str) -> str:
    return "|" + "---|" * (head.count("|") - 1)


def environment() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cxx = subprocess.run(
            [os.environ.get("CXX", "g++"), "--version"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        cxx = "unknown"
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}, {cxx}, "
        f"python {platform.python_version()}"
    )


def main(opts) -> int:
    backends = [b.strip() for b in opts.backends.split(",") if b.strip()]
    unknown = set(backends) - {"eager", *COMPILERS}
    if unknown:
        print(f"unknown backends: {sorted(unknown)}", file=sys.stderr)
        return 2
    notes = []
    if "ferrocore" in backends:
        try:
            import ferrocore  # noqa: F401
        except ImportError as e:
            notes.append(f"ferrocore not importable ({e}); its columns are n/a")
            backends.remove("ferrocore")
    print(f"# ferrocore benchmark ({'quick' if opts.quick else 'full'}, {opts.reps} reps)")
    print(environment())
    print(f"fresh caches under {_TMP}" if _TMP else "caches: as configured by the environment")
    compilers = [b for b in COMPILERS if b in backends]
    try:
        with torch.no_grad():
            init = warm_up_compilers(compilers)
            if init:
                print(
                    "process warm-up compile (not counted): "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in init.items())
                )
            only = {s.strip() for s in opts.only.split(",") if s.strip()}
            chosen = [w for w in workloads(opts.quick) if not only or any(o in w.name for o in only)]
            threads = [int(t) for t in opts.threads.split(",") if t.strip()]
            results = []
            for t in threads or [None]:
                if t is not None:
                    # each workload compiles cold under it (Inductor bakes the count into its code)
                    torch.set_num_threads(t)
                for w in chosen:
                    results.append(run_workload(w, backends, opts))
                    if t is not None:
                        results[-1].name += f" @{t}t"
    finally:
        if _TMP is not None and not opts.keep_caches:
            shutil.rmtree(_TMP, ignore_errors=True)

    print("\n## Results\n")
    print(
        f"{environment()}; runtime = median of {opts.reps}; cold = first call after "
        "dynamo reset with empty caches; ratios < 1 mean ferrocore is faster.\n"
    )
    for n in notes:
        print(f"note: {n}\n")
    print(markdown_table(results))
    failed = any("MISMATCH" in n or "failed" in n for r in results for n in r.notes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
