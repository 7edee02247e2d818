"""A GPU graph's Triton kernels compiled at load, before their first launch: binaries from the
cache (`kernel_binaries`), from the compile workers, or from Triton in this process, each bound
to its `TritonLaunch`; with autotuning, the fastest configuration (`autotune`)."""

from __future__ import annotations

import functools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import kernel_binaries
from . import triton_support
from .autotune import Autotuner
from .triton_launch import _warmup, cuda_arch


def precompile_triton(kernels, device, launchers: dict | None = None, autotune: bool = False,
                      cache_dir: str | None = None, unit: str | None = None, workers: int = 0,
                      on_kernel=None, timeline: list | None = None) -> dict:
    """Compiles a wrapper module's Triton kernels now, instead of one by one at their first
    launch (`artifact.triton_kernels`: kernel, signature, constexprs, launch config with the
    definition's text), and binds each binary to its `TritonLaunch` (`launchers`, by kernel
    name). A kernel that cannot be compiled here is simply compiled at its first launch, through
    Triton's JIT call.

    Binaries come from the cache (`kernel_binaries`), else from `workers` compile processes
    given the kernels' source `unit`, else from Triton in this process (several threads); the last
    two are stored for the next process. With `autotune`, each kernel's candidate
    configurations (the launch config's `candidates`, heuristic first) are compiled and timed
    on scratch buffers, and the fastest one is bound; winners are cached under
    `cache_dir/autotune`, keyed by the kernel's source, signature, buffer sizes, candidates,
    device and Triton version. Without `autotune`, a matrix-product kernel whose winner is
    cached takes it (nothing is timed). `on_kernel()` is called as each kernel is settled (a progress
    line's count). `timeline` receives (kernel, where, start, end) per kernel compiled (the
    `kernel_compile` log). Returns counts for the metrics."""
    tick = on_kernel or (lambda: None)
    timeline = timeline if timeline is not None else []
    index = device.index if device.index is not None else torch.cuda.current_device()
    launchers = launchers or {}
    stats = {"autotuned": 0, "autotune_cache_hits": 0, "kernel_binary_hits": 0, "compiled_in_workers": 0}
    arch = cuda_arch(device)

    def compile_one(entry) -> None:
        fn, signature, constexprs, launch = entry
        start = time.perf_counter()
        try:
            config = (launch["grid"], tuple(constexprs.items()), launch["num_warps"], launch["num_stages"])
            compiled = _warmup(fn, signature, device, config)
            if compiled is None:
                return
            launcher = launchers.get(getattr(fn, "__name__", None))
            binary = _store_binary(cache_dir, entry, arch, compiled) if arch is not None and cache_dir else None
            if launcher is not None and not (binary is not None and launcher.bind_binary(binary, index)):
                launcher.bind(compiled, index)
        except Exception:  # noqa: BLE001  (an older Triton without warmup, an unknown type)
            pass
        finally:
            timeline.append((getattr(fn, "__name__", "?"), "this process", start, time.perf_counter()))
            tick()

    tunable = {}
    if autotune or (cache_dir and any(_is_template(e) for e in kernels)):
        tuner = Autotuner(device, Path(cache_dir) / "autotune" if cache_dir else None)
        for e in kernels:
            launcher = launchers.get(getattr(e[0], "__name__", None))
            if launcher is None or len(e[3].get("candidates") or ()) < 2 or not (autotune or _is_template(e)):
                continue
            key, best = tuner.lookup(e)
            # outside max-autotune a matrix-product kernel takes the tile an earlier tuning
            # cached (the one its measured choice over the library was made with), never times
            if autotune or best is not None:
                tunable[id(e)] = (launcher, key, best)
    rest = [e for e in kernels if id(e) not in tunable]
    if arch is not None and cache_dir is not None and not triton_support.launch_hooks_active():
        rest = _bind_binaries(rest, launchers, index, arch, cache_dir, unit, workers, stats, compile_one, tick,
                              timeline)
    # what is timed below is compiled first, several kernels at a time, like the rest
    work = [(compile_one, e) for e in rest]
    work += [(lambda t: tuner.warm(*t), (e[0], e[1], tuple(c))) for e in kernels
             if id(e) in tunable and tunable[id(e)][2] is None for c in e[3]["candidates"]]
    if len(work) == 1:
        work[0][0](work[0][1])
    elif work:
        with ThreadPoolExecutor(max_workers=min(len(work), os.cpu_count() or 4)) as pool:
            list(pool.map(lambda w: w[0](w[1]), work))
    if tunable:
        with unset_fake_temporarily():  # compiles run under dynamo's fake mode: time real buffers
            for e in kernels:
                if id(e) not in tunable:
                    continue
                launcher, key, best = tunable[id(e)]
                hit = tuner.tune(e, launcher, key, best)
                if hit is None:
                    compile_one(e)  # nothing could be timed: the heuristic configuration
                else:
                    stats["autotuned"] += 1
                    stats["autotune_cache_hits"] += int(hit)
                    tick()
    return stats


def _is_template(entry) -> bool:
    """Whether a kernel is a matrix product (its configurations are tiles)."""
    return "BLOCK_M" in entry[2]


def _bind_binaries(entries: list, launchers: dict, index: int, arch: int, cache_dir: str, unit: str | None,
                   workers: int, stats: dict, compile_here, tick, timeline: list) -> list:
    """Binds what the binary cache holds, then what the worker processes compile, taking back
    (`compile_here`) jobs no worker has started until a worker is ready; returns the entries
    left to compile in this process."""
    left, missing = [], []
    for e in entries:
        launcher = launchers.get(getattr(e[0], "__name__", None))
        k = _binary_key(e, arch)
        if launcher is None or k is None:
            left.append(e)
            continue
        binary = kernel_binaries.load(cache_dir, k)
        if binary is not None and launcher.bind_binary(binary, index):
            stats["kernel_binary_hits"] += 1
            tick()
        else:
            missing.append((e, k, launcher))
    pool = kernel_binaries.compile_pool(workers, arch) if missing and unit is not None else None
    if pool is None:
        return left + [e for e, _, _ in missing]
    # the dearest first, so that none starts late and keeps the rest waiting for it
    missing.sort(key=lambda m: kernel_binaries.compile_cost(m[0][3].get("text", "")), reverse=True)
    futures = [(e, k, launcher, pool.submit(kernel_binaries.job(unit, e, arch))) for e, k, launcher in missing]

    def done(e, future) -> None:
        if not future.cancelled():
            where, start = getattr(future, "ran", ("a worker", math.nan))
            timeline.append((e[0].__name__, where, start, time.perf_counter()))
            tick()

    for e, *_, future in futures:
        future.add_done_callback(functools.partial(done, e))

    # Workers take jobs from the front; this process, from the back and one at a time, those no
    # worker has started, but only until a worker is ready: Triton in this process (its first
    # use here, under the interpreter lock) is several times slower than a warm worker.
    for e, _, _, future in reversed(futures):
        if pool.ready:
            break
        if future.cancel():
            compile_here(e)
    for e, k, launcher, future in futures:
        if future.cancelled():
            continue
        binary = kernel_binaries.result(future, e[0].__name__)
        if binary is not None and launcher.bind_binary(binary, index):
            kernel_binaries.store(cache_dir, k, binary)
            stats["compiled_in_workers"] += 1
        else:
            left.append(e)
    return left


def _store_binary(cache_dir: str, entry, arch: int, compiled) -> dict | None:
    """Stores the binary of a kernel Triton compiled in this process, for the next process to
    load; returns it (None when ferrocore's launcher cannot launch it)."""
    k = _binary_key(entry, arch)
    if k is None:
        return None
    binary = triton_support.describe(compiled, len(entry[1]))
    if "unlaunchable" in binary:
        return None
    kernel_binaries.store(cache_dir, k, binary)
    return binary


def _binary_key(entry, arch: int) -> str | None:
    """The binary cache's key of a kernel entry; None when ferrocore's launcher cannot take its
    arguments (it passes pointers only)."""
    _, signature, constexprs, launch = entry
    if not all(t.startswith("*") for t in signature.values()):
        return None
    return kernel_binaries.key(signature, constexprs, launch, arch)
