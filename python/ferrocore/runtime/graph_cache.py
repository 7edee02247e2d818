"""The compiled-graph cache: a warm start loads what an earlier process compiled.

The key is the graph Dynamo hands the backend (its generated code and constants), the inputs'
metadata, the global state that changes what AOT autograd traces (grad mode, autocast, default
dtype, matmul precision, threads), the options, and the versions of ferrocore, torch, Triton
and the C++ compiler. An entry holds each compiled ATen graph (wrapper source, lifted constants,
where host scalars go) and what AOT autograd's runtime would do around them (`aot_runtime`). A
hit skips AOT autograd, lowering, scheduling, code generation and kernel compilation: the wrapper
modules run from the entry and load their kernels from their own caches.

Entries go through the Rust cache (`runtime/cache.rs`): written atomically, signed, verified on
every read; a missing, truncated, edited or stale entry is a miss and is rebuilt. Only graphs
whose AOT runtime `aot_runtime` can rebuild are stored: an inference graph, or a training graph
(forward and backward, stored once the backward is compiled), with no outputs aliasing inputs,
no input mutations applied outside the graph, no tensor subclasses, effect tokens or duplicated
inputs; anything else is a logged bypass.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from dataclasses import dataclass, field

import torch
from torch._functorch import config as functorch_config
from torch._subclasses.fake_tensor import FakeTensor

from ..serialize import module_attr
from . import aliasing
from .cache import read_cached_json, write_cached_json
from .versions import versions

# Bumped whenever an entry's layout or meaning changes: older entries are then misses.
FORMAT = 4

# Modules whose functions may appear as call targets of a cached graph: their behaviour is
# covered by the versions in the key. A user function (allow_in_graph) is not.
_KNOWN_MODULES = ("torch", "operator", "_operator", "math", "builtins", "einops")

# A graph constant larger than this is not hashed into the key; the graph is not cached.
_MAX_CONSTANT_BYTES = 1 << 20


class Bypass(Exception):
    """The graph cannot be cached; the message says why (logged on `graph_cache`)."""


# an entry's kind, how many compiled graphs it holds, and their parts (as graphs are named)
ENTRY_GRAPHS = {"inference": 1, "training": 2}
ENTRY_PARTS = {"inference": ("inference",), "training": ("fw", "bw")}


@dataclass
class CompiledGraph:
    """One compiled ATen graph, as the front runs it: everything `static_compile.load_graph` needs."""

    name: str
    module_path: str
    module_source: str
    artifact: str  # the compiled graph's JSON text (`artifact.py`): what the runtime reads about it
    artifact_path: str  # where the kernel cache holds it, serialized
    options: str  # the options JSON the module was compiled (and is imported) with
    device: str | None  # the graph's GPU device, None on the CPU
    host_scalars: list = field(default_factory=list)  # 0-d CPU inputs moved to the device
    gpu_scalars: list = field(default_factory=list)  # 0-d inputs declared on the device
    constants: list = field(default_factory=list)  # lifted constants, appended to the inputs
    counts: dict = field(default_factory=dict)  # kernels, externs, fallbacks... for metrics

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["constants"] = [_tensor_text(t) for t in self.constants]
        return d

    @staticmethod
    def from_json(d: dict) -> "CompiledGraph":
        d = dict(d)
        d["constants"] = [_tensor_from_text(t) for t in d["constants"]]
        return CompiledGraph(**d)


def _tensor_text(t: torch.Tensor) -> dict:
    dense = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "stride": list(t.stride()),
            "device": str(t.device), "data": base64.b64encode(_bytes_of(dense)).decode()}


def _tensor_from_text(d: dict) -> torch.Tensor:
    # Built from bytes, not torch.load: inside Dynamo's compile, torch.load returns meta tensors.
    dtype = getattr(torch, d["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {d['dtype']}")
    data = bytearray(base64.b64decode(d["data"]))
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out = torch.empty_strided(d["shape"], d["stride"], dtype=dtype, device="cpu")
    out.copy_(flat.view(dtype).reshape(d["shape"]))
    return out.to(d["device"])


def _bytes_of(dense: torch.Tensor) -> bytes:
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes() if dense.numel() else b""


# ---- the key ----------------------------------------------------------------------------------

UNKEYED_OPTIONS = ("compile_workers", "progress", "cpp_jobs")


def key(gm: torch.fx.GraphModule, example_inputs, opts: dict) -> str:
    """The entry's key for this graph, inputs and options; raises Bypass for a graph the cache
    cannot vouch for."""
    h = hashlib.sha256()

    def put(*parts) -> None:
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")

    put("format", FORMAT, *versions())
    # logs and dumps are part of the key: asking for them asks for a compile that prints them;
    # how many processes compile kernels changes nothing that is stored
    put(json.dumps({k: v for k, v in opts.items() if k not in UNKEYED_OPTIONS}, sort_keys=True))
    put(*global_state())
    _put_graph(put, gm, "graph")
    seen: dict = {}
    for i, x in enumerate(example_inputs):
        put(f"input {i}")
        if isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter) and not _is_fake(x):
                raise Bypass(f"input {i} is a {type(x).__name__}")
            if id(x) in seen:
                raise Bypass(f"input {i} is input {seen[id(x)]} again")
            seen[id(x)] = i
            put(tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device, x.requires_grad,
                isinstance(x, torch.nn.Parameter))
        elif isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise Bypass(f"input {i} is symbolic")
        elif isinstance(x, (bool, int, float)) or x is None:
            put(type(x).__name__, repr(x))
        else:
            raise Bypass(f"input {i} is a {type(x).__name__}")
    # an entry is compiled for inputs that do not overlap (`aliasing` checks it at every call);
    # AOT autograd compiles overlapping ones into another graph and runtime
    overlaps = aliasing.overlapping(example_inputs)
    if overlaps:
        raise Bypass(f"inputs {aliasing.describe(overlaps)} overlap in memory")
    return h.hexdigest()


def _is_fake(x) -> bool:
    return isinstance(x, FakeTensor)


def _put_graph(put, gm: torch.fx.GraphModule, path: str) -> None:
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        raise Bypass(f"{path} holds parameters or buffers")
    put(path, _graph_text(gm))
    for n in gm.graph.nodes:
        if n.op == "call_module":
            raise Bypass(f"node {n.name} calls a module")
        if n.op == "call_function":
            module = getattr(n.target, "__module__", None) or ""
            if not isinstance(n.target, torch._ops.OpOverload) and module.split(".")[0] not in _KNOWN_MODULES:
                raise Bypass(f"node {n.name} calls {module}.{getattr(n.target, '__name__', n.target)}")
        if n.op == "get_attr":
            value = module_attr(gm, n.target)
            if isinstance(value, torch.fx.GraphModule):
                _put_graph(put, value, f"{path}.{n.target}")
            elif isinstance(value, torch.Tensor):
                if value.numel() * value.element_size() > _MAX_CONSTANT_BYTES:
                    raise Bypass(f"constant {n.target} is larger than {_MAX_CONSTANT_BYTES} bytes")
                dense = value.detach().cpu().contiguous()
                put(n.target, tuple(value.shape), value.stride(), value.dtype, value.device,
                    hashlib.sha256(_bytes_of(dense)).hexdigest())
            else:
                raise Bypass(f"attribute {n.target} is a {type(value).__name__}")


# argument types whose repr says all there is (floats tell 0.0 from -0.0, bools from ints by type)
_PLAIN = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


class _NotPlain(Exception):
    pass


def _graph_text(gm: torch.fx.GraphModule) -> str:
    """What the graph computes, as text: each node's op, name, target and arguments. Generating
    the graph's Python code says the same but costs ten times more (a warm start pays it too);
    a graph with an argument this does not spell out is keyed by its code."""
    try:
        lines = [type(gm.graph._codegen).__qualname__, repr(getattr(gm.graph._codegen, "pytree_info", None))]
        for n in gm.graph.nodes:
            lines.append(f"{n.op} {n.name} {_target_text(n)} {_arg_text(n.args)} {_arg_text(n.kwargs)}")
        return "\n".join(lines)
    except _NotPlain:
        return gm.code


def _target_text(n: torch.fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    return f"{getattr(t, '__module__', None)}.{getattr(t, '__qualname__', None) or getattr(t, '__name__', repr(t))}"


def _arg_text(a) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return f"{type(a).__name__}({','.join(map(_arg_text, a))})"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k!r}:{_arg_text(v)}" for k, v in a.items()) + "}"
    if isinstance(a, slice):
        return f"slice({_arg_text(a.start)},{_arg_text(a.stop)},{_arg_text(a.step)})"
    if type(a) in _PLAIN:
        return f"{type(a).__name__}:{a!r}"
    raise _NotPlain


def global_state() -> tuple:
    """State outside the graph that changes what AOT autograd traces or how kernels are chosen."""
    autocast = tuple(
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")
    )
    return (
        torch.is_grad_enabled(), autocast, torch.get_default_dtype(), torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32, torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(),
        *_functorch_config(),
    )


def _functorch_config() -> list:
    """AOT autograd's settings (partitioner, donated buffers, tangent layouts): a training
    graph's forward and backward depend on them."""
    out = []
    for name, value in sorted(functorch_config.get_config_copy().items()):
        if name.startswith("_"):
            continue
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise Bypass(f"torch._functorch.config.{name} is a {type(value).__name__}")
        out.append(f"{name}={value!r}")
    return out


# ---- storing and loading ----------------------------------------------------------------------


def _rel(k: str) -> str:
    return f"compiled/{k[:2]}/{k}.json"


def load(cache_dir: str, k: str) -> dict | None:
    """The verified entry for key `k`, or None (missing, corrupt, another format or key)."""
    entry = read_cached_json(cache_dir, _rel(k))
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != k:
        return None
    try:
        entry["graphs"] = [CompiledGraph.from_json(g) for g in entry["graphs"]]
    except (TypeError, KeyError, ValueError, RuntimeError):
        return None
    return entry


def store(cache_dir: str, k: str, kind: str, runtime: dict, graphs: list) -> None:
    entry = {"format": FORMAT, "key": k, "kind": kind, "runtime": runtime,
             "graphs": [g.to_json() for g in graphs]}
    write_cached_json(cache_dir, _rel(k), entry)


def log(opts: dict, text: str) -> None:
    if "graph_cache" in opts.get("logs", ()):
        print(f"[ferrocore:graph_cache] {text}", file=sys.stderr)
