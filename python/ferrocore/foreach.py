"""Decompositions of `aten._foreach_*` ops (an optimizer's foreach step, the default for CUDA
parameters; gradient clipping's norms) into one op per list element, which the graph then
fuses like any other: without them each foreach op ran as an ATen call."""

from __future__ import annotations

from typing import Callable

import torch

aten = torch.ops.aten

# (`powsum` is left out: it has no one-op counterpart)
_BASES = (
    "abs acos add addcdiv addcmul asin atan ceil clamp_max clamp_min clone copy cos cosh div erf erfc exp expm1 "
    "floor frac lerp lgamma log log10 log1p log2 max maximum minimum mm mul neg norm pow reciprocal round rsqrt "
    "sigmoid sign sin sinh sqrt sub tan tanh trunc zero"
).split()


def _addc(combine: Callable, op) -> Callable:
    def one(x, t1, t2, value=1):
        if isinstance(value, torch.Tensor):  # the `.Tensor` overload: one value per element
            return x + value * combine(t1, t2)
        return op(x, t1, t2, value=value)

    return one


def _bounded(tensor_op, scalar_op) -> Callable:
    def one(x, other):
        return tensor_op(x, other) if isinstance(other, torch.Tensor) else scalar_op(x, other)

    return one


# per-element functions whose arguments differ from the foreach op's
_ONE: dict[str, Callable] = {
    "addcmul": _addc(torch.mul, aten.addcmul),
    "addcdiv": _addc(torch.div, aten.addcdiv),
    "maximum": _bounded(aten.maximum, aten.clamp_min),
    "minimum": _bounded(aten.minimum, aten.clamp_max),
    "norm": lambda x, ord=2, dtype=None: aten.linalg_vector_norm(x, ord, dtype=dtype),
    "zero": lambda x: torch.zeros_like(x),
}


def _per_element(overload, one: Callable) -> Callable:
    schema = overload._schema
    args = list(schema.arguments)
    is_list = [str(a.type).startswith("List[") for a in args]

    def decomposed(*given, **named):
        values = []
        for j, a in enumerate(args):
            if j < len(given):
                values.append(given[j])
            elif a.name in named:
                values.append(named[a.name])
            elif a.has_default_value():
                values.append(a.default_value)
            else:
                raise TypeError(f"{overload}: missing argument {a.name}")
        n = next(len(v) for v, listed in zip(values, is_list) if listed)
        out = []
        for i in range(n):
            picked = [v[i] if listed else v for v, listed in zip(values, is_list)]
            positional = [v for v, a in zip(picked, args) if not a.kwarg_only]
            keywords = {a.name: v for v, a in zip(picked, args) if a.kwarg_only}
            out.append(one(*positional, **keywords))
        return out

    return decomposed


def decompositions() -> dict:
    """The table: every functional overload of the foreach ops torch has."""
    table = {}
    for base in _BASES:
        packet = getattr(aten, f"_foreach_{base}", None)
        if packet is None:
            continue
        one = _ONE.get(base) or getattr(aten, base)
        for name in packet.overloads():
            overload = getattr(packet, name)
            if name.endswith("out") or not any(str(a.type).startswith("List[Tensor") for a in overload._schema.arguments):
                continue
            table[overload] = _per_element(overload, one)
    return table
