"""Helpers the generated wrapper modules call; they are on the hot path, so each is one step."""

from __future__ import annotations

import _ctypes
import argparse
import atexit
import ctypes
import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from . import kernel_binaries
from . import report as compile_report
from . import triton_support
from .cache import read_cached_json, write_cached_json
from .extension import extension
from .options import options_json

# library path -> the loaded library, while anything uses it: a wrapper module's kernels are
# ctypes function pointers, each holding its library, so a library is unloaded (dlclose, by
# `weakref.finalize`) only once no module of a live graph refers to it. Graphs whose C++ is
# identical share one library.
_libraries: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_load_ids = itertools.count()
_load_lock = threading.Lock()
def load_kernels(source: str, options: str | None = None) -> ctypes.CDLL:
    """Compiles (or finds cached) the C++ translation unit `source` and loads it, under the
    options JSON of the compile that made it (its cache and compiler; the wrapper module's
    loader hands them over), else the environment's (a module run on its own)."""
    return load_kernels_reporting(source, options)[0]


def load_kernels_reporting(source: str, options: str | None = None) -> tuple:
    """(`load_kernels(source, options)`, whether the library was in the cache). Rust verifies
    the cached library against its manifest and hands over an open file of the verified bytes;
    that file is what is loaded, whatever the path names by then. The compile runs without the
    GIL."""
    path, fd, cache_hit = extension().load_cpp(source, options or options_json())
    try:
        with _load_lock:
            lib = _libraries.get(path)
            if lib is None:
                lib = _libraries[path] = _load_open_file(path, fd)
    finally:
        os.close(fd)
    return lib, cache_hit


def host_kernel(lib: ctypes.CDLL, name: str, pointers: int):
    """Kernel `name` of `lib`, declared to take `pointers` pointer arguments (called with
    `data_ptr()` ints: half the host time of building `c_void_p` objects) and to return its int
    error flag. Under FERROCORE_PROFILE_KERNELS=1 it adds its time to `kernel_clock`."""
    fn = getattr(lib, name)
    fn.argtypes = (ctypes.c_void_p,) * pointers
    fn.restype = ctypes.c_int
    if os.environ.get("FERROCORE_PROFILE_KERNELS", "") in ("", "0"):
        return fn
    return _clocked(fn, name)


# kernel name -> [nanoseconds, calls] of the kernels of modules loaded with
# FERROCORE_PROFILE_KERNELS=1 (see `host_kernel`); whoever profiles reads the entries and
# zeroes them in place (each kernel holds on to its own)
kernel_clock: dict = {}


def _clocked(fn, name: str):
    """`fn`, adding its time to `kernel_clock[name]`: a clock, not a `torch.profiler` range,
    since opening a range from Python costs more than most kernels take."""
    entry = kernel_clock.setdefault(name, [0, 0])
    clock = time.perf_counter_ns

    def call(*args):
        t = clock()
        try:
            return fn(*args)
        finally:
            entry[0] += clock() - t
            entry[1] += 1

    return call


def _load_open_file(path: str, fd: int) -> ctypes.CDLL:
    """Loads the file open as `fd` under a name used once: the dynamic loader looks a name up
    among loaded libraries before opening it, so a reused `/proc/self/fd/N` could return
    another library still loaded under it. The name is a symlink to the descriptor, beside
    the entry in the (checked, private) cache directory, removed once loaded; in a private
    directory of this process where the cache cannot be written (a read-only file system)."""
    name = f".load-{os.getpid()}-{next(_load_ids)}.so"
    link = os.path.join(os.path.dirname(path), name)
    try:
        os.symlink(f"/proc/self/fd/{fd}", link)
    except OSError:
        link = os.path.join(_private_load_dir(), name)
        os.symlink(f"/proc/self/fd/{fd}", link)
    try:
        lib = ctypes.CDLL(link)
    finally:
        os.unlink(link)
    weakref.finalize(lib, _unload, lib._handle)
    return lib


@functools.lru_cache(maxsize=None)
def _private_load_dir() -> str:
    """A directory only this process's user can write (0700, made by `mkdtemp`), removed at
    exit: where libraries of a read-only cache are loaded from."""
    path = tempfile.mkdtemp(prefix="ferrocore-load-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _unload(handle: int) -> None:
    _ctypes.dlclose(handle)


def cached_measurement(cache_dir, family: str, key: list, measure, errors=(RuntimeError,)) -> list | None:
    """The timings `measure()` returns (a list of ms) for `key`, measured once and then read from
    cache entry `family/..` (the key's JSON text is stored beside them and must match); None when
    measuring raised one of `errors`. Runs outside any fake-tensor mode (real tensors)."""
    key_text = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(key_text.encode()).hexdigest()
    entry = f"{family}/{digest[:2]}/{digest}.json"
    cached = read_cached_json(cache_dir, entry) if cache_dir else None
    if isinstance(cached, dict) and cached.get("key") == key_text and isinstance(cached.get("ms"), list):
        return cached["ms"]
    try:
        with unset_fake_temporarily():
            ms = list(measure())
    except errors:
        return None
    if cache_dir:
        write_cached_json(cache_dir, entry, {"key": key_text, "ms": ms})
    return ms


def empty_strided(size, stride, dtype, device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _empty_strided_current_cuda(size, stride, dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


# (size, stride, dtype) -> a tensor on the current CUDA device; torch's C++ entry point where it
# has one (what Inductor's wrappers call), which skips the Python argument parser
try:
    from torch._C._dynamo.guards import _empty_strided_cuda as empty_strided_cuda
except ImportError:
    empty_strided_cuda = _empty_strided_current_cuda


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def owned_storage(t: torch.Tensor, extent: int, held: dict | None = None) -> torch.Tensor:
    """`t`, or a copy of it in storage of its own: a donated input that the program overwrites
    after its last read must not be seen changing through another view of its storage (a
    forward may save two views of one buffer), and must hold `extent` elements from its data
    pointer (a padded result written over the unpadded view of a padded one). `held` (storage
    data pointer -> count) names references a CUDA-graph recording keeps to the storage of its
    own outputs, which it rewrites at each replay and never reads: they do not make it shared."""
    storage = t.untyped_storage()
    # the storage object made to ask holds a reference of its own
    refs = 2 + (held.get(storage.data_ptr(), 0) if held else 0)
    shared = _storage_use_count is None or _storage_use_count(storage._cdata) > refs
    if not shared and storage.nbytes() >= (t.storage_offset() + extent) * t.element_size():
        return t
    own = torch.empty((extent,), dtype=t.dtype, device=t.device)
    return own.as_strided(t.size(), t.stride()).copy_(t)


def _reinterpret_as_strided(t: torch.Tensor, size, stride, offset) -> torch.Tensor:
    return t.as_strided(size, stride, t.storage_offset() + offset)


# (tensor, size, stride, offset past the tensor's own) -> a view of its storage; torch's C++
# entry point where it has one (Inductor's reinterpret_tensor): a third of as_strided's host time
try:
    from torch._C._dynamo.guards import _reinterpret_tensor as reinterpret
except ImportError:
    reinterpret = _reinterpret_as_strided


def benchmark(call, args, reps: int = 100, report: str | None = None, module: dict | None = None) -> float:
    """Prints and returns the median time of `call(list(args))` in ms. With `report` (a compile
    report's path) and `module` (the compiled module's globals), also profiles `reps` runs and
    writes the time by kernel and library call into the report's runtime section."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(min(reps, 10)):
        call(list(args))  # a copy each time: a boxed call may clear its argument list
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call(list(args))
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(times)
    print(f"median {median:.4f} ms over {reps} runs")
    if report is not None:
        rows = compile_report.measure(call, args, module or {}, reps)
        compile_report.fill_runtime(report, compile_report.runtime_html(rows, median, "cuda" if cuda else "cpu"))
        print(f"runtime by kernel written into {report}")
    return median


def benchmark_main(benchmark_compiled_module) -> None:
    """A compiled module's `__main__`: `python MODULE.py [--reps N] [--report REPORT.html]`."""
    parser = argparse.ArgumentParser(description="Times the compiled graph on random inputs.")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--report", help="a compile report of this module: fill in its runtime section")
    a = parser.parse_args()
    benchmark_compiled_module(a.reps, report=a.report)


def restride(t: torch.Tensor | None, size, stride, dtype) -> torch.Tensor | None:
    """An extern call's result in the layout and dtype the kernels were compiled for.

    Copied only when ATen returned something else than the graph's metadata promised; a shape
    other than the promised one raises. A result ATen leaves undefined (None: attention's RNG
    state without dropout, ...) stays None.
    """
    if t is None:
        return None
    if t.dtype == dtype and t.stride() == stride and t.shape == size:
        return t
    if t.shape != size:
        # the kernels reading it address the promised shape: they would read outside it
        raise RuntimeError(f"ferrocore: a library call returned shape {tuple(t.shape)} where the graph's metadata "
                           f"says {tuple(size)}")
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.numel() <= 1 or all(n <= 1 or a == b for n, a, b in zip(size, t.stride(), stride)):
        # the same elements; size-1 dims take the promised strides too (a view, no copy)
        return t if t.stride() == stride else t.as_strided(size, stride, t.storage_offset())
    return torch.empty_strided(size, stride, dtype=t.dtype, device=t.device).copy_(t)


class GpuIndexCheck:
    """The index-check flag of a GPU graph's plain calls, read on the host without waiting.

    Kernels raise a sticky int32 flag on the device when a gather index is out of range (the
    load itself is clamped inside the buffer). Reading it right after the launches would make
    every call wait for the GPU; instead each call ends with an asynchronous copy of the flag
    into one of two pinned host slots and an event, and a later call reads a slot whose event
    has completed. So an out-of-range index raises IndexError at a later call of the graph, as
    eager CUDA reports its device-side assert at a later synchronization. A slot is reused only
    after its copy has been read, waiting for it if need be: the report is at most two calls late
    and the host never runs more than two calls ahead of the check."""

    __slots__ = ("device", "flag", "host", "events", "pending", "next")

    def __init__(self, device: str):
        self.device, self.flag = device, None

    def begin(self) -> torch.Tensor:
        """The device flag for this call's kernels; raises when an earlier call saw a bad index."""
        if self.flag is None:
            self.flag = torch.zeros((1,), dtype=torch.int32, device=self.device)
            self.host = torch.zeros((2,), dtype=torch.int32, device="cpu", pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
            self.pending, self.next = [False, False], 0
            return self.flag
        for slot in (0, 1):
            if self.pending[slot] and self.events[slot].query():
                self._read(slot)
        return self.flag

    def end(self) -> None:
        """Queues the copy of the flag after this call's launches (never waits for the GPU unless
        both slots still hold unread copies)."""
        slot = self.next
        if self.pending[slot]:
            self.events[slot].synchronize()
            self._read(slot)
        self.host[slot : slot + 1].copy_(self.flag, non_blocking=True)
        self.events[slot].record()
        self.pending[slot], self.next = True, 1 - slot

    def _read(self, slot: int) -> None:
        self.pending[slot] = False
        if self.host[slot].item():
            self.pending[slot] = True  # sticky: every later call reports it too
            raise IndexError("index out of range in a gather of this graph (seen by an earlier call on the GPU)")


# Triton signature types of buffer parameters -> the dtype a placeholder argument stands for.
_TRITON_POINTEE = {
    "*i1": torch.bool, "*u8": torch.uint8, "*i8": torch.int8, "*i16": torch.int16,
    "*i32": torch.int32, "*i64": torch.int64, "*fp16": torch.float16, "*bf16": torch.bfloat16,
    "*fp32": torch.float32, "*fp64": torch.float64,
}


class TritonLaunch:
    """One Triton kernel's launch from a wrapper module: `launch(*tensors)`.

    Until `precompile_triton` binds a compiled binary it is Triton's JIT call, which inspects
    every argument (types, alignment) to find the specialization on each launch. Bound, it
    launches the binary directly on the current stream: through ferrocore's CUDA launcher
    (`bind_binary`, a binary from `kernel_binaries`) or Triton's (`bind`). The binary was
    specialized for 16-byte aligned pointers, so a launch with any other address takes the JIT
    call instead."""

    __slots__ = ("fn", "grid", "constexprs", "num_warps", "num_stages", "_fast", "_direct")

    def __init__(self, fn, grid: int, constexprs: dict, num_warps: int, num_stages: int):
        self.fn, self.grid, self.constexprs = fn, grid, constexprs
        self.num_warps, self.num_stages = num_warps, num_stages
        self._fast = self._direct = None

    def __call__(self, *args) -> None:
        direct = self._direct
        if direct is not None:
            if not direct(args):  # (it checks the alignment itself)
                self._jit(args)
        elif self._fast is not None and any(a.data_ptr() % 16 for a in args):
            self._jit(args)  # the binary was specialized for 16-byte aligned pointers
        else:
            self.aligned(*args)

    def aligned(self, *args) -> None:
        """A launch whose buffers are 16-byte aligned (the wrapper allocated them itself)."""
        direct = self._direct
        if direct is not None:
            if not direct(args):
                self._jit(args)
            return
        fast = self._fast
        if fast is not None:
            try:
                fast(args)
                return
            except TypeError:  # a launcher of another calling convention: stop using it
                self._fast = None
        self._jit(args)

    def _jit(self, args) -> None:
        self.fn[(self.grid,)](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages,
                              **triton_support.triton_options())

    def bind_binary(self, binary: dict, device_index: int) -> bool:
        """Launches `binary` (`kernel_binaries`) from now on; False when it cannot be loaded, or
        when a profiler's launch hook wants Triton's own launch path."""
        if binary.get("num_warps") != self.num_warps or triton_support.launch_hooks_active():
            return False
        try:
            kernel = kernel_binaries.load_kernel(binary, device_index)
        except Exception as e:  # noqa: BLE001 - Triton's own path then launches it
            print(f"[ferrocore] {binary.get('name')}: the binary does not load ({e}); using Triton's launcher",
                  file=sys.stderr)
            return False
        launch, grid = kernel.launch, self.grid
        stream = torch._C._cuda_getCurrentRawStream
        self._direct = lambda args: launch(grid, stream(device_index), *args)
        return True

    def bind(self, compiled, device_index: int) -> None:
        if triton_support.launch_hooks_active(compiled):
            return  # a profiler hook wants Triton's own launch path
        compiled._init_handles()
        run, function = compiled.run, compiled.function
        metadata = compiled.packed_metadata
        # the launcher takes every parameter, constexprs (last in ours) included
        grid, extra = self.grid, tuple(self.constexprs.values())
        stream = torch._C._cuda_getCurrentRawStream

        def fast(args):
            run(grid, 1, 1, stream(device_index), function, metadata, None, None, None, *args, *extra)

        self._direct = None
        self._fast = fast


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
    device and Triton version. `on_kernel()` is called as each kernel is settled (a progress
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
            config = (launch["grid"], constexprs["XBLOCK"], launch["num_warps"], launch["num_stages"])
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
    if autotune:
        tuner = Autotuner(device, Path(cache_dir) / "autotune" if cache_dir else None)
        for e in kernels:
            launcher = launchers.get(getattr(e[0], "__name__", None))
            if launcher is not None and len(e[3].get("candidates") or ()) > 1:
                tunable[id(e)] = (launcher, *tuner.lookup(e))
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


def cuda_arch(device) -> int | None:
    """The GPU's architecture as Triton names its target (90 for sm_90), or None off CUDA."""
    if device.type != "cuda":
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError):
        return None
    return major * 10 + minor


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


def _warmup(fn, signature: dict, device, config):
    """Compiles `fn` for the launch configuration (grid, XBLOCK, num_warps, num_stages)."""
    grid, xblock, warps, stages = config
    with torch.cuda.device(device):
        return fn.warmup(*[_TRITON_POINTEE[t] for t in signature.values()], grid=grid,
                         num_warps=warps, num_stages=stages, XBLOCK=xblock, **triton_support.triton_options())


class Autotuner:
    """Times a kernel's candidate configurations with CUDA events on scratch buffers (zeros: any
    index a kernel computes from them is in range) and keeps the fastest, on disk."""

    def __init__(self, device, cache: Path | None, reps: int = 5, calls: int = 10, timer=None,
                 device_name: str | None = None):
        self.device, self.cache, self.reps, self.calls = device, cache, reps, calls
        self.timer = timer or self._cuda_time
        if device_name is None:
            device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        self.device_name = device_name

    def key(self, fn, signature: dict, launch: dict) -> str:
        text = json.dumps([launch.get("text") or getattr(fn, "__name__", ""), signature, launch.get("arg_numel"),
                           [list(c) for c in launch["candidates"]], self.device_name, triton_support.triton.__version__])
        return hashlib.sha256(text.encode()).hexdigest()

    def lookup(self, entry) -> tuple:
        """(the entry's cache key, the configuration cached for it or None)."""
        fn, signature, _, launch = entry
        key = self.key(fn, signature, launch)
        return key, self._cached(key, [tuple(c) for c in launch["candidates"]])

    def tune(self, entry, launcher, key: str | None = None, best=None) -> bool | None:
        """Binds the best configuration to `launcher`; True when it came from the cache, None
        when nothing could be timed (the heuristic configuration stays). `key` and `best` are
        what `lookup` gave, when the caller looked already."""
        fn, signature, constexprs, launch = entry
        candidates = [tuple(c) for c in launch["candidates"]]
        if key is None:
            key, best = self.lookup(entry)
        hit = best is not None
        compiled = {}
        if best is None:
            try:
                args = [torch.zeros(max(int(n), 1), dtype=_TRITON_POINTEE[t], device=self.device)
                        for t, n in zip(signature.values(), launch["arg_numel"])]
            except (KeyError, RuntimeError):
                return None
            timings = {}
            for c in candidates:
                trial = self._bound(fn, signature, c)
                if trial is None:
                    continue
                compiled[c] = trial
                try:
                    timings[c] = self.timer(lambda t=trial[0]: t(*args))
                except Exception as e:  # noqa: BLE001  (out of resources at this block size)
                    print(f"[ferrocore:autotune] {getattr(fn, '__name__', fn)} {c} does not run: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", file=sys.stderr)
                    continue
            if not timings:
                return None
            best = min(timings, key=timings.get)
            self._store(key, best, timings)
        trial = compiled.get(best) or self._bound(fn, signature, best)
        if trial is None:
            return None
        grid, xblock, warps, stages = best
        launcher.grid, launcher.constexprs = grid, {"XBLOCK": xblock}
        launcher.num_warps, launcher.num_stages = warps, stages
        launcher._fast = launcher._direct = None
        launcher.bind(trial[1], self._index())
        return hit

    def _index(self) -> int:
        if self.device.type != "cuda":
            return 0
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def warm(self, fn, signature: dict, config) -> None:
        """Compiles one candidate ahead of its timing (failures are reported when it is bound)."""
        try:
            _warmup(fn, signature, self.device, config)
        except Exception:  # noqa: BLE001
            pass

    def _bound(self, fn, signature: dict, config):
        """(a launch of `fn` in `config`, its compiled binary), or None where it does not compile."""
        try:
            compiled = _warmup(fn, signature, self.device, config)
        except Exception as e:  # noqa: BLE001  (e.g. out of shared memory at this block size)
            print(f"[ferrocore:autotune] {getattr(fn, '__name__', fn)} {config} does not compile: "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", file=sys.stderr)
            return None
        if compiled is None:
            return None
        grid, xblock, warps, stages = config
        launch = TritonLaunch(fn, grid, {"XBLOCK": xblock}, warps, stages)
        launch.bind(compiled, self._index())
        return launch, compiled

    def _cuda_time(self, run) -> float:
        """Median ms per launch over `reps` rounds of `calls` launches, after a warm-up."""
        run()
        torch.cuda.synchronize(self.device)
        samples = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.calls):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / self.calls)
        return statistics.median(samples)

    def _entry(self, key: str) -> str:
        """The cache entry name of `key`, relative to the cache directory (`self.cache`'s parent)."""
        return f"{self.cache.name}/{key[:2]}/{key}.json"

    def _cached(self, key: str, candidates: list):
        if self.cache is None:
            return None
        data = read_cached_json(self.cache.parent, self._entry(key))
        if data is None:
            return None
        try:
            best = tuple(data["best"])
            if data.get("key") == key and best in candidates:
                return best
        except (KeyError, TypeError):
            pass
        print(f"[ferrocore:autotune] cache entry {self._entry(key)} is unusable; tuning again", file=sys.stderr)
        return None

    def _store(self, key: str, best, timings: dict) -> None:
        if self.cache is None:
            return
        data = {"key": key, "best": list(best),
                "timings_ms": [[list(c), round(t, 6)] for c, t in sorted(timings.items(), key=lambda kv: kv[1])]}
        write_cached_json(self.cache.parent, self._entry(key), data)


class InputMismatch(RuntimeError):
    """A compiled module was called with an input unlike the one it was compiled for (its
    kernels would read out of bounds or the wrong bytes)."""


def check_input_count(args, count: int) -> None:
    if len(args) != count:
        raise InputMismatch(f"ferrocore: the compiled graph takes {count} inputs; got {len(args)}")


def _check_size_stride_grouped(tensors, sizes, strides, op_name=None) -> None:
    for t, size, stride in zip(tensors, sizes, strides, strict=True):
        if tuple(t.shape) != tuple(size) or tuple(t.stride()) != tuple(stride):
            raise AssertionError(f"expected size {size} stride {stride}, got {tuple(t.shape)} {t.stride()}")


# (tensors, sizes, strides, op name): AssertionError unless each tensor has its size and stride;
# torch's C++ check where it has one (what Inductor's wrappers call): one call for all inputs
try:
    from torch._C._dynamo.guards import assert_size_stride_grouped
except ImportError:
    assert_size_stride_grouped = _check_size_stride_grouped


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"{str(t.dtype).removeprefix('torch.')} on {t.device}, size {tuple(t.shape)}, stride {t.stride()}"


def input_mismatch(specs, inputs) -> InputMismatch:
    """The error for inputs that failed a module's check (`wrapper/checks.rs`): names the first
    input whose size, stride, dtype or device differ from what the module was compiled for.
    `specs`: the module's INPUTS, (name, size, stride, dtype, device) per input."""
    for i, ((name, size, stride, dtype, device), t) in enumerate(zip(specs, inputs)):
        if isinstance(t, torch.Tensor) and (tuple(t.shape), t.stride(), t.dtype, t.device) == (
                size, stride, dtype, torch.device(device)):
            continue
        want = f"{str(dtype).removeprefix('torch.')} on {device}, size {size}, stride {stride}"
        return InputMismatch(f"ferrocore: input {i} ({name}) of the compiled graph: expected {want}; got {_describe(t)}")
    return InputMismatch("ferrocore: the inputs differ from those the graph was compiled for")


def check_storage_view(t: torch.Tensor, size, stride, offset: int, storage_offset: int | None) -> None:
    """Raises eager's error when the as_strided view (size, stride) starting `offset` elements
    from `t`'s data lies outside `t`'s storage. `storage_offset`: the storage offset of `t` the
    view was compiled for, where the view names an absolute storage position."""
    start = t.storage_offset()
    if storage_offset is not None and start != storage_offset:
        raise InputMismatch(f"ferrocore: an input viewed by as_strided at an explicit storage offset was compiled "
                            f"for storage offset {storage_offset}; got {start}")
    start += offset
    itemsize = t.element_size()
    have = t.untyped_storage().nbytes()
    if 0 in size:
        return
    need = (start + 1 + sum((n - 1) * s for n, s in zip(size, stride))) * itemsize
    if start < 0:
        raise RuntimeError(f"Tensor: invalid storage offset {start}")
    if need > have:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {start}, and "
                           f"itemsize {itemsize} requiring a storage size of {need} are out of bounds for storage "
                           f"of size {have}")
