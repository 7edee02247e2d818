"""Graph names that say what a graph is and stay the same from one process to the next: the
module or function Dynamo compiled, its compile id (frame, then recompile: tlparse's `[0/1]`)
and the graph's part, `fw`, `bw` or `inference` (`GPT2Model_0_0_fw`, `GPT2Model_0_0_bw`,
`f_1_0_inference`).
A later graph of the same compile (after a graph break, or a new input signature of a dynamic
graph) takes `_1`, `_2`, ... in the order it is compiled. Outside a Dynamo compile
(`ferrocore.compile_graph`) graphs are `graph_<n>`, counted per process.

Names end up in file names and generated code: they are identifiers (`[A-Za-z0-9_]`)."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import re

import torch

# the current Dynamo graph's base name (function and compile id), None outside one
_base: contextvars.ContextVar = contextvars.ContextVar("ferrocore_graph_base", default=None)
_counter = itertools.count()
_used: dict = {}

_FRAME = re.compile(r'File ".*", line \d+, in (\S+)')
_TORCH_DIR = os.path.dirname(torch.__file__)


def identifier(text: str) -> str:
    name = re.sub(r"\W", "_", text, flags=re.ASCII).strip("_")[:40]
    return ("f_" + name if name[:1].isdigit() else name) or "graph"


def function_name(gm: torch.fx.GraphModule) -> str:
    """What Dynamo compiled: a module's class (its `forward`, or torch's wrapper around a module
    call), else the function's name; the outermost frame of a node's stack trace when Dynamo
    does not say."""
    tx = _translator()
    code = getattr(tx, "f_code", None)
    if code is None or code.co_name == "forward" or code.co_filename.startswith(_TORCH_DIR):
        module = _root_module(gm, getattr(tx, "f_locals", None) or {})
        if module is not None:
            return identifier(module)
    if code is not None:
        return identifier(code.co_name)
    for n in gm.graph.nodes:
        match = _FRAME.search(n.meta.get("stack_trace") or "")
        if match:
            return identifier(match.group(1))
    return "graph"


def _translator():
    try:
        return torch._dynamo.symbolic_convert.InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not inside Dynamo's trace, or a Dynamo without it
        return None


def _root_module(gm: torch.fx.GraphModule, frame_locals: dict) -> str | None:
    """The class of the module the compiled frame runs: its `self` (a `forward`), or the module
    torch's call wrapper was handed (`fn`), as the frame's locals or `nn_module_stack` say."""
    for key in ("self", "fn"):
        if isinstance(frame_locals.get(key), torch.nn.Module):
            return type(frame_locals[key]).__name__
    for n in gm.graph.nodes:
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            if path in ("L['self']", "L['fn']"):
                return cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return None


def base_for(gm: torch.fx.GraphModule) -> str | None:
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - a Dynamo without compile ids
        compile_id = None
    if compile_id is None:
        return None
    ids = [getattr(compile_id, "frame_id", None), getattr(compile_id, "frame_compile_id", None)]
    return "_".join([function_name(gm)] + [str(i) for i in ids if i is not None])


@contextlib.contextmanager
def naming(base: str | None):
    """Graphs compiled inside are named after `base` (`base_for`)."""
    token = _base.set(base)
    try:
        yield
    finally:
        _base.reset(token)


def current_base() -> str | None:
    return _base.get()


def next_name(part: str) -> str:
    """The next graph's name: `<base>_<part>`, numbered from its second use on."""
    base = _base.get()
    if base is None:
        return f"graph_{next(_counter)}"
    name = f"{base}_{part}"
    seen = _used.get(name, 0)
    _used[name] = seen + 1
    return name if seen == 0 else f"{name}_{seen}"
