"""Which GEMMs of a GPU graph run faster on zero-padded operands: measured on the device, cached
on disk, and handed to the Rust `padding` pass (`padded_matmuls` in the graph document).

cuBLAS leaves its fast kernels when a 16-bit matrix's rows are not 16-byte aligned (a leading
dimension that is not a multiple of 8): GPT-2's LM head, 768 -> 50257, ran a pre-Hopper kernel for 3.3 ms on an
H100. Padding costs a copy of each operand and a larger result, so each unaligned GEMM is timed
both ways on random data of its own shapes and strides (median of CUDA-event timings, the
copies included) and padded only when that is faster. Decisions are cached per shape, stride,
dtype, device and torch version under `cache_dir/pad_mm`.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from .extension import extension
from .runtime.measurement import cached_measurement, median_cuda_ms

# padding must beat the GEMM as traced by this much to be worth its copies
MIN_GAIN = 0.97
_GEMMS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
}


def padded_matmuls(gm: torch.fx.GraphModule, opts: dict, measured: "Measurements | None" = None) -> dict:
    """{GEMM node name: what was measured} for the GEMMs that run faster padded; `measured`: the
    timings a `Measurements` started earlier has taken (or is taking)."""
    if not _measuring(opts):
        return {}
    chosen = {}
    for n in gm.graph.nodes:
        operands = _unaligned_operands(n)
        if operands is None:
            continue
        gemm = _Gemm.of(n.target, *operands)
        plain, padded = measured.timings(gemm) if measured is not None else gemm.timings(opts.get("cache_dir"))
        if padded is not None and plain is not None and padded < MIN_GAIN * plain:
            chosen[n.name] = f"measured {plain:.3f} ms as traced, {padded:.3f} ms padded"
    return chosen


class Measurements:
    """The unaligned GEMMs of a training graph's joint graph, timed (or read from the cache) as
    soon as it is traced; its forward and backward take their timings from here
    (`padded_matmuls`). They are timed on the calling thread, before the graphs compile: timed
    on a thread of its own while the compile ran Python, each launch waited for the interpreter
    lock and the CUDA events counted the waits (a padded GEMM, with more launches, measured up
    to 25% slower than alone), and BERT's three took 444 ms instead of 46."""

    def __init__(self, gm: torch.fx.GraphModule, opts: dict):
        self._timings: dict = {}
        self._cache_dir = opts.get("cache_dir")
        if not _measuring(opts):
            return
        for n in gm.graph.nodes:
            operands = _unaligned_operands(n)
            if operands is not None:
                gemm = _Gemm.of(n.target, *operands)
                if gemm.key not in self._timings:
                    self._timings[gemm.key] = gemm.timings(self._cache_dir)

    def timings(self, gemm: "_Gemm") -> tuple:
        timed = self._timings.get(gemm.key)
        return timed if timed is not None else gemm.timings(self._cache_dir)


def _measuring(opts: dict) -> bool:
    return opts["pad_mm"] == "measured" and torch.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class _Gemm:
    """An unaligned GEMM, as its operands' metadata."""

    target: object
    a: tuple  # (shape, stride, dtype, device) of each operand
    b: tuple
    key: str

    @staticmethod
    def of(target, a: torch.Tensor, b: torch.Tensor) -> "_Gemm":
        key = [str(target), list(a.shape), list(a.stride()), list(b.shape), list(b.stride()),
               str(a.dtype), torch.cuda.get_device_name(a.device), torch.__version__]
        spec = lambda t: (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)  # noqa: E731
        return _Gemm(target, spec(a), spec(b), json.dumps(key))

    def timings(self, cache_dir) -> tuple:
        """(ms as traced, ms padded), or (None, None) where it could not be measured."""
        ms = cached_measurement(cache_dir, "pad_mm", json.loads(self.key), self._measure,
                                errors=(RuntimeError, torch.OutOfMemoryError))
        return tuple(ms) if ms is not None else (None, None)

    def _measure(self) -> tuple:
        with torch.cuda.device(self.a[3]):
            return _measure(self.target, _random_like(*self.a), _random_like(*self.b))


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
    if 0 in (m, k, nn):
        return None
    # cuBLAS reads the operands and writes the (row-major) result along their leading
    # dimensions: only those must be aligned (a row-major [M, K] operand's M is not one)
    align = extension().GEMM_ALIGN  # (Rust's `lowering/matmul.rs` pads to it)
    if all(d is not None and d % align == 0 for d in (_leading_dim(a), _leading_dim(b), nn)):
        return None
    return a, b


def _leading_dim(t: torch.Tensor) -> int | None:
    """The stride between a matrix operand's rows (row-major) or columns (column-major); None
    for a layout that is neither (it is copied first)."""
    s0, s1 = t.stride()[-2], t.stride()[-1]
    if s1 == 1 and s0 >= t.shape[-1]:
        return s0
    if s0 == 1 and s1 >= t.shape[-2]:
        return s1
    return None


def _random_like(shape: tuple, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random data of this shape, strides, dtype and device."""
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    return torch.randn(span, dtype=dtype, device=device).as_strided(shape, stride)


def _zero_padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`x` zero-padded to [.., rows, cols], keeping a column-major operand column-major."""
    column_major = x.stride(-2) == 1 and x.stride(-1) != 1
    if column_major:
        out = x.new_zeros(*x.shape[:-2], cols, rows).transpose(-1, -2)
    else:
        out = x.new_zeros(*x.shape[:-2], rows, cols)
    out[..., : x.shape[-2], : x.shape[-1]].copy_(x)
    return out


def _measure(target, A: torch.Tensor, B: torch.Tensor) -> tuple:
    """(ms as traced, ms padded) on the operands `A`, `B`: medians of CUDA-event timings, the
    copies included."""
    m, k, n = A.shape[-2], A.shape[-1], B.shape[-1]
    align = extension().GEMM_ALIGN
    up = lambda d: (d + align - 1) // align * align  # noqa: E731
    gemm = torch.bmm if A.dim() == 3 else torch.mm

    def plain():
        return gemm(A, B)

    def padded():
        return gemm(_zero_padded(A, up(m), up(k)), _zero_padded(B, up(k), up(n)))[..., :m, :n]

    return median_cuda_ms(plain), median_cuda_ms(padded)
