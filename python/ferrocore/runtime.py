"""Helpers the generated wrapper modules call; they are on the hot path, so each is one step."""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .options import options_json

_libraries: dict = {}
# Options of the compile that is importing a wrapper module, so its kernels are looked up in the
# same cache with the same compiler; None outside the backend (e.g. running output_code.py).
_compile_options: str | None = None


@contextlib.contextmanager
def compile_options(options: str):
    global _compile_options
    saved, _compile_options = _compile_options, options
    try:
        yield
    finally:
        _compile_options = saved


def load_kernels(source: str) -> ctypes.CDLL:
    """Compiles (or finds cached) the C++ translation unit `source` and loads it."""
    from . import _ferrocore

    path = _ferrocore.compile_cpp(source, _compile_options or options_json())
    lib = _libraries.get(path)
    if lib is None:
        lib = _libraries[path] = ctypes.CDLL(path)
    return lib


def c_ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def empty_strided(size, stride, dtype, device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def reinterpret_tensor(t: torch.Tensor, size, stride, offset) -> torch.Tensor:
    return t.as_strided(size, stride, offset)


def benchmark(call, args, reps: int = 100) -> float:
    """Prints and returns the median time of `call(list(args))` in ms."""
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
    return median


def restride(t: torch.Tensor, size, stride, dtype) -> torch.Tensor:
    """An extern call's result in the layout and dtype the kernels were compiled for.

    Copied only when ATen returned something else than the graph's metadata promised.
    """
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.numel() <= 1 or all(n <= 1 or a == b for n, a, b in zip(size, t.stride(), stride)):
        return t
    return torch.empty_strided(size, stride, dtype=t.dtype, device=t.device).copy_(t)


# Triton signature types of buffer parameters -> the dtype a placeholder argument stands for.
_TRITON_POINTEE = {
    "*i1": torch.bool, "*u8": torch.uint8, "*i8": torch.int8, "*i16": torch.int16,
    "*i32": torch.int32, "*i64": torch.int64, "*fp16": torch.float16, "*bf16": torch.bfloat16,
    "*fp32": torch.float32, "*fp64": torch.float64,
}


class TritonLaunch:
    """One Triton kernel's launch from a wrapper module: `launch(*tensors)`.

    Until `precompile_triton` binds the compiled binary it is Triton's JIT call, which inspects
    every argument (types, alignment) to find the specialization on each launch. Bound, it calls
    the binary's launcher directly on the current stream: the binary was specialized for 16-byte
    aligned pointers, so a launch with any other address takes the JIT call instead."""

    __slots__ = ("fn", "grid", "constexprs", "num_warps", "num_stages", "_fast")

    def __init__(self, fn, grid: int, constexprs: dict, num_warps: int, num_stages: int):
        self.fn, self.grid, self.constexprs = fn, grid, constexprs
        self.num_warps, self.num_stages = num_warps, num_stages
        self._fast = None

    def __call__(self, *args) -> None:
        fast = self._fast
        if fast is not None:
            for a in args:
                if a.data_ptr() % 16:
                    break
            else:
                try:
                    fast(args)
                    return
                except TypeError:  # a launcher of another calling convention: stop using it
                    self._fast = None
        self.fn[(self.grid,)](*args, **self.constexprs, num_warps=self.num_warps,
                              num_stages=self.num_stages)

    def bind(self, compiled, device_index: int) -> None:
        try:
            from triton import knobs

            hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
        except ImportError:
            hooks = (getattr(type(compiled), "launch_enter_hook", None),
                     getattr(type(compiled), "launch_exit_hook", None))
        # (newer Triton keeps a chain of hooks, often empty)
        if any(h is not None and getattr(h, "calls", True) for h in hooks):
            return  # a profiler hook wants Triton's own launch path
        compiled._init_handles()
        run, function = compiled.run, compiled.function
        metadata = compiled.packed_metadata
        # the launcher takes every parameter, constexprs (last in ours) included
        grid, extra = self.grid, tuple(self.constexprs.values())
        stream = torch._C._cuda_getCurrentRawStream

        def fast(args):
            run(grid, 1, 1, stream(device_index), function, metadata, None, None, None, *args, *extra)

        self._fast = fast


def precompile_triton(kernels, device, launchers: dict | None = None) -> None:
    """Compiles a wrapper module's Triton kernels now, several at a time, instead of one by one
    at their first launch (`TRITON_KERNELS`: kernel, signature, constexprs, launch config), and
    binds each binary to its `TritonLaunch` (`TRITON_LAUNCHERS`). A kernel that cannot be warmed
    up here is simply compiled at its first launch, through Triton's JIT call."""
    index = device.index if device.index is not None else torch.cuda.current_device()

    def compile_one(entry) -> None:
        fn, signature, constexprs, launch = entry
        try:
            args = [_TRITON_POINTEE[t] for t in signature.values()]
            with torch.cuda.device(device):
                compiled = fn.warmup(*args, grid=launch["grid"], num_warps=launch["num_warps"],
                                     num_stages=launch["num_stages"], **constexprs)
                launcher = (launchers or {}).get(getattr(fn, "__name__", None))
                if launcher is not None and compiled is not None:
                    launcher.bind(compiled, index)
        except Exception:  # noqa: BLE001  (an older Triton without warmup, an unknown type)
            pass

    if len(kernels) == 1:
        compile_one(kernels[0])
        return
    with ThreadPoolExecutor(max_workers=min(len(kernels), os.cpu_count() or 4)) as pool:
        list(pool.map(compile_one, kernels))
