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

Generated wrapper modules import their helpers from the modules that define them
(`from ferrocore.runtime.wrapper import restride, ...`: the names `crates/ferrocore/src/wrapper`
prints). This package's own module imports nothing, so the compile workers
(`python -m ferrocore.runtime.compile_worker`) start without torch.
"""
