"""Compiled Triton kernels as binaries: compiled in worker processes, cached on disk, and
launched through the CUDA driver without Triton's JIT.

A wrapper module's Triton kernel is compiled for its launch configuration and for 16-byte
aligned buffers. Its binary (the cubin, with what a launch needs: the kernel's name, warps,
shared memory, and the scratch parameters Triton appends) is a cache entry keyed by the
kernel's source, signature, configuration, the GPU's architecture and the versions of Triton
and ferrocore; entries are signed and verified like every cache entry, and shared by the
user's processes. A graph whose binaries are all cached loads them and launches them through
`_ferrocore.CudaKernel`: nothing of Triton runs, which is what makes a warm start cheap
(Triton's own warm path hashes its whole installation and builds a launcher per kernel).

Cold, `CompilePool`'s processes (`compile_worker`) compile the kernels side by side: Triton's
compiler holds the interpreter lock for most of its work, so threads of one process barely
overlap. The compiling process takes jobs no worker has started yet, one at a time, until a
worker is ready, and so does Triton's own path with a kernel that cannot be compiled there or
whose binary needs more than a plain launch (`precompile.precompile_triton`).
"""

from __future__ import annotations

import atexit
import base64
import functools
import hashlib
import json
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from ..extension import extension
from .cache import read_cached_json, write_cached_json
from .versions import versions

FORMAT = 2


# a compile that takes longer is given up and redone in this process
JOB_TIMEOUT_S = 600


def key(signature: dict, constexprs: dict, launch: dict, arch: int) -> str:
    """The cache key of a kernel's binary for its heuristic launch configuration (`launch`
    holds its definition's text)."""
    text = json.dumps([FORMAT, launch.get("text", ""), signature, constexprs, launch["num_warps"],
                       launch["num_stages"], arch, versions()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _entry(k: str) -> str:
    return f"kernels/{k[:2]}/{k}.json"


def load(cache_dir, k: str) -> dict | None:
    """The binary stored under `k`, or None (missing, or an entry that fails verification)."""
    data = read_cached_json(cache_dir, _entry(k))
    try:
        if data["format"] != FORMAT or data["key"] != k:
            return None
        return {**data["binary"], "cubin": base64.b64decode(data["binary"]["cubin"], validate=True)}
    except (KeyError, TypeError, ValueError):
        return None


def store(cache_dir, k: str, binary: dict) -> None:
    fields = {**binary, "cubin": base64.b64encode(binary["cubin"]).decode()}
    try:
        write_cached_json(cache_dir, _entry(k), {"format": FORMAT, "key": k, "binary": fields})
    except Exception as e:  # noqa: BLE001 - a binary that cannot be stored is compiled again next time
        print(f"[ferrocore] kernel binary {k[:16]} not stored: {type(e).__name__}: {e}", file=sys.stderr)


@functools.lru_cache(None)
def _driver():
    return extension().CudaDriver()


def load_kernel(binary: dict, device_index: int):
    """The binary loaded on the device, as a `_ferrocore.CudaKernel`."""
    return _driver().load(binary["cubin"], binary["name"], device_index, binary["num_warps"], binary["shared"],
                          binary["trailing_nulls"])


def compile_cost(src: str) -> int:
    """A guess at how long Triton takes to compile a kernel (its definition's text): its length,
    and more for each transcendental function, whose libdevice body the compile inlines and
    optimizes (a rotary embedding's sine and cosine took longer than kernels twice its length)."""
    return len(src) + 1500 * (src.count("tl.math.") + src.count("libdevice."))


def job(unit: str, entry, arch: int) -> tuple:
    """What a worker needs to compile one kernel (`artifact.triton_kernels` entry) of the Triton
    unit `unit`."""
    fn, signature, constexprs, launch = entry
    return ("compile", unit, fn.__name__, dict(signature), dict(constexprs), launch["num_warps"],
            launch["num_stages"], arch, 32)


# ---- the worker processes ---------------------------------------------------------------------


class CompilePool:
    """Processes running `python -m ferrocore.runtime.compile_worker`, fed jobs over their pipes
    by one thread each. Started in the background before AOT autograd traces, so their imports overlap
    it. A worker that dies fails its jobs (they are compiled in this process instead)."""

    def __init__(self, workers: int, arch: int | None = None):
        self.jobs: queue.Queue = queue.Queue()
        self.started = time.perf_counter()
        self.ready: dict = {}  # worker pid -> when it finished warming up (perf_counter)
        env = dict(os.environ)
        # the worker imports ferrocore and torch from where this process found them
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str))
        if arch is not None:
            env["FERROCORE_COMPILE_ARCH"] = str(arch)  # a first compile for it, while waiting
        self.processes = []
        for _ in range(workers):
            proc = subprocess.Popen([sys.executable, "-m", "ferrocore.runtime.compile_worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env, close_fds=True)
            self.processes.append(proc)
            threading.Thread(target=self._serve, args=(proc,), daemon=True, name="ferrocore-compile").start()

    def submit(self, message: tuple) -> Future:
        """The job's future; the caller may take the job back (`Future.cancel`) while no worker
        has started it, to do it itself."""
        future: Future = Future()
        self.jobs.put((message, future))
        return future

    def _serve(self, proc) -> None:
        try:  # a worker takes jobs once it has warmed up (this process does them meanwhile)
            failure = None if self._receive(proc)[0] == "ready" else f"compile worker {proc.pid} did not start"
        except Exception as e:  # noqa: BLE001
            failure = f"compile worker {proc.pid} did not start: {type(e).__name__}: {e}"
        self.ready[proc.pid] = time.perf_counter()
        while True:
            message, future = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # taken back by the caller
            # where and when it ran: the `kernel_compile` log's timeline
            future.ran = (f"worker {proc.pid}", time.perf_counter())
            if failure is not None:
                future.set_exception(RuntimeError(failure))
                continue
            try:
                data = pickle.dumps(message)
                proc.stdin.write(struct.pack("<Q", len(data)) + data)
                proc.stdin.flush()
                status, value = self._receive(proc)
            except Exception as e:  # noqa: BLE001 - a dead worker fails this job and every later one
                failure = f"compile worker {proc.pid} is gone: {type(e).__name__}: {e}"
                future.set_exception(RuntimeError(failure))
                continue
            if status == "ok":
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(value))

    @staticmethod
    def _receive(proc) -> tuple:
        head = proc.stdout.read(8)
        if len(head) < 8:
            raise EOFError(f"compile worker {proc.pid} exited ({proc.poll()})")
        return pickle.loads(proc.stdout.read(struct.unpack("<Q", head)[0]))

    def close(self) -> None:
        for proc in self.processes:
            try:
                proc.stdin.close()
            except OSError:
                pass


_pools: dict = {}  # workers -> the process's CompilePool (closed at exit)
_pools_lock = threading.Lock()  # the pool may be started early, on a thread (`start_early`)


def compile_pool(workers: int, arch: int | None = None) -> CompilePool | None:
    """The process's pool of `workers` compile processes, started at the first call (warmed up
    for GPU architecture `arch`)."""
    if workers <= 0:
        return None
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            try:
                pool = _pools[workers] = CompilePool(workers, arch)
            except OSError as e:
                print(f"[ferrocore] compile workers cannot start ({e}); compiling in this process", file=sys.stderr)
                return None
            if len(_pools) == 1:
                atexit.register(lambda: [p.close() for p in _pools.values()])
    return pool


def start_early(workers: int, arch: int) -> None:
    """Starts the pool on a thread, before any graph reaches the backend: `torch.compile` looks
    the backend up when it is called, and the workers' imports and first compile (about a
    second) then overlap Dynamo's trace instead of delaying the first graph's kernels."""
    threading.Thread(target=compile_pool, args=(workers, arch), daemon=True, name="ferrocore-pool-start").start()


def timeline_text(graph: str, timeline: list, start: float, workers: int) -> str:
    """The `kernel_compile` log of one graph's Triton compile: each kernel's start and end (seconds
    from the stage's start) and where it was compiled, then when the workers became ready."""
    lines = [f"{graph}: {len(timeline)} Triton kernels compiled in {time.perf_counter() - start:.3f} s"]
    for name, where, begin, end in sorted(timeline, key=lambda t: t[2]):
        lines.append(f"  {begin - start:7.3f} {end - start:7.3f}  {end - begin:6.3f} s  {name}  ({where})")
    pool = _pools.get(workers)
    if pool is not None:
        ready = sorted(pool.ready.values())
        lines.append(f"  workers: {len(pool.processes)} started {start - pool.started:.3f} s before the stage; "
                     f"{len(ready)} ready" + (f", from {ready[0] - start:.3f} to {ready[-1] - start:.3f} s"
                                              if ready else ""))
    return "\n".join(lines)


def result(future: Future, name: str) -> dict | None:
    """A worker's binary for kernel `name`, or None (said why) when it must be compiled here."""
    try:
        binary = future.result(timeout=JOB_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - compiled again in this process, where errors surface
        print(f"[ferrocore] {name} is compiled in this process: {e}", file=sys.stderr)
        return None
    return None if "unlaunchable" in binary else binary
