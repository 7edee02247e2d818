"""The runtime: what loads, launches, caches and runs a compiled graph once Rust has written it.

- `wrapper`, `cpp_library`, `triton_launch`, `report`: what the generated wrapper modules call
  (buffers, views and input checks; the C++ library and its kernels; Triton launches; the
  module's `__main__` benchmark and the compile report's runtime section);
- `precompile`, `autotune`, `kernel_binaries`, `compile_worker`, `triton_support`: a GPU graph's
  Triton kernels compiled at load (cached binaries, worker processes, autotuning);
- `cache`, `versions`, `graph_cache`, `measurement`: the on-disk cache, the versions in its keys,
  the compiled-graph cache and timings measured once;
- `cudagraphs`, `aot_runtime`, `aliasing`: what runs around a compiled graph's call (CUDA-graph
  replays, AOT autograd's runtime rebuilt, the check of overlapping inputs).

The runtime imports none of the layers above it (entry `backend`, tracing, dynamic-shape
dispatch, static compile): those hand it what it needs. It may import the front's shared
modules (`extension`, `options`, `metrics`, `artifact`, `strides`, `serialize`, ...);
tests/test_front_imports.py holds it to that.

Generated wrapper modules import their helpers from this package (`from ferrocore.runtime
import load_kernels, ...`: the names `crates/ferrocore/src/wrapper` prints). Those are looked up
at their first use (`__getattr__`), so that importing a module of the runtime does not import
torch: the compile workers (`python -m ferrocore.runtime.compile_worker`) start without it.
"""

from __future__ import annotations

# name -> the module of this package that defines it: the helpers generated wrapper modules
# import from `ferrocore.runtime` (python.rs, checks.rs)
WRAPPER_HELPERS = {
    "load_kernels": "cpp_library",
    "host_kernel": "cpp_library",
    "TritonLaunch": "triton_launch",
    "GpuIndexCheck": "wrapper",
    "empty_strided_cuda": "wrapper",
    "owned_storage": "wrapper",
    "reinterpret": "wrapper",
    "restride": "wrapper",
    "check_input_count": "wrapper",
    "assert_size_stride_grouped": "wrapper",
    "check_storage_view": "wrapper",
    "input_mismatch": "wrapper",
    "benchmark": "report",
    "benchmark_main": "report",
}


def __getattr__(name: str):
    """A wrapper module's helper, imported at its first use (the module's docstring says why)."""
    module = WRAPPER_HELPERS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # imported here, not at the top: the compile workers import this package without torch
    # (tests/test_front_imports.py allows these imports)
    from . import cpp_library, report, triton_launch, wrapper

    value = getattr({"cpp_library": cpp_library, "report": report, "triton_launch": triton_launch,
                     "wrapper": wrapper}[module], name)
    globals()[name] = value
    return value
