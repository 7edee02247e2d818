"""`mode="reduce-overhead"`: a compiled GPU graph's launches recorded once in a CUDA graph and
replayed, so that a call costs one graph launch instead of one host round per kernel.

A recording reads its inputs at the addresses it was recorded with and writes its outputs into
its own memory pool. Two rules keep that from ever giving a wrong answer:

- Parameters, buffers and saved activations are read where they live: a recording is keyed by
  their addresses, and a call whose such inputs live elsewhere records again (up to `MAX_KEYS`
  address sets; beyond that, the call runs the plain compiled wrapper). The other inputs (a
  batch, a backward's incoming gradients: `copied`, as the front names them) are copied into
  buffers of the recording's own before each replay, so that a new batch each step replays.
- Outputs handed to the caller are aliases of the pool (each a `detach` of the recording's own
  output tensor: no new storage per replay). A recording is replayed only when the use count of
  every pool storage is back to what the recording alone holds, so that no alias it handed out
  is still alive (a tensor, a view, a `.grad`, a saved activation autograd holds); otherwise a
  second recording of the same inputs (its own pool) is replayed, and when every recording's
  outputs are still held, the call runs the plain wrapper, which allocates fresh outputs. A
  later replay never overwrites memory the caller can still read.

A graph whose kernels check gather indices records its call with a flag of its own (the compiled
graph's `index_check`); a replay does not wait for it: the flag is read once the replay is done, at a later
call, which then raises IndexError, as eager CUDA reports a device-side assert asynchronously
(plain calls do the same through `runtime.GpuIndexCheck`). The flag is sticky.

Forward, backward and inference graphs whose every input is a tensor on the graph's GPU are
recorded. A forward's outputs are pool memory that autograd holds as saved activations until the
backward has run; the backward's recording reads them there (keyed by their addresses). CPU
tensors, ATen fallbacks, library calls that synchronize with the host (the compiled graph's
`cuda_graph_hazards`) and host-side checks run without CUDA graphs, logged once.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import artifact
from ..metrics import metrics
from ..strides import is_dense

# How many tensors (and Python storage objects) reference a storage, through a weak reference.
_use_count = torch._C._storage_Use_Count
_data_ptr = torch.Tensor.data_ptr

# Distinct input address sets recorded per graph, and recordings per address set.
MAX_KEYS = 8
GENERATIONS = 2


def blocker(compiled: dict, device, inputs_meta, host_scalars: bool) -> str | None:
    """Why this compiled graph (`artifact.py`) cannot run as a CUDA graph, or None when it can."""
    if device is None or device.type != "cuda":
        return "not a GPU graph"
    if host_scalars:
        # (their placeholders are declared on the GPU: the call copies them there)
        return "0-d CPU tensor inputs are copied to the GPU at each call"
    if artifact.runs_host_kernels(compiled):
        return "it runs C++ kernels on the host"
    # library calls that synchronize, ATen fallbacks of unknown capture safety
    unsafe = artifact.cuda_graph_hazard(compiled)
    if unsafe:
        return unsafe
    for i, val in enumerate(inputs_meta):
        if not isinstance(val, torch.Tensor):
            return f"input {i} is not a tensor"
        if val.device != device:
            return f"input {i} lives on {val.device}"
    return None


class _Recording:
    """One captured graph, the pool's outputs it hands out, and its index-check flag with the
    event after its last replay."""

    __slots__ = ("graph", "static_outputs", "plan", "held", "_weak", "flag", "seen", "replayed", "copies")

    def __init__(self, graph, static_outputs, plan, flag=None, copies=()):
        self.graph, self.static_outputs, self.plan = graph, static_outputs, plan
        # the pool's storages: weak references (`cdata`, kept alive by `_weak`) and the use counts
        # they have when nobody else holds them, counted at the first replay, once the
        # recording's own temporaries are gone
        self.held: tuple | None = None
        self._weak: list = []
        self.flag, self.replayed = flag, None
        # the flag as the last replay left it, copied to pinned host memory behind the replay:
        # reading the device flag would wait for every launch queued since (a backward's check
        # waited for its forward's replay)
        self.seen = torch.zeros((1,), dtype=torch.int32, device="cpu", pin_memory=True) if flag is not None else None
        # (input position, the recording's own buffer the graph reads it from)
        self.copies = copies

    def free(self) -> bool:
        """Whether no tensor over the pool's outputs lives outside this recording: a handed-out
        tensor, a view of one, a gradient autograd moved into `.grad`, a saved activation held
        by autograd (all of them reference the storage)."""
        if self.held is None:
            return True
        refs, alone = self.held
        return list(map(_use_count, refs)) == alone

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
        """The call's outputs: each pool output as a new tensor over the recording's own (a
        `detach`, no new storage: one C++ call each), each input view rebuilt from the caller's
        tensor."""
        if self.held is None:
            self._weak = _storage_refs(self.static_outputs)
            refs = [ref.cdata for ref in self._weak]
            self.held = (refs, list(map(_use_count, refs)))
        out = []
        for entry, static in zip(self.plan, self.static_outputs):
            kind = entry[0]
            if kind == "pool":
                out.append(static.detach())
            elif kind == "value":
                out.append(entry[1])
            else:
                _, j, size, stride, delta, itself = entry
                out.append(args[j] if itself else args[j].as_strided(size, stride, args[j].storage_offset() + delta))
        return out


def _storage_refs(static_outputs) -> list:
    """A weak reference to each storage under the pool's outputs (the Python storage objects
    made here are gone when it returns: their references would count)."""
    refs = {}
    for o in static_outputs:
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            refs.setdefault(st.data_ptr(), StorageWeakRef(st))
    return list(refs.values())


class Family:
    """The runners of one compiled function's graphs (its forward and its backward). A backward
    that writes results over donated saved activations finds them in its forward recording's
    pool, which keeps a reference to each of its outputs: its capture is told of them (`held`),
    so that they are overwritten in place as in a plain call, not copied first."""

    def __init__(self):
        self.runners: list = []

    def held(self) -> dict:
        """Storage data pointer -> how many of the recordings' own output tensors reference it."""
        held: dict = {}
        for runner in self.runners:
            for gens in runner.recordings.values():
                for rec in gens:
                    for o in rec.static_outputs:
                        if isinstance(o, torch.Tensor):
                            ptr = o.untyped_storage().data_ptr()
                            held[ptr] = held.get(ptr, 0) + 1
        return held


class CudaGraphRunner:
    """Wraps a compiled graph's boxed `call(args)`: the first call runs it plainly (kernels load,
    library handles initialize), later calls replay a recording for the inputs' addresses."""

    def __init__(self, call, name: str, device: torch.device, index_flag: bool = False, copied=(), saved=(),
                 donated_writes: bool = False, family: Family | None = None):
        self.call, self.name, self.device = call, name, device
        # the call takes `held` (it writes over donated inputs) and the runners it shares them with
        self.donated_writes = donated_writes
        self.family = family if family is not None else Family()
        self.family.runners.append(self)
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
        key = list(map(_data_ptr, args))
        for j in self.copied:
            if j < len(args) and _copyable(args[j]):
                a = args[j]
                key[j] = (tuple(a.shape), a.stride(), a.dtype)
        return tuple(key)

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
        kw = {"index_flag": flag} if self.index_flag else {}
        if self.donated_writes:
            kw["held"] = self.family.held()
        try:
            graph, outs = self._capture(static, kw)
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
    """How each output is handed out after a replay: a plain value, a view of an input, or the
    pool's output (the static output's own storage and layout). A saved activation
    that is a copied input is a view of the recording's copy, like pool memory: the backward's
    recording then finds it at the same address at every step."""
    inputs = {}
    for j, a in enumerate(args):
        inputs.setdefault(a.untyped_storage().data_ptr(), j)
    plan = []
    for i, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            plan.append(("value", o))
            continue
        base = o.untyped_storage().data_ptr()
        if base in inputs and not (inputs[base] in copied and i in saved):
            j = inputs[base]
            if args[j].dtype != o.dtype:
                raise _Unrecordable(f"an output views input {j} as another dtype")
            # rebuilt from the caller's tensor at each replay, at the same distance into it (the
            # tensor itself where the call returned it: a parameter saved for the backward)
            plan.append(("input", j, tuple(o.shape), tuple(o.stride()), o.storage_offset() - args[j].storage_offset(),
                         o is args[j]))
            continue
        plan.append(("pool",))
    return plan
