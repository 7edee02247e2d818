"""Triton, imported here and nowhere else in the front (tests/test_front_imports.py holds the
other modules to that), and what the front does with it beside launching kernels.

Triton is optional: a CPU-only install may lack it, and then `triton` is None and no Triton kernel
is compiled or launched (the backend checks for it before it starts compile workers or picks the
Triton backend). Importing this module costs nothing more in the compiling process: Dynamo,
which the backend imports, has imported Triton and these submodules where it is installed.

It imports no torch: the compile workers (`compile_worker`) import it.
"""

from __future__ import annotations

import functools

from ..extension import extension

try:
    import triton
    import triton.backends.compiler
    import triton.compiler
    import triton.runtime.cache
except ImportError:  # not installed (a CPU-only install)
    triton = None
try:
    from triton.backends.nvidia.compiler import CUDAOptions
except ImportError:  # no Triton, or one without its NVIDIA backend
    CUDAOptions = None
try:
    from triton import knobs
except ImportError:  # no Triton, or an older one: launch hooks are attributes of CompiledKernel
    knobs = None


def version() -> str | None:
    """Triton's version, None without Triton."""
    return triton.__version__ if triton is not None else None


@functools.cache
def triton_options() -> dict:
    """Triton's compile options beside the launch configuration. No FMA contraction: each
    operation rounds as eager's kernels do (a contracted `x * y - mean` in a fused variance gave
    the deviation of a one-element row a nonzero value: inf where eager gives NaN). libdevice
    keeps denormals where this Triton lets it (its default flushes them: `lgamma` of a denormal
    `erfc` was inf where eager gives 102.6)."""
    options = {"enable_fp_fusion": False}
    if CUDAOptions is not None and "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__:
        options["enable_reflect_ftz"] = False
    return options


def launch_hooks_active(compiled=None) -> bool:
    """Whether a Triton launch hook (a profiler's) is installed: then launches go through Triton."""
    if knobs is not None:
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    else:
        hooks = (getattr(type(compiled), "launch_enter_hook", None),
                 getattr(type(compiled), "launch_exit_hook", None))
    # (newer Triton keeps a chain of hooks, often empty)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def jit_function(fn):
    """The `triton.jit` object of a wrapper module's kernel (made now if it was deferred)."""
    return fn.jit_function() if hasattr(type(fn), "jit_function") else fn


def describe(compiled, n_args: int) -> dict:
    """A Triton `CompiledKernel`'s binary and launch facts; `{"unlaunchable": why}` when its
    launch needs more than buffers on a 1-D grid (clusters, cooperative or dependent launches,
    tensor descriptors, scratch memory)."""
    md = compiled.metadata
    reasons = [
        name for name, bad in (
            ("num_ctas", (getattr(md, "num_ctas", 1) or 1) != 1),
            ("cluster_dims", any(d != 1 for d in (getattr(md, "cluster_dims", None) or ()))),
            ("launch_cooperative_grid", bool(getattr(md, "launch_cooperative_grid", False))),
            ("launch_pdl", bool(getattr(md, "launch_pdl", False))),
            ("tensordesc_meta", bool(getattr(md, "tensordesc_meta", None))),
            ("global_scratch_size", bool(getattr(md, "global_scratch_size", 0))),
            ("profile_scratch_size", bool(getattr(md, "profile_scratch_size", 0))),
        ) if bad
    ]
    cubin, ptx = compiled.asm.get("cubin"), compiled.asm.get("ptx")
    params = extension().ptx_param_count(ptx, md.name) if isinstance(ptx, str) else None
    if not isinstance(cubin, bytes):
        reasons.append("no cubin")
    if params is None or not 0 <= params - n_args <= 2:
        reasons.append(f"{params} parameters for {n_args} buffers")
    if reasons:
        return {"unlaunchable": ", ".join(reasons)}
    return {"name": md.name, "cubin": cubin, "num_warps": int(md.num_warps), "shared": int(md.shared),
            "trailing_nulls": params - n_args}
