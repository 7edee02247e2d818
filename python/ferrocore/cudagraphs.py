"""`mode="reduce-overhead"`: a compiled GPU graph's launches recorded once in a CUDA graph and
replayed, so that a call costs one graph launch instead of one host round per kernel.

A recording reads its inputs at the addresses it was recorded with and writes its outputs into
its own memory pool. Two rules keep that from ever giving a wrong answer:

- Parameters, buffers and saved activations are read where they live: a recording is keyed by
  their addresses, and a call whose such inputs live elsewhere records again (up to `MAX_KEYS`
  address sets; beyond that, the call runs the plain compiled wrapper). The other inputs (a
  batch, a backward's incoming gradients: `copied`, as the front names them) are copied into
  buffers of the recording's own before each replay, so that a new batch each step replays.
- Outputs handed to the caller are aliases of the pool. A recording is replayed only when no
  alias it handed out is still alive; otherwise a second recording of the same inputs (its own
  pool) is replayed, and when every recording's outputs are still held, the call runs the
  plain wrapper, which allocates fresh outputs. A later replay never overwrites memory the
  caller can still read.

A graph whose kernels check gather indices records its call with a flag of its own (the module's
`INDEX_FLAG`); a replay does not wait for it: the flag is read once the replay is done, at a later
call, which then raises IndexError, as eager CUDA reports a device-side assert asynchronously
(plain calls do the same through `runtime.GpuIndexCheck`). The flag is sticky.

Forward, backward and inference graphs whose every input is a tensor on the graph's GPU are
recorded. A forward's outputs are pool memory that autograd holds as saved activations until the
backward has run; the backward's recording reads them there (keyed by their addresses). CPU
tensors, ATen fallbacks, library calls that synchronize with the host (the module's
`CUDAGRAPH_UNSAFE`) and host-side checks run without CUDA graphs, logged once.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .backend import is_dense
from .metrics import metrics

# A tensor over a storage from a dict of its metadata, in one C++ call (a replay hands out every
# saved activation of a forward this way).
_CUDA_TENSOR = getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None)

# Distinct input address sets recorded per graph, and recordings per address set.
MAX_KEYS = 8
GENERATIONS = 2


def blocker(module, device, inputs_meta, host_scalars: bool) -> str | None:
    """Why this compiled graph cannot run as a CUDA graph, or None when it can."""
    if device is None or device.type != "cuda":
        return "not a GPU graph"
    if host_scalars:
        # (their placeholders are declared on the GPU: the call copies them there)
        return "0-d CPU tensor inputs are copied to the GPU at each call"
    if getattr(module, "KERNEL_SOURCE", None) is not None:
        return "it runs C++ kernels on the host"
    # library calls that synchronize, ATen fallbacks, index checks: the module names them
    unsafe = getattr(module, "CUDAGRAPH_UNSAFE", None)
    if unsafe:
        return unsafe
    for i, val in enumerate(inputs_meta):
        if not isinstance(val, torch.Tensor):
            return f"input {i} is not a tensor"
        if val.device != device:
            return f"input {i} lives on {val.device}"
    return None


class _Recording:
    """One captured graph, its pool's outputs, what the last replay handed out, and its
    index-check flag with the event after its last replay."""

    __slots__ = ("graph", "static_outputs", "plan", "handed", "flag", "seen", "replayed", "copies")

    def __init__(self, graph, static_outputs, plan, flag=None, copies=()):
        self.graph, self.static_outputs, self.plan = graph, static_outputs, plan
        self.handed: list = []
        self.flag, self.replayed = flag, None
        # the flag as the last replay left it, copied to pinned host memory behind the replay:
        # reading the device flag would wait for every launch queued since (a backward's check
        # waited for its forward's replay)
        self.seen = torch.zeros((1,), dtype=torch.int32, device="cpu", pin_memory=True) if flag is not None else None
        # (input position, the recording's own buffer the graph reads it from)
        self.copies = copies

    def free(self) -> bool:
        return all(ref.expired() for ref in self.handed)

    def check_indices(self) -> None:
        """Raises IndexError when a finished replay saw an out-of-range index (never waits)."""
        if self.flag is not None and self.replayed is not None and self.replayed.query() and int(self.seen[0]):
            raise IndexError("index out of range in a gather of this graph (seen by an earlier call's CUDA graph replay)")

    def run(self, args) -> list:
        self.check_indices()
        for j, buf in self.copies:
            buf.copy_(args[j])
        self.graph.replay()
        if self.flag is not None:
            if self.replayed is None:
                self.replayed = torch.cuda.Event()
            self.seen.copy_(self.flag, non_blocking=True)
            self.replayed.record()
        return self.hand_out(args)

    def hand_out(self, args) -> list:
        storages = {}
        out = []
        for entry in self.plan:
            kind = entry[0]
            if kind == "value":
                out.append(entry[1])
            elif kind == "input":
                _, j, size, stride, delta, itself = entry
                out.append(args[j] if itself else args[j].as_strided(size, stride, args[j].storage_offset() + delta))
            else:
                _, key, ptr, nbytes, device, meta = entry
                st = storages.get(key)
                if st is None:
                    # a storage of its own over the pool's bytes: its lifetime is the caller's
                    st = storages[key] = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
                if device.type == "cuda" and _CUDA_TENSOR is not None:
                    out.append(_CUDA_TENSOR(meta, st))
                else:
                    out.append(torch.empty((0,), dtype=meta["dtype"], device=device).set_(
                        st, meta["storage_offset"], meta["size"], meta["stride"]))
        self.handed = [StorageWeakRef(s) for s in storages.values()]
        return out


class CudaGraphRunner:
    """Wraps a compiled graph's boxed `call(args)`: the first call runs it plainly (kernels load,
    library handles initialize), later calls replay a recording for the inputs' addresses."""

    def __init__(self, call, name: str, device: torch.device, index_flag: bool = False, copied=(), saved=()):
        self.call, self.name, self.device = call, name, device
        self.copied = frozenset(copied)
        # outputs only autograd reads (a forward's saved activations)
        self.saved = frozenset(saved)
        # the call takes `index_flag`, a flag its kernels raise on an out-of-range gather index
        self.index_flag = index_flag
        self.warm = False
        self.broken: str | None = None
        self.recordings: OrderedDict = OrderedDict()  # address key -> [_Recording]
        self._logged: set = set()

    def __call__(self, args):
        if self.broken is not None or not self.warm:
            self.warm = True
            metrics.count("cudagraph_plain_calls")
            return self.call(args)
        key = self._key(args)
        gens = self.recordings.get(key)
        if gens is not None:
            self.recordings.move_to_end(key)
            for rec in gens:
                if rec.free():
                    metrics.count("cudagraph_replays")
                    return rec.run(args)
        if gens is None and len(self.recordings) >= MAX_KEYS and not self._evict():
            return self._plain(args, f"more than {MAX_KEYS} input address sets with live outputs")
        if gens is not None and len(gens) >= GENERATIONS:
            return self._plain(args, f"the outputs of all {GENERATIONS} recordings for these inputs are still held")
        rec = self._record(args)
        if rec is None:
            return self.call(args)
        self.recordings.setdefault(key, []).append(rec)
        metrics.count("cudagraph_recordings")
        return rec.run(args)

    def _key(self, args) -> tuple:
        """The addresses of the inputs read in place; the layouts of those copied."""
        return tuple((tuple(a.shape), a.stride(), a.dtype) if j in self.copied and _copyable(a) else a.data_ptr()
                     for j, a in enumerate(args))

    def _plain(self, args, why: str):
        self._log(f"a call runs without its CUDA graph: {why}")
        metrics.count("cudagraph_plain_calls")
        return self.call(args)

    def _evict(self) -> bool:
        """Drops the least recently used address set whose outputs nobody holds."""
        for key, gens in self.recordings.items():
            if all(r.free() for r in gens):
                del self.recordings[key]
                return True
        return False

    def _record(self, args):
        static = list(args)
        copies = []
        for j in sorted(self.copied):
            if j < len(args) and _copyable(args[j]):
                static[j] = torch.empty_strided(args[j].shape, args[j].stride(), dtype=args[j].dtype, device=args[j].device)
                static[j].copy_(args[j])
                copies.append((j, static[j]))
        flag = torch.zeros((1,), dtype=torch.int32, device=self.device) if self.index_flag else None
        try:
            graph, outs = self._capture(static, {"index_flag": flag} if self.index_flag else {})
        except Exception as e:  # noqa: BLE001  (capture is illegal for something in the graph)
            self.broken = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self._log(f"runs without CUDA graphs: {self.broken}")
            metrics.count("cudagraph_capture_failures")
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001
                pass
            return None
        try:
            plan = _output_plan(outs, static, {j for j, _ in copies}, self.saved)
        except _Unrecordable as e:
            self.broken = str(e)
            self._log(f"runs without CUDA graphs: {self.broken}")
            return None
        # the pool's outputs stay referenced (their memory is the recording's); an output that
        # views an input must not be: it would hold the caller's storage, and with it the
        # recording that handed that storage out (a loss graph saving its logits input kept
        # the model's forward recording from ever replaying)
        outs = [None if entry[0] == "input" else o for o, entry in zip(outs, plan)]
        return _Recording(graph, outs, plan, flag, copies)

    def _capture(self, static: list, kw: dict):
        """A CUDA graph of one call on `static` (in a pool of its own), and the call's outputs."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
                outs = self.call(list(static), **kw)
            torch.cuda.current_stream().wait_stream(stream)
        return graph, outs

    def _log(self, text: str) -> None:
        if text not in self._logged:
            self._logged.add(text)
            print(f"[ferrocore:cudagraphs] {self.name} {text}", file=sys.stderr)


def _copyable(t) -> bool:
    """Whether a buffer of the same strides can hold a copy of `t` (no element seen twice)."""
    return isinstance(t, torch.Tensor) and is_dense(t.shape, t.stride())


class _Unrecordable(Exception):
    pass


def _output_plan(outs, args, copied=frozenset(), saved=frozenset()) -> list:
    """How each output is rebuilt after a replay: a plain value, a view of an input, or a view
    of the pool's bytes (outputs sharing a storage share one storage again). A saved activation
    that is a copied input is a view of the recording's copy, like pool memory: the backward's
    recording then finds it at the same address at every step."""
    inputs = {}
    for j, a in enumerate(args):
        inputs.setdefault(a.untyped_storage().data_ptr(), j)
    plan, keys = [], {}
    for i, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            plan.append(("value", o))
            continue
        st = o.untyped_storage()
        base = st.data_ptr()
        size, stride, offset = tuple(o.shape), tuple(o.stride()), o.storage_offset()
        if base in inputs and not (inputs[base] in copied and i in saved):
            j = inputs[base]
            if args[j].dtype != o.dtype:
                raise _Unrecordable(f"an output views input {j} as another dtype")
            # rebuilt from the caller's tensor at each replay, at the same distance into it (the
            # tensor itself where the call returned it: a parameter saved for the backward)
            plan.append(("input", j, size, stride, offset - args[j].storage_offset(), o is args[j]))
            continue
        key = keys.setdefault(base, len(keys))
        meta = {"size": size, "stride": stride, "storage_offset": offset, "dtype": o.dtype}
        plan.append(("pool", key, base, st.nbytes(), o.device, meta))
    return plan
