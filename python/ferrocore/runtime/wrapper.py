"""Helpers the generated wrapper modules call (`from ferrocore.runtime.wrapper import ...`); they are
on the hot path, so each is one step: buffers and views, library results in the promised
layout, the GPU index-check flag, and the input checks (`wrapper/checks.rs`)."""

from __future__ import annotations


import torch



def empty_strided(size, stride, dtype, device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _empty_strided_current_cuda(size, stride, dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


def _empty_strided_on_cpu(size, stride, dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


# (size, stride, dtype) -> a tensor on the current CUDA device or the CPU; torch's C++ entry
# points where it has them (what Inductor's wrappers call), which skip the Python argument parser
try:
    from torch._C._dynamo.guards import _empty_strided_cuda as empty_strided_cuda
except ImportError:
    empty_strided_cuda = _empty_strided_current_cuda
try:
    from torch._C._dynamo.guards import _empty_strided_cpu as empty_strided_cpu
except ImportError:
    empty_strided_cpu = _empty_strided_on_cpu


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def owned_storage(t: torch.Tensor, extent: int, held: dict | None = None) -> torch.Tensor:
    """`t`, or a copy of it in storage of its own: a donated input that the program overwrites
    after its last read must not be seen changing through another view of its storage (a
    forward may save two views of one buffer), and must hold `extent` elements from its data
    pointer (a padded result written over the unpadded view of a padded one). `held` (storage
    data pointer -> count) names references a CUDA-graph recording keeps to the storage of its
    own outputs, which it rewrites at each replay and never reads: they do not make it shared."""
    storage = t.untyped_storage()
    # the storage object made to ask holds a reference of its own
    refs = 2 + (held.get(storage.data_ptr(), 0) if held else 0)
    shared = _storage_use_count is None or _storage_use_count(storage._cdata) > refs
    if not shared and storage.nbytes() >= (t.storage_offset() + extent) * t.element_size():
        return t
    own = torch.empty((extent,), dtype=t.dtype, device=t.device)
    return own.as_strided(t.size(), t.stride()).copy_(t)


def _reinterpret_as_strided(t: torch.Tensor, size, stride, offset) -> torch.Tensor:
    return t.as_strided(size, stride, t.storage_offset() + offset)


# (tensor, size, stride, offset past the tensor's own) -> a view of its storage; torch's C++
# entry point where it has one (Inductor's reinterpret_tensor): a third of as_strided's host time
try:
    from torch._C._dynamo.guards import _reinterpret_tensor as reinterpret
except ImportError:
    reinterpret = _reinterpret_as_strided


def restride(t: torch.Tensor | None, size, stride, dtype) -> torch.Tensor | None:
    """An extern call's result in the layout and dtype the kernels were compiled for.

    Copied only when ATen returned something else than the graph's metadata promised; a shape
    other than the promised one raises. A result ATen leaves undefined (None: attention's RNG
    state without dropout, ...) stays None.
    """
    if t is None:
        return None
    if t.dtype == dtype and t.stride() == stride and t.shape == size:
        return t
    if t.shape != size:
        # the kernels reading it address the promised shape: they would read outside it
        raise RuntimeError(f"ferrocore: a library call returned shape {tuple(t.shape)} where the graph's metadata "
                           f"says {tuple(size)}")
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.numel() <= 1 or all(n <= 1 or a == b for n, a, b in zip(size, t.stride(), stride)):
        # the same elements; size-1 dims take the promised strides too (a view, no copy)
        return t if t.stride() == stride else t.as_strided(size, stride, t.storage_offset())
    return torch.empty_strided(size, stride, dtype=t.dtype, device=t.device).copy_(t)


class GpuIndexCheck:
    """The index-check flag of a GPU graph's plain calls, read on the host without waiting.

    Kernels raise a sticky int32 flag on the device when a gather index is out of range (the
    load itself is clamped inside the buffer). Reading it right after the launches would make
    every call wait for the GPU; instead each call ends with an asynchronous copy of the flag
    into one of two pinned host slots and an event, and a later call reads a slot whose event
    has completed. So an out-of-range index raises IndexError at a later call of the graph, as
    eager CUDA reports its device-side assert at a later synchronization. A slot is reused only
    after its copy has been read, waiting for it if need be: the report is at most two calls late
    and the host never runs more than two calls ahead of the check."""

    __slots__ = ("device", "flag", "host", "events", "pending", "next")

    def __init__(self, device: str):
        self.device, self.flag = device, None

    def begin(self) -> torch.Tensor:
        """The device flag for this call's kernels; raises when an earlier call saw a bad index."""
        if self.flag is None:
            self.flag = torch.zeros((1,), dtype=torch.int32, device=self.device)
            self.host = torch.zeros((2,), dtype=torch.int32, device="cpu", pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
            self.pending, self.next = [False, False], 0
            return self.flag
        for slot in (0, 1):
            if self.pending[slot] and self.events[slot].query():
                self._read(slot)
        return self.flag

    def end(self) -> None:
        """Queues the copy of the flag after this call's launches (never waits for the GPU unless
        both slots still hold unread copies)."""
        slot = self.next
        if self.pending[slot]:
            self.events[slot].synchronize()
            self._read(slot)
        self.host[slot : slot + 1].copy_(self.flag, non_blocking=True)
        self.events[slot].record()
        self.pending[slot], self.next = True, 1 - slot

    def _read(self, slot: int) -> None:
        self.pending[slot] = False
        if self.host[slot].item():
            self.pending[slot] = True  # sticky: every later call reports it too
            raise IndexError("index out of range in a gather of this graph (seen by an earlier call on the GPU)")


class InputMismatch(RuntimeError):
    """A compiled module was called with an input unlike the one it was compiled for (its
    kernels would read out of bounds or the wrong bytes)."""


def check_input_count(args, count: int) -> None:
    if len(args) != count:
        raise InputMismatch(f"ferrocore: the compiled graph takes {count} inputs; got {len(args)}")


def _check_size_stride_grouped(tensors, sizes, strides, op_name=None) -> None:
    for t, size, stride in zip(tensors, sizes, strides, strict=True):
        if tuple(t.shape) != tuple(size) or tuple(t.stride()) != tuple(stride):
            raise AssertionError(f"expected size {size} stride {stride}, got {tuple(t.shape)} {t.stride()}")


# (tensors, sizes, strides, op name): AssertionError unless each tensor has its size and stride;
# torch's C++ check where it has one (what Inductor's wrappers call): one call for all inputs
try:
    from torch._C._dynamo.guards import assert_size_stride_grouped
except ImportError:
    assert_size_stride_grouped = _check_size_stride_grouped


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"{str(t.dtype).removeprefix('torch.')} on {t.device}, size {tuple(t.shape)}, stride {t.stride()}"


def input_mismatch(specs, inputs) -> InputMismatch:
    """The error for inputs that failed a module's check (`wrapper/checks.rs`): names the first
    input whose size, stride, dtype or device differ from what the module was compiled for.
    `specs`: the module's INPUTS, (name, size, stride, dtype, device) per input."""
    for i, ((name, size, stride, dtype, device), t) in enumerate(zip(specs, inputs)):
        if isinstance(t, torch.Tensor) and (tuple(t.shape), t.stride(), t.dtype, t.device) == (
                size, stride, dtype, torch.device(device)):
            continue
        want = f"{str(dtype).removeprefix('torch.')} on {device}, size {size}, stride {stride}"
        return InputMismatch(f"ferrocore: input {i} ({name}) of the compiled graph: expected {want}; got {_describe(t)}")
    return InputMismatch("ferrocore: the inputs differ from those the graph was compiled for")


def check_storage_view(t: torch.Tensor, size, stride, offset: int, storage_offset: int | None) -> None:
    """Raises eager's error when the as_strided view (size, stride) starting `offset` elements
    from `t`'s data lies outside `t`'s storage. `storage_offset`: the storage offset of `t` the
    view was compiled for, where the view names an absolute storage position."""
    start = t.storage_offset()
    if storage_offset is not None and start != storage_offset:
        raise InputMismatch(f"ferrocore: an input viewed by as_strided at an explicit storage offset was compiled "
                            f"for storage offset {storage_offset}; got {start}")
    start += offset
    itemsize = t.element_size()
    have = t.untyped_storage().nbytes()
    if 0 in size:
        return
    need = (start + 1 + sum((n - 1) * s for n, s in zip(size, stride))) * itemsize
    if start < 0:
        raise RuntimeError(f"Tensor: invalid storage offset {start}")
    if need > have:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {start}, and "
                           f"itemsize {itemsize} requiring a storage size of {need} are out of bounds for storage "
                           f"of size {have}")
