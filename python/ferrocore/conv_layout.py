"""The layout of a CPU graph's convolutions, measured (option `conv_layout`, value `auto`).

oneDNN's speed for one convolution differs by layout in either direction and by shape: on the
project's 2-core machine, one thread, NHWC ran a 2x16x32x32 3x3 convolution 1.45x and a 7x7
depthwise one 1.5x faster than NCHW, but ResNet-50's strided 1x1 layer-4 downsample 9.5x slower
(6.4 against 0.68 ms) and a 2x512x2x2 3x3 one 3x slower. No rule of thumb picks these, so the
graph's convolutions are run once in each layout on random data, and the graph goes
channels-last when that is faster in total (a graph in one layout: converting around single
convolutions made the kernels between them transpose). Timings are cached per shape, thread
count, CPU and torch version, so a shape is measured once per machine.
"""

from __future__ import annotations

import functools
import platform
import statistics
import time

import torch

from .extension import extension
from .runtime.measurement import cached_measurement

_CONVOLUTION = torch.ops.aten.convolution.default
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default
# channels-last only when it saves at least this share: near-equal totals keep eager's layout
MIN_GAIN = 0.95
# a convolution is timed this many times per layout, fewer when one call takes long
REPS = 5
SLOW_CALL_S = 0.05
# bumped when the measurement changes, so that cached timings of an older one are not used
_METHOD = 3


def choose(gm: torch.fx.GraphModule, opts: dict) -> tuple[str, str] | None:
    """("channels_last" | "contiguous", why) for a CPU graph with 4-D convolutions under
    `conv_layout = auto`; None otherwise (the compiler's own rule then applies)."""
    if opts.get("conv_layout", "auto") != "auto":
        return None
    signatures = _weighed(gm)
    if not signatures:
        return None
    nchw = nhwc = 0.0
    for sig in signatures:
        timed = _timings(sig, opts.get("cache_dir"))
        if timed is None:
            return None
        nchw, nhwc = nchw + timed[0], nhwc + timed[1]
    measured = f"{len(signatures)} convolutions measured {nchw:.3f} ms NCHW, {nhwc:.3f} ms NHWC"
    if nhwc < MIN_GAIN * nchw:
        return "channels_last", f"layout: channels-last: {measured}"
    return "contiguous", f"layout: eager's: {measured}"


def measure_ahead(gm: torch.fx.GraphModule, opts: dict) -> None:
    """Times (or finds cached) the convolutions `choose` weighs in `gm`, a training graph's
    joint graph, before its forward and backward compile: the backward's are chosen while the
    forward's C++ compiles on another core, which would slow and skew what they time."""
    if opts.get("conv_layout", "auto") == "auto":
        for sig in _weighed(gm):
            _timings(sig, opts.get("cache_dir"))


def _weighed(gm: torch.fx.GraphModule) -> list:
    """The signatures of the convolutions that take part in the choice."""
    return [s for s in (_signature(n) for n in gm.graph.nodes) if s is not None and not _compiled(s)]


def _signature(n: torch.fx.Node) -> dict | None:
    """What times a convolution node (a backward one by its forward's call): shapes, dtype and
    the call's parameters."""
    if n.op != "call_function" or n.target not in (_CONVOLUTION, _CONVOLUTION_BACKWARD):
        return None
    first = 0 if n.target is _CONVOLUTION else 1
    x, w = (n.args[first + i].meta.get("val") if isinstance(n.args[first + i], torch.fx.Node) else None
            for i in (0, 1))
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 4:
        return None
    if x.device.type != "cpu" or not x.dtype.is_floating_point:
        return None
    params = [list(p) if isinstance(p, (list, tuple)) else p for p in n.args[first + 3:first + 9]]
    stride, padding, dilation, transposed, output_padding, groups = params
    if any(not isinstance(v, int) for v in [*x.shape, *w.shape]):
        return None  # symbolic sizes
    return {"x": list(x.shape), "w": list(w.shape), "dtype": str(x.dtype), "stride": stride, "padding": padding,
            "dilation": dilation, "transposed": bool(transposed), "output_padding": output_padding,
            "groups": int(groups), "backward": n.target is _CONVOLUTION_BACKWARD}


def _compiled(sig: dict) -> bool:
    """Whether the compiler runs the forward convolution `sig` as a GEMM (1x1) or a generated
    kernel (depthwise) instead of oneDNN: those run about as fast in either layout, so they do
    not take part in the choice. Rust decides (`lowering/cpu_conv.rs`, `runs_compiled`)."""
    if sig["transposed"] or sig.get("backward"):
        return False
    stride, padding, dilation = sig["stride"], sig["padding"], sig["dilation"]
    if len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        return False
    return extension().cpu_conv_runs_compiled(sig["x"], sig["w"], stride, padding, dilation, sig["groups"])


def _timings(sig: dict, cache_dir) -> list | None:
    """(NCHW ms, NHWC ms) of the convolution `sig`, measured once per machine and thread count
    (a backward convolution is timed by its forward's call: one entry for both)."""
    call = {k: v for k, v in sig.items() if k != "backward"}
    key = [call, torch.get_num_threads(), _cpu_name(), torch.__version__, _METHOD]

    def measure():
        with torch.no_grad():
            return _measure(sig, False), _measure(sig, True)

    return cached_measurement(cache_dir, "conv_layout", key, measure)


def _measure(sig: dict, channels_last: bool) -> float:
    """Median ms of the convolution on random data with NHWC (or NCHW) activations."""
    dtype = getattr(torch, sig["dtype"].removeprefix("torch."))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(sig["x"], dtype=dtype).contiguous(memory_format=fmt)
    # the compiled graph hands oneDNN channels-last weights too (converted by its own kernel)
    w = torch.randn(sig["w"], dtype=dtype).contiguous(memory_format=fmt)

    def call():
        return torch.convolution(x, w, None, sig["stride"], sig["padding"], sig["dilation"], sig["transposed"],
                                 sig["output_padding"], sig["groups"])

    t = time.perf_counter()
    call()  # oneDNN builds its primitive at the first call
    reps = 1 if time.perf_counter() - t > SLOW_CALL_S else REPS
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


@functools.lru_cache(None)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
