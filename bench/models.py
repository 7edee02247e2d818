#!/usr/bin/env python
"""Real models under eager, Inductor and ferrocore, side by side in one process.

The models are `bench/model_zoo.py`'s (Hugging Face transformers and torchvision networks built
from configs with random weights): full sizes in bfloat16 on a GPU, tiny sizes in float32 on the
CPU. For each model, task (inference, training = forward + backward of the model's loss) and
torch.compile mode (both compilers in the same mode), per backend:

- correctness: the output (inference) or the loss and every parameter's gradient (training)
  against a float64 copy of the model (a float32 copy for half-type runs on a GPU); a compiled
  result passes when its relative error (‖x - ref‖ / ‖ref‖) is at most 3x eager's own error in
  the benchmark's dtype, or under the dtype's floor (1e-4 float32, 1e-2 bfloat16). Checked at
  the first call and again after the timed calls (CUDA graph replays);
- runtime: median of --reps calls, the backends interleaved round by round (CUDA events on the
  GPU); host ms: the time until the Python call returns (the launches issued);
- compile: the first call's time (caches start empty for each model: the first task and mode
  of a model compiles cold, later ones may reuse kernels; with --cache-dir, caches an earlier
  run filled);
- peak memory (GPU): the most memory requested during one call above what was requested before
  (the allocator's `requested_bytes`: what the program asked for, not the cached blocks that
  served it, whose sizes depend on what ran earlier in the process);
- on CUDA, the GPU time per call by category (GEMM, convolution, attention, generated kernels,
  copies, other) and launches per call, from torch.profiler.

    python bench/models.py --device cuda                          # full size, bf16
    python bench/models.py --device cpu --size tiny               # float32
    python bench/models.py --device cuda --models gpt2,resnet50 --tasks inference \\
        --modes default,reduce-overhead --json out.json

Prints a markdown table per task and mode, the per-category kernel table on CUDA, and the
geometric mean of ferrocore's speedup over Inductor (Inductor's time / ferrocore's). Exits 1 when
any compiled result is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import model_zoo  # noqa: E402

COMPILERS = ("inductor", "ferrocore")
# Relative errors always allowed: for outputs and losses, and for single parameters' gradients
# (a bias gradient summed over a few positions can cancel to a small norm, where any reordering of
# the sum moves its relative error).
FLOOR = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}
GRAD_FLOOR = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
ERROR_MULTIPLIER = 3.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--models", default="", help="comma list (default: all of model_zoo.MODELS)")
    ap.add_argument("--tasks", default="inference,training")
    ap.add_argument("--modes", default="default,reduce-overhead")
    ap.add_argument("--backends", default="eager,inductor,ferrocore")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per backend (0: check correctness only)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-category kernel profile")
    ap.add_argument("--memory-breakdown", action="store_true",
                    help="record the CUDA allocator's history for one call: what is live at the peak, and where it was allocated")
    ap.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                    help="also profile the host side of CALLS calls (cProfile, every mode): where host time goes")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--report", nargs="*", default=None, metavar="JSON",
                    help="print the tables of earlier runs' --json files (several: one table set) and exit")
    ap.add_argument("--cache-dir", default=None,
                    help="compile caches to use and keep (default: fresh empty ones per model, so compiles are cold)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.size = args.size or ("full" if cuda else "tiny")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    return args


# ------------------------------------------------------------------------------------------------
# Measurement.


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def rel_error(actual: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """‖actual - ref‖ / max(‖ref‖, scale): `scale` keeps a tensor that is zero up to rounding
    (a bias followed by a normalization has no gradient) from making noise look like an error."""
    a, r = actual.detach().double(), ref.detach().double().to(actual.device)
    if a.shape != r.shape:
        return math.inf
    if not torch.isfinite(a).all():
        return math.inf
    denom = max(r.norm().item(), scale)
    diff = (a - r).norm().item()
    return diff / denom if denom > 0 else diff


@dataclass
class Check:
    """Relative errors against the reference: `worst` is the largest ratio of an error to what
    it is allowed (≤ 1 passes), `error` the output's (or loss's) own relative error."""
    error: float = math.nan
    worst: float = math.nan
    where: str = ""

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0

    def text(self) -> str:
        if math.isnan(self.worst):
            return "n/a"
        mark = "ok" if self.ok else f"WRONG ({self.where})"
        return f"{mark} {self.error:.1e}"


def compare(result: list, eager: list, ref: list, names: list, floor: float, grad_floor: float) -> Check:
    """The output (or loss) and the gradients taken together against `ref`, then each gradient
    alone, each allowed 3x eager's error or its floor."""
    chk = Check(error=rel_error(result[0], ref[0]), worst=0.0)

    def judge(name, r, e, f, fl, scale=0.0):
        allowed = max(ERROR_MULTIPLIER * rel_error(e, f, scale), fl)
        ratio = rel_error(r, f, scale) / allowed
        if ratio > chk.worst:
            chk.worst, chk.where = ratio, name

    judge(names[0], result[0], eager[0], ref[0], floor)
    grads = [(n, r, e, f) for n, r, e, f in zip(names[1:], result[1:], eager[1:], ref[1:])]
    for name, r, e, f in grads:
        if (r is None) != (f is None):
            chk.worst, chk.where = math.inf, f"{name} missing"
    present = [(n, r, e, f) for n, r, e, f in grads if r is not None and f is not None and e is not None]
    if present:
        flat = [torch.cat([x.detach().double().flatten().to(present[0][3].device) for x in xs])
                for xs in zip(*[(r, e, f) for _, r, e, f in present])]
        judge("all gradients", flat[0], flat[1], flat[2], floor)
        # a parameter's gradient is measured against at least 1e-3 of the mean parameter's share
        scale = 1e-3 * flat[2].norm().item() / math.sqrt(len(present))
        for name, r, e, f in present:
            judge(name, r, e, f, grad_floor, scale)
    return chk


class Runner:
    """One model's task under one backend: `step()` runs it once and returns what is compared."""

    def __init__(self, fn, task: str, params: list, inputs: tuple, output):
        self.fn, self.task, self.params, self.inputs, self.output = fn, task, params, inputs, output

    def step(self):
        if self.task == "inference":
            with torch.no_grad():
                return self.output(self.fn(*self.inputs))
        for p in self.params:
            p.grad = None
        loss = self.fn(*self.inputs)
        loss.backward()
        return loss

    def results(self) -> list:
        """What a step produced: the output, or the loss and every gradient."""
        out = self.step()
        if self.task == "inference":
            return [out.detach().clone()]
        return [out.detach().clone()] + [None if p.grad is None else p.grad.detach().clone() for p in self.params]


def time_call(fn, dev: str) -> tuple[float, float]:
    """(device ms, host ms) of one call: CUDA events around it on a GPU (the host clock after a
    sync elsewhere); host ms is when the Python call returned."""
    if dev.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        fn()
        host = (time.perf_counter() - t) * 1e3
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host
    t = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t) * 1e3
    return ms, ms


def interleaved(runners: dict, reps: int, warmup: int, dev: str) -> dict:
    for r in runners.values():
        for _ in range(warmup):
            r.step()
    sync(dev)
    samples: dict = {k: ([], []) for k in runners}
    names = list(runners)
    for i in range(reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            ms, host = time_call(runners[name].step, dev)
            samples[name][0].append(ms)
            samples[name][1].append(host)
    return {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in samples.items()}


def peak_mb(runner: Runner, dev: str) -> float | None:
    if not dev.startswith("cuda"):
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    runner.step()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats()["requested_bytes.all.peak"] - base) / 2**20


CATEGORIES = ("gemm", "conv", "attention", "generated", "copies", "other")


def category(kernel: str) -> str:
    k = kernel.lower()
    if any(s in k for s in ("flash", "fmha", "attention", "attn", "sdpa")):
        return "attention"
    if any(s in k for s in ("conv", "fprop", "dgrad", "wgrad", "implicit", "winograd", "nchwtonhwc",
                            "nhwctonchw", "depthwise", "cudnn")):
        return "conv"
    if any(s in k for s in ("gemm", "cublas", "cutlass", "xmma", "nvjet", "gemv", "splitkreduce", "matmul")):
        return "gemm"
    if k.startswith("triton"):
        return "generated"
    if any(s in k for s in ("copy", "memcpy", "memset", "catarray", "fill")):
        return "copies"
    return "other"


def profile(runner: Runner, calls: int = 3) -> dict | None:
    """GPU time per call by category (ms) and launches per call, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    try:
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                runner.step()
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (no CUPTI)
        print(f"  profile failed: {e}", flush=True)
        return None
    ms = {c: 0.0 for c in CATEGORIES}
    launches = 0
    top: dict = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        c = category(e.name)
        ms[c] += us / 1e3 / calls
        launches += 1
        top[e.name] = top.get(e.name, 0.0) + us / 1e3 / calls
    out = {"ms": ms, "kernel_ms": sum(ms.values()), "launches": launches / calls}
    out["top"] = sorted(((round(v, 4), category(k), k[:90]) for k, v in top.items()), reverse=True)[:80]
    return out


CPU_CATEGORIES = ("kernels", "library", "host")


def cpu_profile(make_runner, backend: str, wall_ms: float, calls: int = 10) -> dict | None:
    """CPU time per call by category (ms): generated kernels, library calls (ATen ops the
    compiled code or eager calls, outermost only) and the host (the rest of the timed call:
    Python, Dynamo's guards, allocation). The kernels need a compile that times them
    (ferrocore: FERROCORE_PROFILE_KERNELS; Inductor: `cpp.enable_kernel_profile`, ranges for
    the profiler), so the model is compiled again for this; its code is otherwise the timed one."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    saved_env = os.environ.get("FERROCORE_PROFILE_KERNELS")
    patch = contextlib.nullcontext()
    if backend == "ferrocore":
        os.environ["FERROCORE_PROFILE_KERNELS"] = "1"
    elif backend == "inductor":
        import torch._inductor.config as inductor_config

        patch = inductor_config.patch({"cpp.enable_kernel_profile": True})
    try:
        with patch:
            torch._dynamo.reset()
            runner = make_runner()
            for _ in range(3):
                runner.step()
            clock = None
            if backend == "ferrocore":
                from ferrocore.runtime.cpp_library import kernel_clock as clock

                for entry in clock.values():  # zeroed in place: each kernel holds its entry
                    entry[:] = [0, 0]
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    runner.step()
            # ferrocore's kernels time themselves (see ferrocore.runtime.cpp_library.host_kernel)
            clocked = {k: v for k, v in (clock or {}).items() if v[1]}
    except Exception as e:  # noqa: BLE001
        print(f"  CPU profile failed: {e}", flush=True)
        return None
    finally:
        if saved_env is None:
            os.environ.pop("FERROCORE_PROFILE_KERNELS", None)
        else:
            os.environ["FERROCORE_PROFILE_KERNELS"] = saved_env
        torch._dynamo.reset()
    ms = {c: 0.0 for c in CPU_CATEGORIES}
    top: dict = {}
    launches = 0
    for e in prof.events():
        kind = _cpu_kind(e.name)
        if kind is None or any(_cpu_kind(a.name) for a in _ancestors(e)):
            continue
        t = e.cpu_time_total / 1e3 / calls
        ms[kind] += t
        launches += kind == "kernels"
        top[e.name] = top.get(e.name, 0.0) + t
    for name, (ns, n) in clocked.items():
        t = ns / 1e6 / calls
        ms["kernels"] += t
        launches += n
        top[name] = top.get(name, 0.0) + t
    kinds = {name: "kernels" for name in clocked}
    ms["host"] = max(wall_ms - ms["kernels"] - ms["library"], 0.0)
    out = {"ms": ms, "kernel_ms": ms["kernels"], "launches": launches / calls}
    out["top"] = sorted(((round(v, 4), kinds.get(k) or _cpu_kind(k), k[:90]) for k, v in top.items()), reverse=True)[:80]
    return out


def _cpu_kind(name: str) -> str | None:
    if "cpp_fused" in name:
        return "kernels"
    if name.startswith("aten::"):
        return "library"
    return None


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def live_at_peak(step) -> tuple[int, list, dict | None]:
    """Runs `step` once with the CUDA allocator's history recorded: the peak of the bytes
    allocated during it, the allocation events live at that peak, and the event that reached it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, peak, now, at_peak, peak_ev = {}, 0, 0, {}, None
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            now += ev["size"]
            if now > peak:
                peak, at_peak, peak_ev = now, dict(live), ev
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            now -= live.pop(ev["addr"])["size"]
    return peak, list(at_peak.values()), peak_ev


def allocated_at(ev) -> str:
    """The innermost Python frame outside torch that made an allocation: 'file:line(function)'."""
    frames = [f for f in ev.get("frames", []) if f.get("filename", "").endswith(".py")]
    f = next((f for f in frames if "/torch/" not in f["filename"]), frames[0] if frames else None)
    return f"{Path(f['filename']).name}:{f['line']}({f['name']})" if f else "?"


def memory_breakdown(runner: Runner, top: int = 12) -> list:
    """The largest blocks live at the peak of one call (allocated during it), each with the
    innermost Python frame that allocated it: (MB, 'file:line(function)')."""
    peak, blocks, _ = live_at_peak(runner.step)
    rows = sorted(blocks, key=lambda e: -e["size"])[:top]
    return [(round(peak / 2**20, 1), "peak")] + [(round(e["size"] / 2**20, 1), allocated_at(e)) for e in rows]


def host_profile(runner: Runner, calls: int, dev: str) -> list:
    """The functions the host spends most of a call in (cProfile's own time, ms per call; the
    profiler's overhead inflates Python functions, so read it for the ranking)."""
    import cProfile
    import pstats

    sync(dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        runner.step()
    prof.disable()
    sync(dev)
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]
    return [(round(tt / calls * 1e3, 4), round(nc / calls, 1), f"{Path(f).name}:{line}({fn})")
            for (f, line, fn), (_, nc, tt, _, _) in rows]


# ------------------------------------------------------------------------------------------------
# One model.


@dataclass
class Row:
    model: str
    task: str
    mode: str
    runtime_ms: dict = field(default_factory=dict)
    host_ms: dict = field(default_factory=dict)
    compile_s: dict = field(default_factory=dict)
    peak_mb: dict = field(default_factory=dict)
    check: dict = field(default_factory=dict)  # backend -> Check
    profile: dict = field(default_factory=dict)
    host_profile: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)  # backend -> [(MB, where allocated)], the peak first  # backend -> [(ms per call, calls per call, function)]
    ferrocore: dict = field(default_factory=dict)  # metrics of this task and mode
    notes: list = field(default_factory=list)

    def wrong(self) -> list:
        return [k for k, c in self.check.items() if not c.ok]

    def device_like(self) -> bool:
        """Whether host time differs from runtime (measured on a GPU)."""
        return any(abs(self.host_ms[k] - self.runtime_ms.get(k, 0)) > 1e-9 for k in self.host_ms)


def reference(case, task: str, inputs: tuple, dev: str, dtype) -> list:
    """The task's results from a copy of the model in float64 for a float32 run (a float32 copy
    would share eager's rounding exactly, leaving no error to compare with), else in float32 (no
    TF32; also for models with a float32-only kernel, such as a grouped GEMM)."""
    if dtype == torch.float32 or not dev.startswith("cuda"):
        try:
            return _reference(case, task, inputs, torch.float64)
        except RuntimeError:
            pass
    return _reference(case, task, inputs, torch.float32)


def _reference(case, task: str, inputs: tuple, ref_dtype) -> list:
    module = case.model if task == "inference" else case.train
    model = copy.deepcopy(module).to(ref_dtype)
    cast = tuple(t.to(ref_dtype) if t.is_floating_point() else t for t in inputs)
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    cudnn = torch.backends.cudnn
    # through the context manager: torch's test utilities forbid setting cuDNN flags directly
    no_tf32 = cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                          allow_tf32=False)
    try:
        with no_tf32:
            if task == "training":
                model.train()
            runner = Runner(model, task, list(model.parameters()), cast, case.output)
            return runner.results()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        del model


def compile_backend(module, backend: str, mode: str):
    kwargs = {} if mode == "default" else {"mode": mode}
    return torch.compile(module, backend=backend, **kwargs)


def run_config(case, name: str, task: str, mode: str, opts, ref: list, inputs: tuple) -> Row:
    row = Row(name, task, mode)
    module = case.model if task == "inference" else case.train
    module.train(task == "training")
    params = list(case.model.parameters())
    names = ["output"] if task == "inference" else ["loss"] + [n for n, _ in case.model.named_parameters()]
    floor, grad_floor = FLOOR.get(opts.dtype, 1e-4), GRAD_FLOOR.get(opts.dtype, 1e-3)
    eager = Runner(module, task, params, inputs, case.output)
    eager_results = eager.results()
    row.check["eager"] = compare(eager_results, eager_results, ref, names, math.inf, math.inf)
    row.check["eager"].worst = 0.0
    # eager has no modes: timed once, in the default one
    runners = {"eager": eager} if "eager" in opts.backends and mode == "default" else {}
    torch._dynamo.reset()
    for backend in (b for b in COMPILERS if b in opts.backends):
        if backend == "ferrocore":
            import ferrocore

            ferrocore.metrics.reset()
        try:
            runner = Runner(compile_backend(module, backend, mode), task, params, inputs, case.output)
            sync(opts.device)
            t = time.perf_counter()
            first = runner.results()
            sync(opts.device)
            row.compile_s[backend] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001  (a compiler's failure is a result)
            row.notes.append(f"{backend} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            row.check[backend] = Check(worst=math.inf, where="failed")
            traceback.print_exc(limit=6)
            continue
        row.check[backend] = compare(first, eager_results, ref, names, floor, grad_floor)
        runners[backend] = runner
        if backend == "ferrocore":
            import ferrocore

            t = ferrocore.metrics.total
            row.ferrocore = {k: t.get(k) for k in ("graphs", "kernels", "externs", "fallbacks", "graph_fallbacks",
                                                     "fallback_ops", "extern_ops", "cudagraph_recordings", "cudagraph_replays",
                                                     "cudagraph_plain_calls", "cudagraph_capture_failures")
                             if t.get(k) is not None}
    if not runners or opts.reps <= 0:
        return row
    try:
        timed = interleaved(runners, opts.reps, opts.warmup, opts.device)
        if "ferrocore" in runners:
            # CUDA graph events up to the end of the timed calls: did they replay?
            import ferrocore

            t = ferrocore.metrics.total
            row.ferrocore.update({k: v for k, v in t.items() if k.startswith("cudagraph_")})
        row.runtime_ms = {k: v[0] for k, v in timed.items()}
        row.host_ms = {k: v[1] for k, v in timed.items()}
        # the timed calls were replays (CUDA graphs) or steady-state calls: check one again
        for k in (b for b in COMPILERS if b in runners):
            again = compare(runners[k].results(), eager_results, ref, names, floor, grad_floor)
            if not again.ok:
                row.notes.append(f"{k} wrong after the timed calls ({again.where}: {again.worst:.1f}x allowed)")
                row.check[k] = again
        for k, r in runners.items():
            mb = peak_mb(r, opts.device)
            if mb is not None:
                row.peak_mb[k] = mb
            if opts.device.startswith("cuda") and not opts.no_profile:
                p = profile(r)
                if p is not None:
                    row.profile[k] = p
            elif not opts.no_profile:
                make = (lambda b=k: Runner(module if b == "eager" else compile_backend(module, b, mode), task,
                                           params, inputs, case.output))
                p = cpu_profile(make, k, row.runtime_ms[k])
                if p is not None:
                    row.profile[k] = p
            if opts.memory_breakdown and opts.device.startswith("cuda") and mode == "default":
                row.memory[k] = memory_breakdown(r)
            if opts.host_profile and k != "eager":
                row.host_profile[k] = host_profile(r, opts.host_profile, opts.device)
    except Exception as e:  # noqa: BLE001
        row.notes.append(f"measurement FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        traceback.print_exc(limit=6)
    if row.ferrocore.get("fallbacks") or row.ferrocore.get("graph_fallbacks"):
        row.notes.append(f"ferrocore fallbacks: {row.ferrocore.get('fallback_ops')} "
                         f"graphs run eagerly: {row.ferrocore.get('graph_fallbacks')}")
    return row


def fresh_caches(root: Path, name: str | None) -> None:
    """Compile caches under `root`: empty ones per model (its first compile is cold), or with
    `name` None the shared ones a warm-up run filled."""
    d = root / name if name else root
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("FERROCORE_CACHE_DIR", "ferrocore"),
                     ("TRITON_CACHE_DIR", "triton")):
        os.environ[var] = str(d / sub)
    try:
        from torch._inductor import codecache

        codecache.FxGraphCache.clear() if hasattr(codecache.FxGraphCache, "clear") else None
    except Exception:  # noqa: BLE001
        pass


def run_model(name: str, opts, cache_root: Path) -> list:
    rows = []
    print(f"\n## {name}", flush=True)
    fresh_caches(cache_root, None if opts.cache_dir else name)
    try:
        case = model_zoo.build(name, opts.size, opts.device, opts.dtype)
    except model_zoo.MissingDependency as e:
        print(f"  skipped: {e}")
        return rows
    for task in opts.tasks:
        if task == "training" and case.train is None:
            continue
        inputs = case.make_inputs() if task == "inference" else case.make_train_inputs()
        try:
            ref = reference(case, task, inputs, opts.device, opts.dtype)
        except Exception as e:  # noqa: BLE001
            print(f"  reference failed: {e}")
            traceback.print_exc(limit=4)
            continue
        for mode in opts.modes:
            row = run_config(case, name, task, mode, opts, ref, inputs)
            rows.append(row)
            print("  " + summary_line(row), flush=True)
            torch._dynamo.reset()
            gc.collect()
            if opts.device.startswith("cuda"):
                torch.cuda.empty_cache()
        del ref
    del case
    gc.collect()
    if opts.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# Tables.


def speedup(row: Row) -> float | None:
    r = row.runtime_ms
    if "inductor" in r and "ferrocore" in r and r["ferrocore"] > 0 and "ferrocore" not in row.wrong():
        return r["inductor"] / r["ferrocore"]
    return None


def summary_line(row: Row) -> str:
    parts = [f"{row.task}/{row.mode}:"]
    for k, ms in row.runtime_ms.items():
        parts.append(f"{k} {ms:.3f} ms")
    s = speedup(row)
    if s is not None:
        parts.append(f"speedup {s:.2f}")
    parts.append("checks " + ", ".join(f"{k} {c.text()}" for k, c in row.check.items()))
    if row.compile_s:
        parts.append("compile " + ", ".join(f"{k} {v:.1f}s" for k, v in row.compile_s.items()))
    if row.peak_mb:
        parts.append("peak MB " + ", ".join(f"{k} {v:.0f}" for k, v in row.peak_mb.items()))
    if row.host_ms and row.device_like():
        parts.append("host ms " + ", ".join(f"{k} {v:.2f}" for k, v in row.host_ms.items()))
    if row.profile:
        parts.append("kernel ms / launches " + ", ".join(f"{k} {p['kernel_ms']:.2f}/{p['launches']:.0f}"
                                                         for k, p in row.profile.items()))
    return " ".join(parts) + ("" if not row.notes else "  NOTES: " + "; ".join(row.notes))


def _f(d: dict, k: str, fmt: str) -> str:
    return format(d[k], fmt) if d.get(k) is not None else "n/a"


def geomean(xs: list) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def table(rows: list, dev: str) -> str:
    head = ("| model | eager ms | inductor ms | ferrocore ms | speedup vs inductor | inductor host ms | "
            "ferrocore host ms | inductor check | ferrocore check | inductor compile s | ferrocore compile s |")
    if dev.startswith("cuda"):
        head += " eager MB | inductor MB | ferrocore MB |"
    head += " ferrocore kernels / externs / fallbacks | notes |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        fc = r.ferrocore
        cells = [r.model, _f(r.runtime_ms, "eager", ".3f"), _f(r.runtime_ms, "inductor", ".3f"),
                 _f(r.runtime_ms, "ferrocore", ".3f"), f"{speedup(r):.2f}" if speedup(r) else "n/a",
                 _f(r.host_ms, "inductor", ".3f"), _f(r.host_ms, "ferrocore", ".3f"),
                 r.check["inductor"].text() if "inductor" in r.check else "n/a",
                 r.check["ferrocore"].text() if "ferrocore" in r.check else "n/a",
                 _f(r.compile_s, "inductor", ".1f"), _f(r.compile_s, "ferrocore", ".1f")]
        if dev.startswith("cuda"):
            cells += [_f(r.peak_mb, "eager", ".0f"), _f(r.peak_mb, "inductor", ".0f"), _f(r.peak_mb, "ferrocore", ".0f")]
        cells.append(f"{fc.get('kernels', 'n/a')} / {fc.get('externs', 'n/a')} / "
                     f"{(fc.get('fallbacks') or 0) + (fc.get('graph_fallbacks') or 0)}" if fc else "n/a")
        cells.append("; ".join(r.notes).replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_table(rows: list, dev: str) -> str:
    cats = CATEGORIES if dev.startswith("cuda") else CPU_CATEGORIES
    head = "| model | backend | wall ms | kernel ms | " + " | ".join(cats) + " | launches |"
    if not dev.startswith("cuda"):
        head = "| model | backend | wall ms | " + " ms | ".join(cats) + " ms | kernel calls |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for k, p in r.profile.items():
            cells = [r.model, k, _f(r.runtime_ms, k, ".3f")]
            if dev.startswith("cuda"):
                cells.append(f"{p['kernel_ms']:.3f}")
            cells += [f"{p['ms'][c]:.3f}" for c in cats]
            cells.append(f"{p['launches']:.0f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(rows: list) -> str:
    lines = ["| model | backend | MB | allocated at |", "|---|---|---|---|"]
    for r in rows:
        for k, blocks in r.memory.items():
            lines += [f"| {r.model} | {k} | {mb:.1f} | `{w}` |" for mb, w in blocks]
    return "\n".join(lines)


def host_table(rows: list) -> str:
    lines = ["| model | backend | host ms per call (cProfile's own time) | calls | function |", "|---|---|---|---|---|"]
    for r in rows:
        for k, top in r.host_profile.items():
            for ms, calls, fn in top:
                lines.append(f"| {r.model} | {k} | {ms:.3f} | {calls:g} | `{fn}` |")
    return "\n".join(lines)


def report(rows: list, opts, env: str) -> str:
    out = []
    for task in opts.tasks:
        for mode in opts.modes:
            sel = [r for r in rows if r.task == task and r.mode == mode]
            if not sel:
                continue
            out.append(f"\n### {task}, mode {mode}: {env}\n")
            out.append(table(sel, opts.device))
            ups = [speedup(r) for r in sel]
            g = geomean(ups)
            if g is not None:
                low = min((u, r.model) for u, r in zip(ups, sel) if u)
                out.append(f"\ngeomean ferrocore speedup over inductor: {g:.3f} over {sum(1 for u in ups if u)} models; "
                           f"lowest {low[0]:.2f} ({low[1]})")
            if any(r.profile for r in sel):
                if opts.device.startswith("cuda"):
                    out.append(f"\nGPU time per call by category (ms, torch.profiler), {task}, mode {mode}:\n")
                else:
                    out.append(f"\nCPU time per call by category (ms; kernels and library calls from torch.profiler, "
                               f"host the rest of the median call), {task}, mode {mode}:\n")
                out.append(kernel_table(sel, opts.device))
            if any(r.memory for r in sel):
                out.append(f"\nLive at the peak of one call, {task}, mode {mode} (largest blocks allocated during the call):\n")
                out.append(memory_table(sel))
            if any(r.host_profile for r in sel):
                out.append(f"\nHost time by function, {task}, mode {mode}:\n")
                out.append(host_table(sel))
    return "\n".join(out)


def environment(opts) -> str:
    if opts.device.startswith("cuda"):
        dev = torch.cuda.get_device_name()
    else:
        import platform

        dev = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = "none"
    return (f"{dev}, torch {torch.__version__}, triton {tv}, transformers {hf}, {opts.size} size, "
            f"{str(opts.dtype).replace('torch.', '')}; runtime = median of {opts.reps}, interleaved")


def load_rows(paths: list) -> tuple:
    """Rows and environment line of earlier runs' --json files."""
    rows, env = [], ""
    for path in paths:
        data = json.loads(Path(path).read_text())
        env = data.get("env", env)
        for r in data["rows"]:
            checks = {k: Check(**c) for k, c in r.pop("check").items()}
            rows.append(Row(**r, check=checks))
    return rows, env


def main(argv=None) -> int:
    opts = parse_args(argv)
    opts.tasks = [t for t in opts.tasks.split(",") if t]
    opts.modes = [m for m in opts.modes.split(",") if m]
    opts.backends = [b for b in opts.backends.split(",") if b]
    if opts.report is not None:
        rows, env = load_rows(opts.report)
        opts.device = "cuda" if "cuda" in env or any(r.profile for r in rows) else opts.device
        print(report(rows, opts, env + " (from " + ", ".join(Path(p).name for p in opts.report) + ")"))
        return 1 if any(r.wrong() for r in rows) else 0
    names = [m for m in opts.models.split(",") if m] or list(model_zoo.MODELS)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    else:
        torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    env = environment(opts)
    print(f"# model benchmark: {env}", flush=True)
    cache_root = Path(opts.cache_dir) if opts.cache_dir else Path(tempfile.mkdtemp(prefix="ferrocore-models-"))
    rows = []
    try:
        for name in names:
            rows += run_model(name, opts, cache_root)
            if opts.json:  # after every model: a run stopped by a time limit keeps what it measured
                write_json(opts.json, rows, env)
    finally:
        if not opts.cache_dir:
            shutil.rmtree(cache_root, ignore_errors=True)
    text = report(rows, opts, env)
    print(text)
    if opts.json:
        write_json(opts.json, rows, env)
    return 1 if any(r.wrong() for r in rows) else 0


def write_json(path: str, rows: list, env: str) -> None:
    data = [dict(asdict(r), check={k: asdict(c) for k, c in r.check.items()}) for r in rows]
    Path(path).write_text(json.dumps({"env": env, "rows": data}, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
