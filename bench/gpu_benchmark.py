#!/usr/bin/env python
"""Eager vs Inductor vs ferrocore on a CUDA GPU, side by side in one process.

For each graph: runtime (median of --reps CUDA-event timings per backend, the backends' samples
interleaved round by round), cold compile time (the first call after `torch._dynamo.reset()`,
with compile caches that start empty), and for the memory-bound graphs the achieved bandwidth
(the fewest bytes the graph must move: each input read once, each output written once, over
the runtime) as a fraction of the device-to-device copy bandwidth measured in the same run: over
one isolated call, over calls issued back to back (the host running ahead of the GPU, as in a
model's loop), and over the kernels' device time alone (torch.profiler); the first includes the
host's time per call (dynamo's guards, the launches), which the others hide or leave out.
Ends with one markdown table and the geometric mean of the ferrocore/inductor runtime ratios.

    python bench/gpu_benchmark.py                 # full sizes (an H100/H200)
    python bench/gpu_benchmark.py --quick         # small sizes, for smoke testing
    python bench/gpu_benchmark.py --only softmax,layer_norm --reps 50

`bash bench/gpu.sh` runs the CUDA tests and then this script in one command.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50, help="timed samples per backend (default 50)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes, for smoke testing")
    ap.add_argument("--backends", default="eager,inductor,ferrocore")
    ap.add_argument("--only", default="", help="comma-separated substrings of workload names")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", default=None, help="torch.compile mode for both compilers")
    return ap.parse_args(argv)


ARGS = None
_TMP: Path | None = None
if __name__ == "__main__":
    ARGS = parse_args()
    _TMP = Path(tempfile.mkdtemp(prefix="ferrocore-gpu-bench-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_TMP / "inductor")
    os.environ["FERROCORE_CACHE_DIR"] = str(_TMP / "ferrocore")
    os.environ.setdefault("TRITON_CACHE_DIR", str(_TMP / "triton"))

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from examples.models import BlockConfig, make_block  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "bench"))
# the CPU benchmark's graphs, shared (its caches and arguments are set up only when it is run)
from benchmark import chain10 as chain, layer_norm, softmax_last  # noqa: E402

COMPILERS = ("inductor", "ferrocore")

# ------------------------------------------------------------------------------------------------
# Graphs.


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def column_sum(x):
    return x.sum(0)


def full_sum(x):
    return x.sum()


def permute_add(x, y):
    return x.permute(1, 0) + y


def arange_scaled(n):
    return torch.arange(0, 11, device=n.device) * 1000000000 + n


class GPT(torch.nn.Module):
    """GPT-2-shaped stack of pre-norm blocks (random weights), for cold compile time."""

    def __init__(self, cfg: BlockConfig, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([make_block(cfg, seed=i) for i in range(layers)])
        self.ln = torch.nn.LayerNorm(cfg.d_model)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.ln(x)


@dataclass
class Workload:
    name: str
    fn: Callable
    make_args: Callable[[], tuple]
    bytes_moved: int = 0  # 0: not a memory-bound graph (no bandwidth column)
    rtol: float = 1e-4
    atol: float = 1e-4


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def workloads(quick: bool, dev: str) -> list[Workload]:
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=dev, dtype=dtype)

    n = (1 << 20) if quick else (1 << 26)
    sm = 1024 if quick else 8192
    rows, cols = (2048, 512) if quick else (16384, 4096)
    sq = 1024 if quick else 8192
    out: list[Workload] = []

    def add(name, fn, make, out_bytes, **kw):
        args = make()
        moved = _nbytes(*[a for a in args if isinstance(a, torch.Tensor)]) + out_bytes
        out.append(Workload(name, fn, lambda a=args: a, moved, **kw))

    add(f"pointwise chain {n >> 20}M f32", chain, lambda: (randn(n),), n * 4, rtol=1e-3, atol=1e-3)
    add(f"softmax {sm}x{sm} f32", softmax_last, lambda: (randn(sm, sm) * 3,), sm * sm * 4)
    add(f"softmax {sm}x{sm} bf16", softmax_last, lambda: ((randn(sm, sm) * 3).bfloat16(),), sm * sm * 2,
        rtol=2e-2, atol=1e-2)
    add(f"layer_norm {rows}x{cols} bf16", layer_norm,
        lambda: (randn(rows, cols, dtype=torch.bfloat16), randn(cols, dtype=torch.bfloat16),
                 randn(cols, dtype=torch.bfloat16)), rows * cols * 2, rtol=2e-2, atol=2e-2)
    add(f"rms_norm {rows}x{cols} bf16", rms_norm,
        lambda: (randn(rows, cols, dtype=torch.bfloat16), randn(cols, dtype=torch.bfloat16)),
        rows * cols * 2, rtol=2e-2, atol=2e-2)
    add(f"column sum {rows}x{cols} f32", column_sum, lambda: (randn(rows, cols),), cols * 4,
        rtol=1e-3, atol=1e-2)
    add(f"full sum {n >> 20}M f32", full_sum, lambda: (randn(n),), 4, rtol=1e-4, atol=1e-1)
    add(f"permute+add {sq}x{sq} f32", permute_add, lambda: (randn(sq, sq), randn(sq, sq)), sq * sq * 4)
    out.append(Workload("arange(0, 11) * 1e9 (int64 index math)", arange_scaled,
                        lambda: (torch.zeros(11, dtype=torch.int64, device=dev),), rtol=0, atol=0))
    cfg = BlockConfig(d_model=768, n_heads=12, seq_len=128 if quick else 1024, batch=1 if quick else 4)
    layers = 2 if quick else 12

    def gpt_args():
        return (torch.randn(cfg.batch, cfg.seq_len, cfg.d_model, device=dev),)

    model = GPT(cfg, layers).to(dev).eval()
    out.append(Workload(f"GPT-2 {layers} layers d768 s{cfg.seq_len} b{cfg.batch} f32", model,
                        (lambda a=gpt_args(): a), rtol=1e-2, atol=1e-2))
    return out


# ------------------------------------------------------------------------------------------------
# Measurement.


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable, args: tuple, dev: str) -> float:
    """One call's time: CUDA events on a GPU, the host clock after a sync elsewhere."""
    if dev.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


def copy_bandwidth(dev: str, quick: bool) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n = (1 << 24) if quick else (1 << 28)  # 1 GiB of float32
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    sync(dev)
    times = [time_ms(lambda: dst.copy_(src), (), dev) for _ in range(30)]
    return 2 * n * 4 / (statistics.median(times) * 1e-3) / 1e9


def interleaved(fns: dict, args: tuple, reps: int, warmup: int, dev: str) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(warmup):
            fn(*args)
    sync(dev)
    samples: dict[str, list] = {k: [] for k in fns}
    names = list(fns)
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(time_ms(fns[name], args, dev))
    return {k: statistics.median(v) for k, v in samples.items()}


def back_to_back(fns: dict, args: tuple, calls: int = 20, reps: int = 15) -> dict[str, float]:
    """Per-call time of `calls` consecutive calls between two CUDA events, median over `reps`
    rounds (backends interleaved): the host issues the next call while the GPU runs the last,
    so a call's host time is hidden when the kernels take longer, as in a model's loop."""
    samples: dict[str, list] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn(*args)
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / calls)
    return {k: statistics.median(v) for k, v in samples.items()}


def kernel_ms(fn: Callable, args: tuple, reps: int = 10) -> float | None:
    """Device time of one call's kernels (CUPTI durations through torch.profiler, summed over
    every kernel and copy it runs), without the host time between them: what the kernels
    themselves achieve. None where the profiler cannot tell."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn(*args)
            torch.cuda.synchronize()
        total_us = 0.0
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            total_us += t if t is not None else getattr(e, "self_cuda_time_total", 0.0)
        return total_us / reps / 1e3 if total_us > 0 else None
    except Exception:  # noqa: BLE001  (no CUPTI on this machine)
        return None


def mismatch(expected, actual, rtol, atol) -> str | None:
    exp = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    act = [t for t in pytree.tree_leaves(actual) if isinstance(t, torch.Tensor)]
    if len(exp) != len(act):
        return f"{len(act)} outputs, eager {len(exp)}"
    for i, (e, a) in enumerate(zip(exp, act)):
        if e.shape != a.shape or e.dtype != a.dtype:
            return f"output {i}: {a.dtype}{list(a.shape)}, eager {e.dtype}{list(e.shape)}"
        if not torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=True):
            return f"output {i}: max abs error {(a.double() - e.double()).abs().max().item():.2e}"
    return None


@dataclass
class Result:
    name: str
    runtime_ms: dict = field(default_factory=dict)
    cold_s: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)  # backend -> fraction of copy bandwidth
    kernel_bandwidth: dict = field(default_factory=dict)  # the same over kernel device time
    b2b_bandwidth: dict = field(default_factory=dict)  # the same over back-to-back calls
    notes: list = field(default_factory=list)


def run(w: Workload, backends: list[str], opts, copy_gbs: float) -> Result:
    res = Result(w.name)
    print(f"\n## {w.name}", flush=True)
    args = w.make_args()
    with torch.no_grad():
        expected = w.fn(*args)
        fns = {"eager": w.fn} if "eager" in backends else {}
        for backend in (b for b in COMPILERS if b in backends):
            torch._dynamo.reset()
            try:
                compiled = torch.compile(w.fn, backend=backend, mode=opts.mode, fullgraph=True, dynamic=False)
                sync(opts.device)
                start = time.perf_counter()
                out = compiled(*args)
                sync(opts.device)
                res.cold_s[backend] = time.perf_counter() - start
            except Exception as e:  # a compiler failure is a result, not the end of the run
                res.notes.append(f"{backend} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                traceback.print_exc(limit=4)
                continue
            bad = mismatch(expected, out, w.rtol, w.atol)
            if bad:
                res.notes.append(f"{backend} MISMATCH ({bad})")
            if backend == "ferrocore":
                import ferrocore

                last = ferrocore.metrics.last
                if last.get("graph_fallback"):
                    res.notes.append("ferrocore ran the graph eagerly")
                elif last.get("fallbacks"):
                    res.notes.append(f"ferrocore fallbacks {last.get('fallback_ops')}")
                res.notes.append(f"ferrocore: {last.get('kernels')} kernels, {last.get('externs')} externs")
            fns[backend] = compiled
        if fns:
            res.runtime_ms = interleaved(fns, args, opts.reps, opts.warmup, opts.device)
            # the timed calls were replays (CUDA graphs) or steady-state calls: check one again
            for k in (b for b in COMPILERS if b in fns):
                bad = mismatch(expected, fns[k](*args), w.rtol, w.atol)
                if bad:
                    res.notes.append(f"{k} MISMATCH after the timed calls ({bad})")
        if w.bytes_moved and copy_gbs > 0 and opts.device.startswith("cuda"):
            compiled = {k: fns[k] for k in COMPILERS if k in fns}
            for k, ms in back_to_back(compiled, args).items():
                res.b2b_bandwidth[k] = w.bytes_moved / (ms * 1e-3) / 1e9 / copy_gbs
            for k in (b for b in COMPILERS if b in fns):
                ms = kernel_ms(fns[k], args)
                if ms:
                    res.kernel_bandwidth[k] = w.bytes_moved / (ms * 1e-3) / 1e9 / copy_gbs
    if w.bytes_moved and copy_gbs > 0:
        for k, ms in res.runtime_ms.items():
            res.bandwidth[k] = w.bytes_moved / (ms * 1e-3) / 1e9 / copy_gbs
    print("  runtime ms: " + ", ".join(f"{k} {v:.3f}" for k, v in res.runtime_ms.items())
          + "  cold s: " + ", ".join(f"{k} {v:.2f}" for k, v in res.cold_s.items()), flush=True)
    return res


def _f(d: dict, k: str, fmt: str) -> str:
    return format(d[k], fmt) if k in d else "n/a"


def _ratio(d: dict) -> str:
    return f"{d['ferrocore'] / d['inductor']:.2f}" if "ferrocore" in d and d.get("inductor") else "n/a"


def table(results: list[Result]) -> str:
    head = ("| graph | eager ms | inductor ms | ferrocore ms | ferrocore/inductor | inductor BW | "
            "ferrocore BW | inductor b2b BW | ferrocore b2b BW | inductor kernel BW | ferrocore kernel BW | inductor cold s | "
            "ferrocore cold s | cold ratio | notes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        lines.append(
            f"| {r.name} | {_f(r.runtime_ms, 'eager', '.3f')} | {_f(r.runtime_ms, 'inductor', '.3f')} "
            f"| {_f(r.runtime_ms, 'ferrocore', '.3f')} | {_ratio(r.runtime_ms)} "
            f"| {_f(r.bandwidth, 'inductor', '.2f')} | {_f(r.bandwidth, 'ferrocore', '.2f')} "
            f"| {_f(r.b2b_bandwidth, 'inductor', '.2f')} | {_f(r.b2b_bandwidth, 'ferrocore', '.2f')} "
            f"| {_f(r.kernel_bandwidth, 'inductor', '.2f')} | {_f(r.kernel_bandwidth, 'ferrocore', '.2f')} "
            f"| {_f(r.cold_s, 'inductor', '.2f')} | {_f(r.cold_s, 'ferrocore', '.2f')} | {_ratio(r.cold_s)} "
            f"| {'; '.join(r.notes)} |"
        )
    return "\n".join(lines)


def geomean_ratio(results: list[Result], key: str) -> str:
    ratios = [getattr(r, key)["ferrocore"] / getattr(r, key)["inductor"] for r in results
              if "ferrocore" in getattr(r, key) and getattr(r, key).get("inductor")]
    if not ratios:
        return "n/a"
    return f"{math.exp(sum(math.log(x) for x in ratios) / len(ratios)):.3f} over {len(ratios)} graphs"


def main(opts) -> int:
    backends = [b.strip() for b in opts.backends.split(",") if b.strip()]
    dev = opts.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else dev
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    env = f"{name}, torch {torch.__version__}, triton {triton_version}, python {sys.version.split()[0]}"
    env += f", torch.compile mode {opts.mode or 'default'}"
    print(f"# ferrocore GPU benchmark ({'quick' if opts.quick else 'full'}): {env}")
    try:
        copy_gbs = copy_bandwidth(dev, opts.quick)
        print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
        only = [s.strip() for s in opts.only.split(",") if s.strip()]
        results = [run(w, backends, opts, copy_gbs) for w in workloads(opts.quick, dev)
                   if not only or any(o in w.name for o in only)]
    finally:
        if _TMP is not None:
            shutil.rmtree(_TMP, ignore_errors=True)
    print("\n## Results\n")
    print(f"{env}; copy bandwidth {copy_gbs:.0f} GB/s; runtime = median of {opts.reps} CUDA-event "
          "timings, interleaved; BW = fewest bytes moved / runtime, as a fraction of the copy "
          "bandwidth; b2b BW = the same over the per-call time of 20 back-to-back calls (host time "
          "hidden behind the GPU's); kernel BW = the same over the kernels' device time (torch.profiler, host "
          "gaps between launches excluded); cold = first call after dynamo reset with empty caches; ratios < 1: ferrocore "
          "is faster.\n")
    print(table(results))
    print(f"\ngeomean ferrocore/inductor runtime: {geomean_ratio(results, 'runtime_ms')}")
    print(f"geomean ferrocore/inductor cold compile: {geomean_ratio(results, 'cold_s')}")
    return 1 if any("MISMATCH" in n for r in results for n in r.notes) else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
