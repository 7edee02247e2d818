"""One Triton kernel's launch from a wrapper module (`TritonLaunch`): Triton's JIT call until a
compiled binary is bound, then the binary launched directly on the current stream."""

from __future__ import annotations

import sys

import torch

from . import kernel_binaries
from . import triton_support


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


def cuda_arch(device) -> int | None:
    """The GPU's architecture as Triton names its target (90 for sm_90), or None off CUDA."""
    if device.type != "cuda":
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError):
        return None
    return major * 10 + minor


def _warmup(fn, signature: dict, device, config):
    """Compiles `fn` for the launch configuration (grid, block constexprs as (name, value) pairs,
    num_warps, num_stages)."""
    grid, blocks, warps, stages = config
    with torch.cuda.device(device):
        return fn.warmup(*[_TRITON_POINTEE[t] for t in signature.values()], grid=grid,
                         num_warps=warps, num_stages=stages, **dict(blocks), **triton_support.triton_options())
