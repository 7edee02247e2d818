"""The Python front's FX -> exchange-format encoding (docs/exchange_format.md); no Rust needed.

Graphs are captured the way the backend sees them: dynamo + AOT autograd with the core ATen
decompositions, so a change in what torch hands over shows up here first.
"""

from __future__ import annotations

import importlib.util
import json
import operator
import sys
from pathlib import Path

import pytest
import torch
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

if importlib.util.find_spec("ferrocore") is None:  # not installed: use the source tree
    sys.path.append(str(Path(__file__).resolve().parent.parent / "python"))

from ferrocore.backend import compile_graph  # noqa: E402
from ferrocore.serialize import UnsupportedGraph, graph_to_dict, lifted_constants, serialize_graph  # noqa: E402

# The expected documents spell the CPU device; the encoder itself is the same on every device.
pytestmark = pytest.mark.cpu_only("expected documents name the CPU device")


def capture(fn, *inputs, dynamic=False):
    """The ATen graphs (forward, then backward if any) AOT autograd hands to a compiler."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=keep, bw_compiler=keep, decompositions=core_aten_decompositions()
    )
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.sum().backward()
    return graphs


def encode(gm, name="g"):
    """Encodes through the JSON text, rejecting the non-standard NaN/Infinity tokens."""

    def no_constants(token):
        raise AssertionError(f"non-standard JSON token {token}")

    doc = json.loads(serialize_graph(gm, name), parse_constant=no_constants)
    assert doc["format"] == "ferrocore.graph" and doc["version"] == 1 and doc["name"] == name
    return doc


def nodes_by_name(doc):
    return {n["name"]: n for n in doc["nodes"]}


def calls(doc):
    return [n for n in doc["nodes"] if n["kind"] == "call_function"]


def tensor(shape, stride, dtype="float32", offset=0, device="cpu"):
    return {
        "tensor": {
            "shape": shape,
            "stride": stride,
            "storage_offset": offset,
            "dtype": dtype,
            "device": device,
        }
    }


def test_add_scalar():
    (gm,) = capture(lambda x: x + 2.5, torch.randn(3, 4))
    doc = encode(gm, "graph_7")
    assert [n["kind"] for n in doc["nodes"]] == ["placeholder", "call_function", "output"]
    x, add, out = doc["nodes"]
    assert x == {"kind": "placeholder", "name": "arg0_1", "meta": tensor([3, 4], [4, 1])}
    assert add == {
        "kind": "call_function",
        "name": "add",
        "target": "aten.add.Tensor",
        "args": [{"node": "arg0_1"}, {"float": 2.5}],
        "kwargs": {},
        "meta": tensor([3, 4], [4, 1]),
    }
    assert out == {"kind": "output", "name": "output", "args": [{"node": "add"}]}


def test_softmax_int_and_bool_args():
    (gm,) = capture(lambda x: torch.softmax(x, -1), torch.randn(2, 8, dtype=torch.float64))
    (softmax,) = calls(encode(gm))
    assert softmax["target"] == "aten._softmax.default"
    assert softmax["args"] == [{"node": "arg0_1"}, {"int": -1}, {"bool": False}]
    assert softmax["meta"] == tensor([2, 8], [8, 1], dtype="float64")


def test_view_chain_strides_and_offset():
    (gm,) = capture(lambda x: x.view(4, 3).t()[1:], torch.randn(3, 4))
    doc = encode(gm)
    view, permute, sliced = calls(doc)
    assert view["target"] == "aten.view.default"
    assert view["args"][1] == {"list": [{"int": 4}, {"int": 3}]}
    assert permute["meta"] == tensor([3, 4], [1, 3])
    assert sliced["target"] == "aten.slice.Tensor"
    # The open end of `[1:]` is int64's maximum; it must survive as an exact integer.
    assert sliced["args"] == [{"node": "permute"}, {"int": 0}, {"int": 1}, {"int": 2**63 - 1}]
    assert sliced["meta"] == tensor([2, 4], [1, 3], offset=1)
    assert doc["nodes"][-1]["args"] == [{"node": sliced["name"]}]


def test_multi_output_ops_and_getitem():
    def fn(x):
        var, mean = torch.var_mean(x, dim=1)
        return var, mean, torch.nn.functional.layer_norm(x, (4,))

    (gm,) = capture(fn, torch.randn(3, 4))
    nodes = nodes_by_name(encode(gm))
    var_mean = nodes["var_mean"]
    assert var_mean["target"] == "aten.var_mean.correction"
    assert var_mean["kwargs"] == {"correction": {"int": 1}}
    assert var_mean["meta"] == {"tuple": [tensor([3], [1]), tensor([3], [1])]}
    assert nodes["getitem_1"]["target"] == "getitem"
    assert nodes["getitem_1"]["args"] == [{"node": "var_mean"}, {"int": 1}]

    layer_norm = nodes["native_layer_norm"]
    assert layer_norm["args"] == [
        {"node": "arg0_1"},
        {"list": [{"int": 4}]},
        None,
        None,
        {"float": 1e-05},
    ]
    assert layer_norm["meta"] == {
        "tuple": [tensor([3, 4], [4, 1]), tensor([3, 1], [1, 1]), tensor([3, 1], [1, 1])]
    }


def test_split_list_meta():
    (gm,) = capture(lambda x: torch.split(x, 2, dim=1), torch.randn(3, 4))
    split = nodes_by_name(encode(gm))["split_with_sizes"]
    assert split["meta"] == {"tuple": [tensor([3, 2], [4, 1]), tensor([3, 2], [4, 1], offset=2)]}


def test_full_non_finite_dtype_device_kwargs():
    def fn(x):
        return (
            torch.full((2, 3), float("inf"), dtype=torch.float64, device="cpu"),
            torch.full((2,), float("-inf")) + x.sum(),
            torch.full((1,), float("nan"), dtype=torch.float16),
        )

    (gm,) = capture(fn, torch.randn(3))
    full_inf, full_neg, full_nan = [n for n in calls(encode(gm)) if n["target"] == "aten.full.default"]
    assert full_inf["args"] == [{"list": [{"int": 2}, {"int": 3}]}, {"float": "inf"}]
    assert full_inf["kwargs"] == {
        "dtype": {"dtype": "float64"},
        "device": {"device": "cpu"},
        "pin_memory": {"bool": False},
    }
    assert full_inf["meta"] == tensor([2, 3], [3, 1], dtype="float64")
    assert full_neg["args"][1] == {"float": "-inf"}
    assert full_nan["args"][1] == {"float": "nan"}
    assert full_nan["kwargs"]["dtype"] == {"dtype": "float16"}


def test_layout_memory_format_and_dtype_conversion():
    def fn(x):
        return x.clone(memory_format=torch.channels_last), x.to(torch.int32), torch.zeros(3)

    (gm,) = capture(fn, torch.randn(2, 3, 4, 5))
    nodes = nodes_by_name(encode(gm))
    clone = nodes["clone"]
    assert clone["kwargs"] == {"memory_format": {"memory_format": "channels_last"}}
    assert clone["meta"] == tensor([2, 3, 4, 5], [60, 1, 15, 3])
    assert nodes["_to_copy"]["kwargs"] == {"dtype": {"dtype": "int32"}}
    assert nodes["_to_copy"]["meta"]["tensor"]["dtype"] == "int32"
    assert nodes["full"]["kwargs"]["layout"] == {"layout": "strided"}


def test_backward_graph_outputs_none_for_inputs_without_grad():
    w = torch.randn(4, requires_grad=True)
    forward, backward = capture(lambda x, y: (x * w * y).sum(), torch.randn(3, 4), torch.randn(3, 4))
    fw = encode(forward)
    # Saved tensors are returned as the placeholders themselves.
    assert {"node": "primals_1"} in fw["nodes"][-1]["args"]
    bw = encode(backward)
    assert [n["name"] for n in bw["nodes"] if n["kind"] == "placeholder"][-1] == "tangents_1"
    assert bw["nodes"][-1]["args"][-1] is None


def test_bool_and_int_meta_dtypes():
    (gm,) = capture(lambda x, i: (x > 0, i * 3), torch.randn(5), torch.arange(4, dtype=torch.int64))
    nodes = nodes_by_name(encode(gm))
    assert nodes["gt"]["meta"] == tensor([5], [1], dtype="bool")
    assert nodes["gt"]["args"][1] == {"int": 0}
    assert nodes["mul"]["meta"] == tensor([4], [1], dtype="int64")


# ----------------------------------------------------------------------------------------------
# Graphs version 1 cannot express: UnsupportedGraph, never a crash or a wrong document.


def test_dynamic_shapes_are_unsupported():
    graphs = capture(lambda x: x * 2, torch.randn(3, 4), dynamic=True)
    with pytest.raises(UnsupportedGraph, match="symbolic"):
        serialize_graph(graphs[0], "g")


def test_symbolic_tensor_size_is_unsupported():
    (gm,) = capture(lambda x: x * 2, torch.randn(3, 4), dynamic=True)
    symbolic = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    # A graph whose only input is the tensor, so the check on its own sizes is what fires.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = symbolic[0]
    graph.output((x,))
    with pytest.raises(UnsupportedGraph, match="symbolic size"):
        serialize_graph(graph, "g")


def _graph_with(target, args, val, kwargs=None):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3)
    y = graph.call_function(target, (x, *args), kwargs or {})
    y.meta["val"] = val
    graph.output((y,))
    return graph


def test_complex_and_wide_unsigned_inputs_are_encoded_and_uint4_is_not():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((x,))
    # (uint64: attention's RNG state, passed along by library calls)
    for dtype in (torch.complex32, torch.complex64, torch.uint16, torch.uint64):
        x.meta["val"] = torch.empty(3, dtype=dtype)
        doc = json.loads(serialize_graph(graph, "g"))
        assert doc["nodes"][0]["meta"]["tensor"]["dtype"] == str(dtype).removeprefix("torch.")
    x.meta["val"] = torch.empty(3, dtype=torch.uint4)
    with pytest.raises(UnsupportedGraph, match="uint4"):
        serialize_graph(graph, "g")


def test_python_target_is_unsupported():
    graph = _graph_with(torch.sin, (), torch.empty(3))
    with pytest.raises(UnsupportedGraph, match="python:torch.*sin"):
        serialize_graph(graph, "g")


def test_non_tensor_output_is_unsupported():
    graph = _graph_with(torch.ops.aten.sym_size.int, (0,), 3)
    with pytest.raises(UnsupportedGraph, match="not a tensor"):
        serialize_graph(graph, "g")


def test_get_attr_becomes_a_trailing_input():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("c")
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (x, c)),))
    x.meta["val"] = torch.empty(3)
    list(graph.nodes)[-2].meta["val"] = torch.empty(3)
    gm = torch.fx.GraphModule({"c": torch.arange(3.0)}, graph)
    doc = json.loads(serialize_graph(gm, "g"))
    kinds = [(n["kind"], n["name"]) for n in doc["nodes"]]
    assert kinds[:2] == [("placeholder", "x"), ("placeholder", "c")]
    assert [t.tolist() for t in lifted_constants(gm)] == [[0.0, 1.0, 2.0]]
    out = compile_graph(gm)(torch.ones(3))
    assert out[0].tolist() == [1.0, 2.0, 3.0]


def test_get_attr_of_a_bare_graph_is_unsupported():
    graph = torch.fx.Graph()
    graph.output((graph.get_attr("c"),))
    with pytest.raises(UnsupportedGraph, match="get_attr"):
        serialize_graph(graph, "g")


def test_unencodable_argument_is_unsupported():
    graph = _graph_with(torch.ops.aten.mul.Scalar, (1j,), torch.empty(3))
    with pytest.raises(UnsupportedGraph, match="complex"):
        serialize_graph(graph, "g")


def test_getitem_and_all_arg_kinds_by_hand():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 3).t()
    empty = graph.call_function(
        torch.ops.aten.empty.memory_format,
        ([2, 3],),
        {
            "dtype": torch.bfloat16,
            "layout": torch.strided,
            "device": torch.device("cpu"),
            "pin_memory": False,
            "memory_format": torch.preserve_format,
        },
    )
    empty.meta["val"] = torch.empty(2, 3, dtype=torch.bfloat16)
    item = graph.call_function(operator.getitem, (x, 0))
    item.meta["val"] = torch.empty(2)
    graph.output((empty, item))
    doc = graph_to_dict(graph, "by_hand")
    placeholder, empty_n, item_n, output = doc["nodes"]
    assert placeholder["meta"] == tensor([3, 2], [1, 3])
    assert empty_n["kwargs"] == {
        "dtype": {"dtype": "bfloat16"},
        "layout": {"layout": "strided"},
        "device": {"device": "cpu"},
        "pin_memory": {"bool": False},
        "memory_format": {"memory_format": "preserve_format"},
    }
    assert item_n["target"] == "getitem"
    assert output["args"] == [{"node": empty_n["name"]}, {"node": "getitem"}]


def test_non_aten_operator_becomes_a_node_fallback():
    graph = _graph_with(torch.ops.prims.sin.default, (), torch.empty(3))
    node = json.loads(serialize_graph(graph, "g"))["nodes"][1]
    assert node["target"] == "prims.sin.default"
    gm = torch.fx.GraphModule({}, graph)
    x = torch.randn(3)
    torch.testing.assert_close(compile_graph(gm)(x)[0], torch.sin(x))
    import ferrocore

    assert ferrocore.metrics.last["fallback_ops"] == ["prims.sin.default"]


def test_prims_convert_element_type_is_encoded_as_to_copy():
    graph = _graph_with(torch.ops.prims.convert_element_type.default, (torch.float64,), torch.empty(3, dtype=torch.float64))
    node = json.loads(serialize_graph(graph, "g"))["nodes"][1]
    assert node["target"] == "aten._to_copy.default" and node["kwargs"] == {"dtype": {"dtype": "float64"}}


def test_other_device_argument_is_unsupported():
    graph = _graph_with(
        torch.ops.aten._to_copy.default, (), torch.empty(3), {"device": torch.device("meta")}
    )
    with pytest.raises(UnsupportedGraph, match="device meta"):
        serialize_graph(graph, "g")


def test_a_nodes_source_line_is_its_innermost_frame_outside_torch():
    from ferrocore.serialize import _TORCH_DIR, _innermost_frame

    trace = ('  File "/w/model.py", line 66, in forward\n    x = self.block(x)\n'
             '  File "/w/block.py", line 12, in forward\n    return self.fc(x)\n'
             f'  File "{_TORCH_DIR}utils/_contextlib.py", line 120, in decorate_context\n'
             '    return func(*args, **kwargs)\n')
    assert _innermost_frame(trace) == 'File "/w/block.py", line 12, in forward: return self.fc(x)'
    only_torch = f'  File "{_TORCH_DIR}nn/modules/module.py", line 9, in _call_impl\n    return f(x)\n'
    assert _innermost_frame(only_torch).endswith("in _call_impl: return f(x)")
    assert _innermost_frame("no frames here") == ""
