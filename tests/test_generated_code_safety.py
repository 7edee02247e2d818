"""Generated code is built, not pasted: hostile text in any field of an exchange-format graph
either is refused at import (a FerrocoreError naming the field) or reaches the wrapper module
as an escaped literal, so loading and calling the module executes nothing but the graph."""

import importlib.util
import json
import os

import pytest
import torch

import ferrocore
from ferrocore import _ferrocore


def _payloads(marker):
    """Text that runs `touch marker` wherever it is pasted into Python or C++ unescaped."""
    run = f"__import__('os').system('touch {marker}')"
    return [
        f"x'); {run} #",
        f'x"); {run} #',
        f"x\n{run}\n",
        f"x'''\n{run}\n'''",
        f'x"""\n{run}\n"""',
        f"x\\\n{run}",
        f"x\r{run}",
        f"*/ system(\"touch {marker}\"); /*",
        f"# {run}",
        f"\u202e{run}",
        f"\u2028{run}",
        f"{run}\\",
        "ctrl\x01\x00\ufeff\U0001f600",
    ]


def _meta(shape, dtype="float32", device="cpu"):
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return {"tensor": {"shape": shape, "stride": stride, "storage_offset": 0, "dtype": dtype, "device": device}}


def _doc(nodes, name="g"):
    return {"format": "ferrocore.graph", "version": 1, "name": name, "nodes": nodes}


def _unary_graph(target="aten.relu.default", args=None, kwargs=None, x="x", y="y", name="g"):
    """x -> target(x, *args, **kwargs) -> output."""
    call = {"name": y, "kind": "call_function", "target": target, "args": [{"node": x}] + (args or []),
            "kwargs": kwargs or {}, "meta": _meta([4])}
    return _doc([{"name": x, "kind": "placeholder", "meta": _meta([4])}, call,
                 {"name": "output", "kind": "output", "args": [{"node": y}]}], name)


def _compile(doc, tmp_path, debug=False):
    opts = {"cache_dir": str(tmp_path / "cache")}
    if debug:
        opts["debug_dir"] = str(tmp_path / "dumps")
    return json.loads(_ferrocore.compile_graph(json.dumps(doc), json.dumps(opts)))


def _load(result, tag):
    spec = importlib.util.spec_from_file_location(f"ferrocore_safety_{tag}", result["module_path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _only_expected_files(tmp_path):
    """Nothing was written outside the cache and dump directories."""
    return sorted(p.name for p in tmp_path.iterdir()) in ([], ["cache"], ["cache", "dumps"], ["dumps"])


@pytest.fixture
def marker(tmp_path):
    m = tmp_path / "MARKER"
    yield m
    assert not m.exists(), "a graph field was executed as code"


def _hostile_docs(p):
    """(field, graph) pairs that the importer must refuse."""
    x = {"name": "x", "kind": "placeholder", "meta": _meta([4])}
    out = {"name": "output", "kind": "output", "args": [{"node": "x"}]}
    return [
        ("graph name", _unary_graph(name=p)),
        ("placeholder name", _unary_graph(x=p)),
        ("node name", _unary_graph(y=p)),
        ("kwarg key", _unary_graph("aten.gelu.default", kwargs={p: {"str": "tanh"}})),
        ("kwarg key", _unary_graph("ferrocore_test.echo.default", args=[{"str": "s"}], kwargs={p: {"int": 1}})),
        ("layout", _unary_graph("aten.clone.default", kwargs={"memory_format": {"layout": p}})),
        ("memory_format", _unary_graph("aten.clone.default", kwargs={"memory_format": {"memory_format": p}})),
        ("device", _doc([{"name": "x", "kind": "placeholder", "meta": _meta([4], device=p)}, out])),
        ("device arg", _unary_graph("aten._to_copy.default", kwargs={"device": {"device": p}})),
        ("dtype", _doc([{"name": "x", "kind": "placeholder", "meta": _meta([4], dtype=p)}, out])),
        ("dtype arg", _unary_graph("aten._to_copy.default", kwargs={"dtype": {"dtype": p}})),
        ("target", _unary_graph(p)),
        ("padded_matmuls key", dict(_doc([x, out]), padded_matmuls={p: "why"})),
        ("sources key", dict(_doc([x, out]), sources={p: "File \"m.py\", line 1, in f"})),
    ]


@pytest.mark.parametrize("debug", [False, True])
def test_hostile_names_are_refused_before_any_file_is_written(tmp_path, marker, debug):
    for p in _payloads(marker):
        for field, doc in _hostile_docs(p):
            with pytest.raises(ferrocore.FerrocoreError, match="graph import"):
                _compile(doc, tmp_path, debug)
            assert _only_expected_files(tmp_path), (field, p)


def test_errors_name_the_refused_field():
    cases = [
        (_unary_graph(name="../up"), r"graph name '\.\./up' is not an identifier"),
        (_unary_graph(x="a b"), "node name 'a b' is not an identifier"),
        (_unary_graph("aten.gelu.default", kwargs={"approx": {"str": "tanh"}}),
         "node 'y'.*aten.gelu.default has no argument 'approx'"),
        (_unary_graph("aten.gelu.default", kwargs={"a=1, b": {"str": "tanh"}}), "node 'y'.*kwarg key 'a=1, b'"),
        (_unary_graph("aten.clone.default", kwargs={"memory_format": {"memory_format": "os"}}),
         "node 'y'.*unknown memory format 'os'"),
        (_unary_graph("aten.relu.import.default"), "node 'y'.*not an operator name"),
    ]
    for doc, message in cases:
        with pytest.raises(ferrocore.FerrocoreError, match=message):
            _ferrocore.compile_graph(json.dumps(doc), "{}")


_echoed = []


@torch.library.custom_op("ferrocore_test::echo", mutates_args=())
def _echo(x: torch.Tensor, s: str) -> torch.Tensor:
    _echoed.append(s)
    return x + 1


@_echo.register_fake
def _(x, s):
    return torch.empty_like(x)


@torch.library.custom_op("ferrocore_test::scale", mutates_args=())
def _scale(x: torch.Tensor, v: float) -> torch.Tensor:
    return x * v


@_scale.register_fake
def _(x, v):
    return torch.empty_like(x)


@pytest.mark.cpu_only("hand-made graphs that declare CPU tensors")
@pytest.mark.parametrize("debug", [False, True])
def test_hostile_strings_reach_a_library_call_exactly(tmp_path, marker, debug):
    """A string argument is a literal in the module: the custom op receives it byte for byte,
    positionally and as a keyword, and nothing else runs."""
    x = torch.randn(4)
    for i, p in enumerate(_payloads(marker)):
        for args, kwargs in [([{"str": p}], {}), ([], {"s": {"str": p}})]:
            result = _compile(_unary_graph("ferrocore_test.echo.default", args=args, kwargs=kwargs), tmp_path, debug)
            module = _load(result, f"echo_{debug}_{i}_{len(args)}")
            _echoed.clear()
            (y,) = module.call([x])
            assert _echoed == [p]
            torch.testing.assert_close(y, x + 1)
            assert _only_expected_files(tmp_path)


@pytest.mark.cpu_only("hand-made graphs that declare CPU tensors")
def test_hostile_fallback_string_is_escaped_in_code_and_comment(tmp_path, marker):
    """An unsupported gelu `approximate` falls back to ATen; the string is both an argument and
    part of the fallback's reason (a comment): torch rejects the value, nothing executes."""
    for i, p in enumerate(_payloads(marker)):
        result = _compile(_unary_graph("aten.gelu.default", kwargs={"approximate": {"str": p}}), tmp_path, debug=True)
        assert all(c == "\n" or " " <= c <= "~" for c in result["module_source"])
        module = _load(result, f"gelu_{i}")
        with pytest.raises(RuntimeError, match="approximate"):
            module.call([torch.randn(4)])
        assert _only_expected_files(tmp_path)


@pytest.mark.cpu_only("hand-made graphs that declare CPU tensors")
def test_hostile_source_lines_are_escaped_comments(tmp_path, marker):
    """A node's source line (from its stack trace: any text) becomes one escaped comment line
    before its kernel and its library call; the module computes the graph and runs nothing else."""
    x = torch.randn(4)
    for i, p in enumerate(_payloads(marker)):
        doc = _unary_graph("aten.relu.default")
        call = dict(doc["nodes"][1], name="mm", target="aten.mm.default", args=[{"node": "y"}, {"node": "y"}],
                    meta=_meta([4, 4]))
        doc["nodes"][0]["meta"] = doc["nodes"][1]["meta"] = _meta([4, 4])
        doc["nodes"].insert(2, call)
        doc["nodes"][3]["args"] = [{"node": "mm"}]
        doc["sources"] = {"y": p, "mm": p + " (mm)"}
        result = _compile(doc, tmp_path, debug=True)
        source = result["module_source"]
        assert all(c == "\n" or " " <= c <= "~" for c in source)
        assert source.count("    # graph nodes: ") == 2 and "# graph nodes: y\n" in source
        module = _load(result, f"source_{i}")
        a = torch.randn(4, 4)
        (out,) = module.call([a])
        torch.testing.assert_close(out, a.relu() @ a.relu())
        assert _only_expected_files(tmp_path)


def test_a_source_line_that_is_not_text_is_refused(tmp_path):
    doc = dict(_unary_graph(), sources={"y": 3})
    with pytest.raises(ferrocore.FerrocoreError, match="source line must be a string"):
        _compile(doc, tmp_path)


@pytest.mark.cpu_only("hand-made graphs that declare CPU tensors")
@pytest.mark.parametrize("name", [
    "torch", "call", "args", "reinterpret", "restride", "host_kernel", "owned_storage", "float", "IndexError", "buf0", "buf1", "buf2", "buf3",
    "arg1", "match", "class", "print", "_lib", "_r", "KERNEL_SOURCE", "launch_x", "cpp_poi_fused_add_0", "loc_buf1_0",
])
def test_inputs_named_like_the_modules_own_names_compute_right(tmp_path, name):
    """Placeholders named like names the module uses (imports, locals, builtins, generated
    buffer names, keywords) are renamed in the module and the graph still computes its value."""
    other = "arg0" if name != "arg0" else "z"
    nodes = [
        {"name": name, "kind": "placeholder", "meta": _meta([4])},
        {"name": other, "kind": "placeholder", "meta": _meta([4])},
        {"name": "add", "kind": "call_function", "target": "aten.add.Tensor",
         "args": [{"node": name}, {"node": other}], "meta": _meta([4])},
        {"name": "mm", "kind": "call_function", "target": "aten.mul.Tensor",
         "args": [{"node": "add"}, {"node": name}], "meta": _meta([4])},
        {"name": "output", "kind": "output", "args": [{"node": "mm"}, {"node": "add"}]},
    ]
    module = _load(_compile(_doc(nodes), tmp_path), f"shadow_{name}")
    a, b = torch.randn(4), torch.randn(4)
    mm, add = module.call([a, b])
    torch.testing.assert_close(add, a + b)
    torch.testing.assert_close(mm, (a + b) * a)


@pytest.mark.cpu_only("hand-made graphs that declare CPU tensors")
def test_float_arguments_at_the_edges_reach_kernels_and_library_calls_exactly(tmp_path):
    """Non-finite, signed-zero, denormal and extreme float64 scalars in a C++ kernel
    (`mul.Scalar`) and in a library call's Python arguments (a custom op) give eager's bits."""
    values = [float("inf"), float("-inf"), -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
              -1.7976931348623157e308, 0.1, 1e16]
    x = torch.tensor([0.0, -0.0, 1.0, -1.0], dtype=torch.float64)
    for i, v in enumerate(values):
        arg = {"float": "inf" if v == float("inf") else "-inf" if v == float("-inf") else v}
        for target in ["aten.mul.Scalar", "ferrocore_test.scale.default"]:
            doc = _unary_graph(target, args=[arg])
            for n in doc["nodes"][:2]:
                n["meta"] = _meta([4], "float64")
            result = _compile(doc, tmp_path)
            assert result["kernels"] == (1 if target == "aten.mul.Scalar" else 0)
            (y,) = _load(result, f"float_{i}_{target[:4]}").call([x.clone()])
            want = x * v
            assert torch.equal(y.isnan(), want.isnan()), (target, v)
            ok = ~want.isnan()
            assert torch.equal(y[ok], want[ok]) and torch.equal(y[ok].signbit(), want[ok].signbit()), (target, v, y, want)


def test_schema_argument_table_matches_torch():
    """The kwarg keys the importer accepts per ATen op are torch's schema names: the generated
    table (crates/ferrocore/src/graph/schema.rs) is up to date with ops.rs and this torch."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gen_schema_args.py"
    assert subprocess.run([sys.executable, str(script), "--check"]).returncode == 0, f"run {script}"
