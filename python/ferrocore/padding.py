"""Which GEMMs of a GPU graph run faster on zero-padded operands: measured on the device, cached
on disk, and handed to the Rust `padding` pass (`padded_matmuls` in the graph document).

cuBLAS leaves its fast kernels when a 16-bit matrix's rows are not 16-byte aligned (a dim that is
not a multiple of 8): GPT-2's LM head, 768 -> 50257, ran a pre-Hopper kernel for 3.3 ms on an
H100. Padding costs a copy of each operand and a larger result, so each unaligned GEMM is timed
both ways on random data of its own shapes and strides (median of CUDA-event timings, the
copies included) and padded only when that is faster. Decisions are cached per shape, stride,
dtype, device and torch version under `cache_dir/pad_mm`.
"""

from __future__ import annotations

import statistics

import torch

from .runtime import cached_measurement

ALIGN = 8
# padding must beat the GEMM as traced by this much to be worth its copies
MIN_GAIN = 0.97
_GEMMS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
}


def padded_matmuls(gm: torch.fx.GraphModule, opts: dict) -> dict:
    """{GEMM node name: what was measured} for the GEMMs that run faster padded."""
    if opts.get("pad_mm", "measured") != "measured" or not torch.cuda.is_available():
        return {}
    chosen = {}
    for n in gm.graph.nodes:
        operands = _unaligned_operands(n)
        if operands is None:
            continue
        a, b = operands
        plain, padded = _timings(n, a, b, opts.get("cache_dir"))
        if padded is not None and plain is not None and padded < MIN_GAIN * plain:
            chosen[n.name] = f"measured {plain:.3f} ms as traced, {padded:.3f} ms padded"
    return chosen


def _unaligned_operands(n: torch.fx.Node):
    if n.op != "call_function" or n.target not in _GEMMS:
        return None
    if n.target is torch.ops.aten.addmm.default and (n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1):
        return None
    ia, ib = _GEMMS[n.target]
    a, b = (n.args[i].meta.get("val") if isinstance(n.args[i], torch.fx.Node) else None for i in (ia, ib))
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if a.device.type != "cuda" or a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        return None
    m, k, nn = a.shape[-2], a.shape[-1], b.shape[-1]
    if all(d % ALIGN == 0 for d in (m, k, nn)) or 0 in (m, k, nn):
        return None
    return a, b


def _timings(n: torch.fx.Node, a: torch.Tensor, b: torch.Tensor, cache_dir) -> tuple:
    key = [str(n.target), list(a.shape), list(a.stride()), list(b.shape), list(b.stride()),
           str(a.dtype), torch.cuda.get_device_name(a.device), torch.__version__]
    ms = cached_measurement(cache_dir, "pad_mm", key, lambda: _measure(n.target, a, b),
                            errors=(RuntimeError, torch.OutOfMemoryError))
    return tuple(ms) if ms is not None else (None, None)


def _random_like(t: torch.Tensor) -> torch.Tensor:
    """Random data with `t`'s shape, strides, dtype and device."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return torch.randn(span, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())


def _zero_padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`x` zero-padded to [.., rows, cols], keeping a column-major operand column-major."""
    column_major = x.stride(-2) == 1 and x.stride(-1) != 1
    if column_major:
        out = x.new_zeros(*x.shape[:-2], cols, rows).transpose(-1, -2)
    else:
        out = x.new_zeros(*x.shape[:-2], rows, cols)
    out[..., : x.shape[-2], : x.shape[-1]].copy_(x)
    return out


def _measure(target, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(ms as traced, ms padded): medians of CUDA-event timings, the copies included."""
    A, B = _random_like(a), _random_like(b)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    up = lambda d: (d + ALIGN - 1) // ALIGN * ALIGN  # noqa: E731
    gemm = torch.bmm if A.dim() == 3 else torch.mm

    def plain():
        return gemm(A, B)

    def padded():
        return gemm(_zero_padded(A, up(m), up(k)), _zero_padded(B, up(k), up(n)))[..., :m, :n]

    return _median_ms(plain), _median_ms(padded)


def _median_ms(fn, reps: int = 7) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)
