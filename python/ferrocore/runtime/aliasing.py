"""Inputs that overlap in memory. A graph that writes into an input is compiled for the way its
inputs overlapped when it was compiled: AOT autograd merges overlapping inputs it sees written
into one base (a graph of its own), and a graph compiled for separate inputs reads each input
as it was before the graph's writes (functionalization moves every write into an input to the
graph's end). Dynamo does not guard on overlap, so the compiled callable checks it at every call
(`OverlapGuard`) and compiles another variant when it changed, as Dynamo recompiles when a guard
fails. Graphs that write into no input never overlap wrongly and run unchecked.

Overlap is decided on byte ranges (data pointer, plus the span the sizes and strides reach):
two interleaved views of one storage count as overlapping, which costs a compile, never a wrong
answer.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from ..metrics import metrics


def _span_bytes(t: torch.Tensor) -> int | None:
    """Bytes from a tensor's first element to just past its last; None for symbolic sizes."""
    try:
        if t.numel() == 0:
            return 0
        return (1 + sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()
    except (TypeError, RuntimeError, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode):
        return None


def _start(t: torch.Tensor) -> tuple:
    """Where a tensor's first element lies: its data pointer, or for a tensor without data (a
    fake tensor) its storage and the byte offset in it."""
    try:
        return (0, t.data_ptr())
    except (RuntimeError, NotImplementedError):
        return (torch._C._storage_id(t), int(t.storage_offset()) * t.element_size())


def overlapping(inputs, spans: list | None = None, among: frozenset | None = None) -> frozenset:
    """Pairs (i, j), i < j, of tensor inputs whose byte ranges intersect, at least one of the two
    in `among` (any input where None). `spans`: each input's span in bytes, if known."""
    ranges = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            continue
        span = spans[i] if spans is not None and spans[i] is not None else _span_bytes(t)
        if not span:
            continue
        key, lo = _start(t)
        ranges.append((key, lo, lo + span, i))
    ranges.sort()
    pairs = set()
    active: list = []  # (end, index) of ranges that may still reach the next start
    for key, lo, hi, i in ranges:
        active = [(k, end, j) for k, end, j in active if k == key and end > lo]
        for _, _, j in active:
            if among is None or i in among or j in among:
                pairs.add((min(i, j), max(i, j)))
        active.append((key, hi, i))
    return frozenset(pairs)


def describe(pairs: frozenset) -> str:
    return ", ".join(f"{i} and {j}" for i, j in sorted(pairs)) or "none"


class OverlapGuard:
    """The compiled callable of a graph that writes into inputs, behind a check that its inputs
    overlap as they did when it was compiled; a call where they overlap otherwise runs (and
    keeps) a variant compiled for those inputs by `compile_for(args)`."""

    def __init__(self, compiled: Callable, example_inputs, written: list | None, compile_for: Callable, name: str,
                 log: bool, boxed: bool):
        # Dynamo's calling convention for this graph: a list of arguments (boxed) or each one
        self.boxed = boxed
        # written inputs of the graph; None: not known (every overlap counts)
        self.among = None if written is None else frozenset(written)
        self.spans = [_span_bytes(x) if isinstance(x, torch.Tensor) else None for x in example_inputs]
        self.tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
        self.compiled_for = overlapping(example_inputs, self.spans, self.among)
        self.variants = {self.compiled_for: compiled}
        self.compile_for = compile_for
        self.name, self.log = name, log

    def pattern(self, args) -> frozenset:
        """The overlapping pairs that matter among `args`; the common case (no two inputs
        overlap at all) costs one data pointer per tensor input and a sort."""
        spans = self.spans
        starts = []
        for i in self.tensors:
            span = spans[i]
            if span is None:
                return overlapping(args, None, self.among)
            if span:
                starts.append((args[i].data_ptr(), span))
        starts.sort()
        end = -1
        for lo, span in starts:
            if lo < end:
                return overlapping(args, spans, self.among)
            end = max(end, lo + span)
        return frozenset()

    def variant(self, args) -> Callable:
        pattern = self.pattern(args)
        compiled = self.variants.get(pattern)
        if compiled is None:
            metrics.count("recompiles")
            if self.log:
                print(f"[ferrocore:recompiles] {self.name} compiled again: inputs overlapping in memory are "
                      f"{describe(pattern)} (compiled for {describe(self.compiled_for)})", file=sys.stderr)
            compiled = self.variants[pattern] = self.compile_for(list(args))
        return compiled

    def callable(self) -> Callable:
        if self.boxed:
            def run(args):
                return self.variant(args)(args)

            run._boxed_call = True
            return run
        return lambda *args: self.variant(args)(*args)


def guarded(compiled: Callable, example_inputs, written: list | None, compile_for: Callable, name: str,
            log: bool = False, boxed: bool = False) -> Callable:
    """`compiled`, checked for overlapping inputs at each call where the graph writes into any
    input (`written`: their positions, None when not known); `log`: announce each variant on the
    `recompiles` channel; `boxed`: Dynamo passes the arguments as one list."""
    if written is not None and not written:
        return compiled
    if not any(isinstance(x, torch.Tensor) for x in example_inputs):
        return compiled
    return OverlapGuard(compiled, example_inputs, written, compile_for, name, log, boxed).callable()
