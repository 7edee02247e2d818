"""A CPU graph's C++ kernels: the library Rust compiles (or finds cached) from the kernel unit,
loaded with ctypes under a name used once, and each kernel declared for its call from the wrapper
module (`host_kernel`)."""

from __future__ import annotations

import _ctypes
import atexit
import ctypes
import functools
import itertools
import os
import shutil
import tempfile
import threading
import time
import weakref


from ..extension import extension
from ..options import options_json


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
