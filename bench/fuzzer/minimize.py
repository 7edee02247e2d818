"""Shrinks a failing program while it keeps failing the same way (the same class, and for
compile and runtime errors the same exception type).

Greedy passes, repeated until none shrinks the program or the check budget is spent: keep one
output; drop an op (its uses read one of its operands instead); drop unused inputs; make inputs
contiguous, of ordinary values, of a plain dtype (float32 / int64); shrink each dimension (to 1,
halved, minus one). Every candidate is checked by running it (eager must still accept it).
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

from .program import FLOATS, INTS, Program


def signature(result: dict) -> str:
    cls = result["class"]
    if cls in ("compile_error", "runtime_error", "batch_only:compile_error"):
        m = re.search(r"raised:\s*\n?\s*(\w+)", result.get("detail", "")) or re.search(
            r"call: (\w+)", result.get("detail", ""))
        return f"{cls}:{m.group(1) if m else ''}"
    return cls


class Minimizer:
    def __init__(self, fails: Callable[[Program], bool], max_checks: int = 200):
        self.fails = fails
        self.max_checks = max_checks
        self.checks = 0

    def _try(self, candidate: Program) -> bool:
        if self.checks >= self.max_checks:
            return False
        self.checks += 1
        return self.fails(candidate)

    def run(self, program: Program) -> Program:
        best = _clean(program)
        progress = True
        while progress and self.checks < self.max_checks:
            progress = False
            for make in (_single_outputs, _dropped_ops, _plain_inputs, _smaller_shapes):
                for candidate in make(best):
                    candidate = _clean(candidate)
                    if _size(candidate) < _size(best) and self._try(candidate):
                        best, progress = candidate, True
                        break
        return best


def minimize(program: Program, fails: Callable[[Program], bool], max_checks: int = 200) -> Program:
    return Minimizer(fails, max_checks).run(program)


def _size(p: Program) -> tuple:
    """What the minimizer decreases: ops, outputs, inputs, elements, then non-plain inputs."""
    numel = sum(_prod(i.shape) for i in p.inputs)
    fancy = sum((i.layout != "contiguous") + (i.values == "special") + (i.dtype not in ("float32", "int64", "bool"))
                for i in p.inputs)
    return (len(p.ops), len(p.outputs), len(p.inputs), numel + sum(len(i.shape) for i in p.inputs), fancy)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _copy(p: Program) -> Program:
    return Program.from_dict(p.to_dict())


def _clean(p: Program) -> Program:
    """Drops inputs no op or output reads."""
    used = {v for op in p.ops for v in op.args.values()} | set(p.outputs)
    q = _copy(p)
    q.inputs = [i for i in q.inputs if i.name in used]
    return q


def _single_outputs(p: Program) -> Iterator[Program]:
    if len(p.outputs) > 1:
        for out in p.outputs:
            q = _copy(p)
            q.outputs = [out]
            yield q


def _dropped_ops(p: Program) -> Iterator[Program]:
    for k in reversed(range(len(p.ops))):
        op = p.ops[k]
        if not op.target:  # an in-place statement: just drop it
            q = _copy(p)
            del q.ops[k]
            yield q
            continue
        later_uses = any(op.target in o.args.values() for o in p.ops[k + 1:]) or op.target in p.outputs
        if not later_uses:
            q = _copy(p)
            del q.ops[k]
            yield q
            continue
        for operand in dict.fromkeys(op.args.values()):
            yield _forward(p, k, operand)


def _forward(p: Program, k: int, operand: str) -> Program:
    """Op k removed; its later readers read `operand` instead."""
    q = _copy(p)
    target = q.ops[k].target
    del q.ops[k]
    for o in q.ops[k:]:
        o.args = {s: operand if v == target else v for s, v in o.args.items()}
    q.outputs = list(dict.fromkeys(operand if v == target else v for v in q.outputs))
    return q


def _plain_inputs(p: Program) -> Iterator[Program]:
    for k, inp in enumerate(p.inputs):
        for field, plain in (("layout", "contiguous"), ("values", "normal")):
            if getattr(inp, field) != plain and not (field == "values" and inp.values in ("index", "perm", "mask")):
                q = _copy(p)
                setattr(q.inputs[k], field, plain)
                yield q
        plain_dtype = "float32" if inp.dtype in FLOATS else "int64" if inp.dtype in INTS else inp.dtype
        if plain_dtype != inp.dtype and inp.values not in ("index", "perm"):
            q = _copy(p)
            q.inputs[k].dtype = plain_dtype
            yield q


def _smaller_shapes(p: Program) -> Iterator[Program]:
    for k, inp in enumerate(p.inputs):
        for d, size in enumerate(inp.shape):
            for smaller in dict.fromkeys((1, size // 2, size - 1)):
                if 0 <= smaller < size:
                    for clamp in (False, True):
                        q = _copy(p)
                        q.inputs[k].shape[d] = smaller
                        _fit_indices(q, q.inputs[k], smaller if clamp else None)
                        yield q


def _fit_indices(p: Program, inp, bound) -> None:
    """A shrunk permutation input takes at most its new size of distinct indices; with `bound`,
    every index input's range is narrowed to [-bound, bound) as well (for a shrunk indexed
    tensor)."""
    if inp.values == "perm" and inp.dim < len(inp.shape):
        inp.high = inp.shape[inp.dim]
    if bound is None:
        return
    for other in p.inputs:
        if other.values == "index":
            other.low, other.high = max(other.low, -bound), max(min(other.high, bound), other.low + 1)
        elif other.values == "perm" and other.low > bound:
            other.low = max(bound, other.high)


def fewest_partners(partners: list, fails_with: Callable[[list], bool], max_checks: int = 60) -> tuple:
    """(the fewest of `partners` a program still fails together with, checks used): drops one
    partner at a time while the rest still make it fail (a `batch_only` failure needs at least
    one)."""
    kept, checks, i = list(partners), 0, 0
    while i < len(kept) and checks < max_checks:
        trial = kept[:i] + kept[i + 1:]
        checks += 1
        if trial and fails_with(trial):
            kept = trial
        else:
            i += 1
    return kept, checks
