"""ATen FX graph -> the exchange-format JSON (docs/exchange_format.md, version 1).

This module only encodes; it never decides what ferrocore can compile. It refuses, with
`UnsupportedGraph`, exactly the graphs version 1 cannot express (symbolic sizes, targets other
than ATen ops and getitem, non-tensor inputs or outputs, dtypes/devices/layouts the
format does not name); the backend then runs that graph eagerly.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import os
from typing import Any

import torch
import torch.fx

from .extension import extension

FORMAT = "ferrocore.graph"
VERSION = 1

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


class UnsupportedGraph(Exception):
    """The graph cannot be expressed in the exchange format; `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def serialize_graph(gm: torch.fx.GraphModule | torch.fx.Graph, name: str, output_strides: dict | None = None,
                    free_layout_outputs: list | None = None, padded_matmuls: dict | None = None,
                    donated_inputs: list | None = None, template_matmuls: dict | None = None) -> str:
    """The JSON document for `gm`, named `name`. Lifted tensor constants (`get_attr` nodes)
    become extra inputs after the graph's own: call with `args + lifted_constants(gm)`.
    `output_strides` ({node name: stride}) replaces the metadata strides of output nodes that
    must keep eager's layout (see `tracing._visible_output_strides`). `free_layout_outputs` lists
    the output positions whose layout the compiler may choose (activations a forward graph saves
    for its backward, which is compiled for the strides the forward reports). `padded_matmuls`
    ({GEMM node name: why}) names the GEMMs measured faster on padded operands
    (`padding.padded_matmuls`); `template_matmuls` those measured faster as matrix-product
    templates with their epilogue (`gemm_choice.template_matmuls`). `donated_inputs` lists the input positions whose storage the
    compiled graph may overwrite after their last read (a backward's donated saved tensors)."""
    doc = graph_to_dict(gm, name)
    if donated_inputs:
        doc["donated_inputs"] = sorted(int(i) for i in donated_inputs)
    if free_layout_outputs:
        doc["free_layout_outputs"] = sorted(int(i) for i in free_layout_outputs)
    if padded_matmuls:
        doc["padded_matmuls"] = {str(k): str(v) for k, v in padded_matmuls.items()}
    if template_matmuls:
        doc["template_matmuls"] = {str(k): str(v) for k, v in template_matmuls.items()}
    for node in doc["nodes"]:
        stride = (output_strides or {}).get(node["name"])
        tensor = (node.get("meta") or {}).get("tensor")
        if stride is not None and tensor is not None and len(stride) == len(tensor["stride"]):
            tensor["stride"] = list(stride)
    # allow_nan=False: a stray non-finite float must fail here, not as invalid JSON in Rust.
    return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def lifted_constants(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[torch.Tensor]:
    """The tensors behind the graph's `get_attr` nodes, in node order."""
    if not isinstance(gm, torch.fx.GraphModule):
        if any(n.op == "get_attr" for n in gm.nodes):
            raise UnsupportedGraph("a bare fx.Graph with get_attr nodes (no module to read them from)")
        return []
    out = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            out.append(_attr_value(gm, n))
    return out


def module_attr(module: torch.nn.Module, target: str, default: Any = None) -> Any:
    """The object a `get_attr` target ("sub.weight") names in `module`, or `default`."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, default)
        if obj is default:
            break
    return obj


def _attr_value(gm: torch.fx.GraphModule, n: torch.fx.Node) -> torch.Tensor:
    obj = module_attr(gm, str(n.target))
    if not isinstance(obj, torch.Tensor):
        raise UnsupportedGraph(f"node {n.name} is a get_attr of {_describe(obj)}, not a tensor")
    return obj


def graph_to_dict(gm: torch.fx.GraphModule | torch.fx.Graph, name: str) -> dict:
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    nodes = list(graph.nodes)
    constants = lifted_constants(gm)
    # placeholders refer to nothing: the lifted constants go right after the real inputs
    inputs = [_node(n) for n in nodes if n.op == "placeholder"]
    lifted = [n for n in nodes if n.op == "get_attr"]
    inputs += [_constant_input(n, t) for n, t in zip(lifted, constants)]
    rest = [_node(n) for n in nodes if n.op not in ("placeholder", "get_attr")]
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "nodes": inputs + rest,
    }
    sources = _sources(n for n in nodes if n.op == "call_function")
    if sources:
        doc["sources"] = sources
    return doc


def _sources(nodes) -> dict:
    """{node name: the model line it came from}: the innermost frame of each node's stack trace
    (which Dynamo records and the traces to ATen copy), for the generated module's comments."""
    out: dict = {}
    frames: dict = {}  # a decomposed op's nodes share one trace
    for n in nodes:
        trace = n.meta.get("stack_trace")
        if not isinstance(trace, str) or not trace:
            continue
        frame = frames.get(trace)
        if frame is None:
            frame = frames[trace] = _innermost_frame(trace)
        if frame:
            out[n.name] = frame
    return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _innermost_frame(trace: str) -> str:
    """`File "m.py", line 42, in forward: x = self.fc(x)` from a formatted stack trace: its
    innermost frame outside torch's own files (a `no_grad`-decorated forward's trace ends in
    torch's context-manager wrapper), else its innermost."""
    lines = trace.rstrip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        head = line.strip()
        if head.startswith("File "):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((head, f"{head}: {code}" if code and not code.startswith("File ") else head))
    for head, frame in reversed(frames):
        if _TORCH_DIR not in head:
            return frame
    return frames[-1][1] if frames else ""


def lend_forward_lines(graph: torch.fx.Graph) -> None:
    """A joint graph's backward nodes carry no stack trace: each takes the trace of the forward
    op whose gradient it computes (the first node of its autograd `seq_nr` that has one), so the
    backward's kernels and library calls name model lines too."""
    traces: dict = {}
    for n in graph.nodes:
        seq, trace = n.meta.get("seq_nr"), n.meta.get("stack_trace")
        if seq is not None and trace and seq not in traces:
            traces[seq] = trace
    for n in graph.nodes:
        if n.op == "call_function" and not n.meta.get("stack_trace") and n.meta.get("seq_nr") in traces:
            n.meta["stack_trace"] = traces[n.meta["seq_nr"]]


def _constant_input(n: torch.fx.Node, t: torch.Tensor) -> dict:
    return {"kind": "placeholder", "name": n.name, "meta": _meta(t, n)}


def _node(n: torch.fx.Node) -> dict:
    if n.op == "placeholder":
        val = n.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UnsupportedGraph(f"input {n.name} is a symbolic size ({val}): dynamic shapes")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedGraph(f"input {n.name} is not a tensor ({_describe(val)})")
        return {"kind": "placeholder", "name": n.name, "meta": _meta(val, n)}
    if n.op == "call_function" and n.target is torch.ops.prims.convert_element_type.default:
        # a dtype conversion some decompositions leave as a prim: the same as aten._to_copy
        x, dtype = n.args
        return {
            "kind": "call_function",
            "name": n.name,
            "target": "aten._to_copy.default",
            "args": [_arg(x, n)],
            "kwargs": {"dtype": _arg(dtype, n)},
            "meta": _meta(n.meta.get("val"), n),
        }
    if n.op == "call_function":
        return {
            "kind": "call_function",
            "name": n.name,
            "target": target_name(n),
            "args": [_arg(a, n) for a in n.args],
            "kwargs": {k: _arg(v, n) for k, v in n.kwargs.items()},
            "meta": _meta(n.meta.get("val"), n),
        }
    if n.op == "output":
        return {"kind": "output", "name": n.name, "args": _outputs(n)}
    # get_attr (lifted constants), call_module, call_method: no kind in version 1.
    raise UnsupportedGraph(f"node {n.name} is a {n.op} node")


def target_name(n: torch.fx.Node) -> str:
    """The exchange format's name of a call's target (`aten.add.Tensor`, `getitem`)."""
    t = n.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        # e.g. "aten.add.Tensor"; other namespaces (prims, custom ops) have no lowering and run
        # as logged per-node fallbacks through `torch.ops.<name>`
        return str(t)
    qualname = getattr(t, "__qualname__", None) or getattr(t, "__name__", repr(t))
    raise UnsupportedGraph(
        f"node {n.name} calls python:{getattr(t, '__module__', '?')}.{qualname}"
    )


def _outputs(n: torch.fx.Node) -> list:
    (flat,) = n.args
    if not isinstance(flat, (list, tuple)):
        flat = [flat]
    out = []
    for a in flat:
        if a is None:
            out.append(None)  # e.g. no gradient for an input in a backward graph
        elif isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append({"node": a.name})
        else:
            raise UnsupportedGraph(f"output {_describe(a)} is not a tensor")
    return out


def _meta(val: Any, n: torch.fx.Node) -> dict | None:
    if val is None:
        return None
    if isinstance(val, torch.Tensor):
        return {"tensor": _tensor_meta(val, n)}
    if isinstance(val, (tuple, list)):
        return {"tuple": [_meta(v, n) for v in val]}
    # bool before int: bool is an int subclass.
    for ty, tag in ((bool, "bool"), (int, "int"), (float, "float")):
        if type(val) is ty:
            return {"scalar": tag}
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise UnsupportedGraph(f"node {n.name} has a symbolic value {val}")
    raise UnsupportedGraph(f"node {n.name} produces {_describe(val)}")


def _tensor_meta(t: torch.Tensor, n: torch.fx.Node) -> dict:
    if t.layout != torch.strided:
        raise UnsupportedGraph(f"node {n.name} has layout {t.layout}")
    if t.device.type not in ("cpu", "cuda"):
        raise UnsupportedGraph(f"node {n.name} is on device {t.device}")
    if t.dtype not in _dtypes():
        raise UnsupportedGraph(f"node {n.name} has dtype {t.dtype}")
    return {
        "shape": [_concrete(s, n) for s in t.shape],
        "stride": [_concrete(s, n) for s in t.stride()],
        "storage_offset": _concrete(t.storage_offset(), n),
        "dtype": _dtype_name(t.dtype),
        "device": str(t.device),
    }


def _concrete(v: Any, n: torch.fx.Node) -> int:
    if type(v) is not int:
        raise UnsupportedGraph(f"node {n.name} has a symbolic size {v}")
    return v


def _arg(a: Any, n: torch.fx.Node) -> Any:
    if a is None:
        return None
    if isinstance(a, torch.fx.Node):
        return {"node": a.name}
    ty = type(a)
    if ty is bool:
        return {"bool": a}
    if ty is int:
        if not _I64_MIN <= a <= _I64_MAX:
            raise UnsupportedGraph(f"node {n.name} has an int argument {a} outside int64")
        return {"int": a}
    if ty is float:
        if math.isfinite(a):
            return {"float": a}
        return {"float": "nan" if math.isnan(a) else ("inf" if a > 0 else "-inf")}
    if ty is str:
        return {"str": a}
    if isinstance(a, (list, tuple)):
        return {"list": [_arg(x, n) for x in a]}
    if isinstance(a, torch.dtype):
        if a not in _dtypes():
            raise UnsupportedGraph(f"node {n.name} names dtype {a}")
        return {"dtype": _dtype_name(a)}
    if isinstance(a, torch.device):
        if a.type not in ("cpu", "cuda"):
            raise UnsupportedGraph(f"node {n.name} names device {a}")
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": _strip_torch(a)}
    if isinstance(a, torch.memory_format):
        return {"memory_format": _strip_torch(a)}
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise UnsupportedGraph(f"node {n.name} has a symbolic argument {a}")
    raise UnsupportedGraph(f"node {n.name} has an argument {_describe(a)}")


def _dtype_name(d: torch.dtype) -> str:
    return _strip_torch(d)


def _strip_torch(x: Any) -> str:
    s = str(x)
    return s[len("torch."):] if s.startswith("torch.") else s


# The float8 formats the importer knows (each falls back to ATen: kernels never touch them).
@functools.cache
def _dtypes() -> frozenset:
    """The dtypes the exchange format names: the compiler's table (`graph::DType::all`), those
    this torch has."""
    return frozenset(getattr(torch, name) for name in extension().dtype_names() if hasattr(torch, name))


def _describe(x: Any) -> str:
    if isinstance(x, torch.fx.Node):
        return f"node {x.name} ({_describe(x.meta.get('val'))})"
    if x is None:
        return "None"
    if isinstance(x, (bool, int, float, str)):
        return f"{type(x).__name__} {x!r}"
    return type(x).__name__
