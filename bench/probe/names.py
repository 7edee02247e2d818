"""Probe: hostile text in every field of an exchange-format graph. Each case is refused at
import, or compiles to a module that loads, runs and executes nothing but the graph (a payload
that got pasted into generated code would create a marker file).

    python bench/probe/names.py
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
try:
    import ferrocore  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import ferrocore  # noqa: E402
from ferrocore import _ferrocore  # noqa: E402

_echoed: list[str] = []


@torch.library.custom_op("ferrocore_probe::echo", mutates_args=())
def _echo(x: torch.Tensor, s: str) -> torch.Tensor:
    _echoed.append(s)
    return x + 1


@_echo.register_fake
def _(x, s):
    return torch.empty_like(x)


def _payloads(marker: pathlib.Path) -> list[tuple[str, str]]:
    run = f"__import__('os').system('touch {marker}')"
    return [
        ("quote-close", f"x'); {run} #"),
        ("dquote-close", f'x"); {run} #'),
        ("newline", f"x\n{run}\n"),
        ("triple-single", f"x'''\n{run}\n'''"),
        ("triple-double", f'x"""\n{run}\n"""'),
        ("backslash-newline", f"x\\\n{run}"),
        ("carriage-return", f"x\r{run}"),
        ("c-comment-close", f"*/ system(\"touch {marker}\"); /*"),
        ("hash", f"# {run}"),
        ("bidi-U+202E", f"\u202e{run}"),
        ("line-sep-U+2028", f"\u2028{run}"),
        ("trailing-backslash", f"{run}\\"),
        ("controls-nul-bom-astral", "ctrl\x01\x00\ufeff\U0001f600"),
    ]


def _meta(shape, dtype="float32", device="cpu"):
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return {"tensor": {"shape": shape, "stride": stride, "storage_offset": 0, "dtype": dtype, "device": device}}


def _graph(target="aten.relu.default", args=(), kwargs=None, x="x", y="y", name="g", x_meta=None):
    call = {"name": y, "kind": "call_function", "target": target, "args": [{"node": x}, *args],
            "kwargs": kwargs or {}, "meta": _meta([4])}
    return {"format": "ferrocore.graph", "version": 1, "name": name, "nodes": [
        {"name": x, "kind": "placeholder", "meta": x_meta or _meta([4])}, call,
        {"name": "output", "kind": "output", "args": [{"node": y}]}]}


def _fields(p: str) -> list[tuple[str, dict, str | None]]:
    """(field, graph, the string the echo op must receive or None)."""
    echo = "ferrocore_probe.echo.default"
    padded = _graph()
    padded["padded_matmuls"] = {p: "why"}
    return [
        ("graph name", _graph(name=p), None),
        ("placeholder name", _graph(x=p), None),
        ("node name", _graph(y=p), None),
        ("kwarg key (aten op)", _graph("aten.gelu.default", kwargs={p: {"str": "tanh"}}), None),
        ("kwarg key (custom op)", _graph(echo, args=[{"str": "s"}], kwargs={p: {"int": 1}}), None),
        ("layout", _graph("aten.clone.default", kwargs={"memory_format": {"layout": p}}), None),
        ("memory_format", _graph("aten.clone.default", kwargs={"memory_format": {"memory_format": p}}), None),
        ("device (meta)", _graph(x_meta=_meta([4], device=p)), None),
        ("device (arg)", _graph("aten._to_copy.default", kwargs={"device": {"device": p}}), None),
        ("dtype (meta)", _graph(x_meta=_meta([4], dtype=p)), None),
        ("dtype (arg)", _graph("aten._to_copy.default", kwargs={"dtype": {"dtype": p}}), None),
        ("target", _graph(p), None),
        ("padded_matmuls key", padded, None),
        ("str arg (custom op)", _graph(echo, args=[{"str": p}]), p),
        ("str kwarg (custom op)", _graph(echo, kwargs={"s": {"str": p}}), p),
        ("str arg (gelu fallback, comment)", _graph("aten.gelu.default", kwargs={"approximate": {"str": p}}), None),
    ]


def _attempt(doc: dict, expect_echo: str | None, tmp: pathlib.Path, tag: str, debug: bool) -> str:
    opts = {"cache_dir": str(tmp / "cache")}
    if debug:
        opts["debug_dir"] = str(tmp / "dumps")
    try:
        result = json.loads(_ferrocore.compile_graph(json.dumps(doc), json.dumps(opts)))
    except ferrocore.FerrocoreError as e:
        return "rejected: " + str(e).splitlines()[0][:110]
    try:
        spec = importlib.util.spec_from_file_location(f"ferrocore_probe_{tag}", result["module_path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the probe reports whatever happens
        return f"compiled, LOAD FAILED: {type(e).__name__}: {e}"[:140]
    _echoed.clear()
    try:
        module.call([torch.randn(4)])
        ran = "compiled, ran"
    except RuntimeError as e:
        ran = f"compiled, call raised torch's RuntimeError ({str(e).splitlines()[0][:60]})"
    if expect_echo is not None:
        ran += ", string arrived intact" if _echoed == [expect_echo] else f", STRING CHANGED: {_echoed!r}"
    return ran + ", nothing executed"


def run() -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        marker = tmp / "MARKER"
        for debug in (False, True):
            lines.append(f"-- debug dumps {'on' if debug else 'off'}")
            for label, p in _payloads(marker):
                for i, (field, doc, echo) in enumerate(_fields(p)):
                    outcome = _attempt(doc, echo, tmp, f"{debug:d}_{label.replace('-', '_').replace('+', '')}_{i}", debug)
                    if marker.exists():
                        outcome = "EXECUTED THE PAYLOAD: " + outcome
                        marker.unlink()
                    stray = sorted(q.name for q in tmp.iterdir() if q.name not in ("cache", "dumps"))
                    if stray:
                        outcome += f"; WROTE OUTSIDE ITS DIRECTORIES: {stray}"
                    lines.append(f"{label:24} {field:34} {outcome}")
    return lines


if __name__ == "__main__":
    print("\n".join(run()))
