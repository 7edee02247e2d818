"""A trace's fake-tensor calls, remembered by their arguments' metadata.

A model's layers repeat: most of the ops a joint trace runs on fake tensors (full-size BERT's:
~3,000) are an earlier layer's op again, on tensors of the same sizes. FakeTensorMode's own
cache answers them, but its key (every argument flattened and validated) and its rebuilt outputs
cost about half of the trace. `FakeCalls` keys a call on what decides its outputs' metadata (the
op; each tensor argument's sizes, strides, offset, dtype, device and flags; every other
argument's type and value) and rebuilds the outputs as FakeTensorMode does: a new meta tensor,
or for a view the argument's storage under the view's sizes.

A call is not remembered where its outputs depend on more than that: ops whose results depend on
data or on randomness, arguments that are not fake tensors or carry a constant's value (which
FakeTensorMode propagates), outputs that are not tensors, carry a constant, are an argument
itself, or share storage in any way but a view of the one tensor argument.
"""
from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.multiprocessing.reductions import StorageWeakRef

_UNREMEMBERED_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output,
                      torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view)
_PLAIN = frozenset((int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format))


@dataclasses.dataclass(frozen=True)
class _Output:
    shape: torch.Size
    stride: tuple
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    view: bool  # on the storage of the call's one tensor argument


@dataclasses.dataclass(frozen=True)
class _Entry:
    outputs: tuple  # of _Output, or None where the op returned None
    kind: type | None  # tuple or list; None: one tensor


class _Unkeyed(Exception):
    pass


class FakeCalls:
    """`calls(func, args, kwargs)` is `func(*args, **kwargs)` under the fake mode, answered from
    an earlier call with the same metadata where there was one."""

    def __init__(self, fake_mode) -> None:
        self.mode = fake_mode
        self.entries: dict = {}
        self.hits = 0
        self.rememberable: dict = {}  # op -> whether its calls may be remembered (by its tags)

    def __call__(self, func, args, kwargs):
        rememberable = self.rememberable.get(func)
        if rememberable is None:
            rememberable = self.rememberable[func] = not any(tag in func.tags for tag in _UNREMEMBERED_TAGS)
        if not rememberable:
            return func(*args, **kwargs)
        tensors: list = []
        try:
            key = (func, _key(args, tensors), _key(kwargs, tensors) if kwargs else None)
        except _Unkeyed:
            return func(*args, **kwargs)
        entry = self.entries.get(key)
        if entry:
            self.hits += 1
            return self._rebuild(entry, tensors)
        out = func(*args, **kwargs)
        if entry is None:
            self.entries[key] = _entry(out, tensors) or False  # False: call it every time
        return out

    def _rebuild(self, entry: _Entry, tensors: list):
        metas = []
        with in_kernel_invocation_manager(self.mode):
            for o in entry.outputs:
                if o is None:
                    metas.append(None)
                elif o.view:
                    meta = torch.empty((), dtype=o.dtype, device="meta", requires_grad=o.requires_grad)
                    metas.append(meta.set_(tensors[0].untyped_storage(), o.offset, o.shape, o.stride))
                else:
                    metas.append(torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device="meta",
                                                     requires_grad=o.requires_grad))
        outs = [None if m is None else FakeTensor(self.mode, m, o.device) for m, o in zip(metas, entry.outputs)]
        return outs[0] if entry.kind is None else entry.kind(outs)


def _key(value, tensors: list):
    """A hashable key of `value`'s metadata; its fake tensors are appended to `tensors`."""
    kind = type(value)
    if kind is FakeTensor:
        if value.constant is not None or value.layout != torch.strided:
            raise _Unkeyed
        tensors.append(value)
        return (FakeTensor, value.shape, value.stride(), value.storage_offset(), value.dtype, value.device,
                value.requires_grad, value.is_conj(), value.is_neg())
    if kind in _PLAIN or value is None:
        # the type too: full(..., 1) and full(..., 1.0) differ in dtype, yet 1 == 1.0
        return (kind, value)
    if kind is list or kind is tuple:
        return (kind, tuple([_key(v, tensors) for v in value]))
    if kind is dict:
        return (dict, tuple([(k, _key(v, tensors)) for k, v in value.items()]))
    raise _Unkeyed


def _entry(out, tensors: list) -> _Entry | None:
    """What rebuilds `out` from the same call's tensors, or None if it cannot be rebuilt."""
    single = isinstance(out, torch.Tensor)
    if not single and type(out) not in (tuple, list):
        return None
    storages = {StorageWeakRef(t.untyped_storage()) for t in tensors}
    fresh: set = set()
    outputs = []
    for o in (out,) if single else out:
        if o is None:
            outputs.append(None)
            continue
        if type(o) is not FakeTensor or o.constant is not None or o.layout != torch.strided \
                or o.is_conj() or o.is_neg() or any(o is t for t in tensors):  # (an argument itself)
            return None
        storage = StorageWeakRef(o.untyped_storage())
        view = storage in storages
        if view and len(tensors) != 1:
            return None
        if not view:
            # a storage of its own, just large enough, as empty_strided makes it
            if storage in fresh or o.storage_offset() != 0 or o.untyped_storage().nbytes() != _bytes(o):
                return None
            fresh.add(storage)
        outputs.append(_Output(o.shape, o.stride(), o.storage_offset(), o.dtype, o.device, o.requires_grad, view))
    return _Entry(tuple(outputs), None if single else type(out))


def _bytes(t: torch.Tensor) -> int:
    if any(s == 0 for s in t.shape):
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return extent * t.element_size()
