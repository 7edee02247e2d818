"""Malformed input reaches Python as FerrocoreError naming the node; nothing panics across."""

import json

import pytest
import torch

import ferrocore
from ferrocore import _ferrocore


def _graph(nodes):
    return json.dumps({"format": "ferrocore.graph", "version": 1, "name": "bad", "nodes": nodes})


def _meta(shape, dtype="float32"):
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return {"tensor": {"shape": shape, "stride": stride, "storage_offset": 0, "dtype": dtype, "device": "cpu"}}


def test_unknown_dtype_names_the_node():
    g = _graph([{"name": "x", "kind": "placeholder", "meta": _meta([2], "float33")}])
    with pytest.raises(ferrocore.FerrocoreError, match="node 'x'.*unknown dtype 'float33'"):
        _ferrocore.compile_graph(g, "{}")


def test_dangling_reference_and_wrong_arity():
    x = {"name": "x", "kind": "placeholder", "meta": _meta([2])}
    bad_ref = {"name": "y", "kind": "call_function", "target": "aten.relu.default", "args": [{"node": "nope"}]}
    with pytest.raises(ferrocore.FerrocoreError, match="node 'y'.*unknown node 'nope'"):
        _ferrocore.compile_graph(_graph([x, bad_ref]), "{}")
    arity = {"name": "z", "kind": "call_function", "target": "aten.relu.default", "args": [{"node": "x"}, {"int": 1}]}
    with pytest.raises(ferrocore.FerrocoreError, match="node 'z'"):
        _ferrocore.compile_graph(_graph([x, arity]), "{}")


def test_inconsistent_shapes_name_the_node(tmp_path):
    nodes = [
        {"name": "a", "kind": "placeholder", "meta": _meta([4, 4])},
        {"name": "b", "kind": "placeholder", "meta": _meta([3, 4])},
        {"name": "bad_add", "kind": "call_function", "target": "aten.add.Tensor",
         "args": [{"node": "a"}, {"node": "b"}], "meta": _meta([4, 4])},
        {"name": "output", "kind": "output", "args": [{"node": "bad_add"}]},
    ]
    opts = json.dumps({"cache_dir": str(tmp_path)})
    with pytest.raises(ferrocore.FerrocoreError, match="bad_add.*broadcast"):
        _ferrocore.compile_graph(_graph(nodes), opts)


def test_garbage_is_an_error_not_a_crash():
    for text in ["", "{", "[]", '{"format": "ferrocore.graph", "version": 7}']:
        with pytest.raises(ferrocore.FerrocoreError):
            _ferrocore.compile_graph(text, "{}")
    with pytest.raises(ferrocore.FerrocoreError, match="invalid options"):
        _ferrocore.compile_graph(_graph([]), "{not json")


def test_float8_and_complex_arithmetic_fall_back_with_right_values():
    import ferrocore.metrics

    x = torch.randn(8, 8)
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        fn = lambda t: (t.to(f8).float() * 2).sum(0)  # noqa: E731
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, backend="ferrocore")(x), fn(x))
        assert ferrocore.metrics.last["fallback_ops"] == ["aten._to_copy.default"] * 2
    c = torch.randn(4, dtype=torch.complex64)
    fn = lambda t: (t * 2 + 1).abs()  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="ferrocore")(c), fn(c))
    assert ferrocore.metrics.last["fallbacks"] == 3
