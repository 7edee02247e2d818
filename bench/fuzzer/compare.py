"""Compares a compiled program's results with eager's and names the difference.

Exact: shapes, dtypes, devices, integer and bool values, NaN positions, the strides of every
output eager returns dense (as tests/helpers.py: dims of size > 1). Floats: per-dtype
tolerances. A value difference beyond them is a documented deviation only when a float64 run of
the same program (every float input and cast widened) shows that eager itself is that far from
exact ("Reductions reassociate", "Half-precision chains" in ARCHITECTURE.md):
- `deviation:rounding`: float values, the compiled error against float64 at most 3x eager's (or
  within tolerance of float64 where eager's error is not finite); where eager itself is off by
  more than the tolerance, or one rounding of the terms is (an ill-conditioned result: huge
  terms cancelling, where even float64 absorbs small ones), within the summation bound
  `terms * eps * magnitude`, the magnitude being the float64 run on the inputs' absolute values;
- `deviation:rounding_sensitive`: integer or bool values derived from floats (comparisons,
  argmax, casts) that differ only at elements where eager differs from float64 or the compiled
  value equals float64's.
"""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (any permutation of a contiguous layout)."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if sz == 0:
            return True
        if st != expected:
            return False
        expected *= sz
    return True


def same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(s <= 1 or x == y for s, x, y in zip(a.shape, a.stride(), b.stride()))


def _error(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| in float64; 0 where both are NaN or the same infinity, inf where one is NaN."""
    x, ref = x.double(), ref.double()
    err = (x - ref).abs()
    both_nan = x.isnan() & ref.isnan()
    same = x == ref
    err = torch.where(same | both_nan, torch.zeros_like(err), err)
    return torch.where(x.isnan() ^ ref.isnan(), torch.full_like(err, float("inf")), err)


def values_differ(e: torch.Tensor, a: torch.Tensor) -> str | None:
    """A description of the value difference, or None."""
    if e.dtype.is_floating_point:
        rtol, atol = TOLERANCES.get(e.dtype, (1e-4, 1e-5))
        ed, ad = e.double(), a.double()
        nan_e, nan_a = ed.isnan(), ad.isnan()
        if not torch.equal(nan_e, nan_a):
            return f"NaN positions differ at {_where(nan_e ^ nan_a)}"
        err = _error(ad, ed)
        bad = err > atol + rtol * ed.abs().nan_to_num(posinf=0.0, neginf=0.0)
        bad &= ~(ed.isinf() & (ad == ed))
        if bool(bad.any()):
            k = _first(bad)
            return f"values differ at {len(bad.nonzero())} of {e.numel()} elements, first {k}: {ad[k].item()!r}, eager {ed[k].item()!r}"
        return None
    if not torch.equal(e, a):
        bad = e != a
        k = _first(bad)
        return f"values differ at {len(bad.nonzero())} of {e.numel()} elements, first {k}: {a[k].item()!r}, eager {e[k].item()!r}"
    return None


def _first(mask: torch.Tensor) -> tuple:
    return tuple(mask.nonzero()[0].tolist())


def _where(mask: torch.Tensor) -> str:
    return f"{len(mask.nonzero())} elements, first {_first(mask)}"


def compare_tensor(e: torch.Tensor, a, *, aliased: bool, check_strides: bool = True):
    """(class, detail) of the first difference between eager `e` and compiled `a`, or None."""
    if not isinstance(a, torch.Tensor):
        return "mismatch:type", f"{type(a).__name__}, eager Tensor"
    if a.shape != e.shape:
        return "mismatch:shape", f"shape {tuple(a.shape)}, eager {tuple(e.shape)}"
    if a.dtype != e.dtype:
        return "mismatch:dtype", f"dtype {a.dtype}, eager {e.dtype}"
    if a.device != e.device:
        return "mismatch:device", f"device {a.device}, eager {e.device}"
    if check_strides and e.numel() > 1 and (aliased or is_dense(e)) and not same_strides(e, a):
        return "mismatch:stride", f"stride {a.stride()}, eager {e.stride()} (shape {tuple(e.shape)})"
    diff = values_differ(e.cpu(), a.cpu())
    if diff is not None:
        cls = "mismatch:nan" if diff.startswith("NaN") else "mismatch:value"
        return cls, diff
    return None


def explained_by_rounding(e: torch.Tensor, a: torch.Tensor, ref: torch.Tensor, magnitude=None,
                          terms: int = 1, precision=None) -> str | None:
    """The deviation class when eager's own error against the float64 run `ref` explains the
    difference, else None. `magnitude`: the float64 run on absolute values (see the module doc);
    `terms`: how many terms a reduction in the program can add at most; `precision`: the least
    precise float type the program computes in (a float64 result of float32 work is within
    float32's tolerance)."""
    e, a, ref = e.cpu(), a.cpu(), ref.cpu()
    if ref.shape != e.shape:
        return None
    if e.dtype.is_floating_point:
        rtol, atol = TOLERANCES.get(e.dtype, (1e-4, 1e-5))
        if precision in TOLERANCES:
            rtol, atol = max(rtol, TOLERANCES[precision][0]), max(atol, TOLERANCES[precision][1])
        err_e, err_a = _error(e, ref), _error(a, ref)
        tol = atol + rtol * ref.double().abs().nan_to_num(posinf=0.0, neginf=0.0)
        allowed = torch.where(err_e.isfinite(), torch.maximum(3 * err_e, tol), tol)
        if magnitude is not None and magnitude.shape == e.shape:
            # where one rounding of the terms exceeds the tolerance, neither eager nor the float64
            # run is exact: any summation order within the bound is as right as eager's
            noise = torch.finfo(e.dtype).eps * magnitude.cpu().nan_to_num(posinf=0.0)
            allowed = torch.where((err_e > tol) | (noise > tol), torch.maximum(allowed, terms * noise), allowed)
        if e.dtype in (torch.float16, torch.bfloat16):
            # a half-precision chain: an intermediate eager rounds to the half type overflows to
            # inf (and a later op to NaN) where the compiled float32 intermediate stays finite,
            # as the float64 run does
            allowed = torch.where(~e.isfinite() & ref.isfinite() & a.isfinite(), torch.inf, allowed)
            err_a = torch.where(~e.isfinite() & ref.isfinite() & a.isfinite(), 0.0, err_a)
        return "deviation:rounding" if bool((err_a <= allowed).all()) else None
    r = ref.to(e.dtype) if not ref.dtype.is_floating_point or bool(ref.isfinite().all()) else None
    if r is None:
        return None
    bad = e != a
    sensitive = (a == r) | (e != r)
    return "deviation:rounding_sensitive" if bool((sensitive | ~bad).all()) else None


def aliases_any(t: torch.Tensor, inputs: list) -> bool:
    if t.untyped_storage().nbytes() == 0:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(isinstance(i, torch.Tensor) and i.untyped_storage().data_ptr() == ptr for i in inputs)
