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


def _compile(nodes, tmp_path):
    return _ferrocore.compile_graph(_graph(nodes), json.dumps({"cache_dir": str(tmp_path)}))


def _input(name, shape, stride=None, offset=0, dtype="float32"):
    meta = _meta(shape, dtype)
    if stride is not None:
        meta["tensor"]["stride"] = stride
    meta["tensor"]["storage_offset"] = offset
    return {"name": name, "kind": "placeholder", "meta": meta}


@pytest.mark.parametrize(
    "shape, stride, offset, why",
    [
        ([2**62, 4], [4, 1], 0, "more than 2\\^62 bytes"),  # numel wraps in int64
        ([3, 4], [-4, 1], 0, "negative stride"),
        ([3, 4], [4, 1], -2, "negative storage offset"),
        ([2, 4], [2**62, 1], 0, "stride past 2\\^62"),  # index overflow in generated code
        ([2], [1], 2**62 - 1, "past 2\\^62 bytes"),
    ],
)
def test_impossible_tensor_metadata_names_the_node(shape, stride, offset, why, tmp_path):
    nodes = [_input("x", shape, stride, offset), {"name": "output", "kind": "output", "args": [{"node": "x"}]}]
    with pytest.raises(ferrocore.FerrocoreError, match=f"graph import: node 'x': .*{why}"):
        _compile(nodes, tmp_path)


def test_size_zero_tensor_with_any_stride_is_accepted(tmp_path):
    # torch.empty_strided((0, 4), (2**62, 1)) exists: a tensor without elements addresses nothing
    nodes = [_input("x", [0, 4], [2**62, 1]),
             {"name": "y", "kind": "call_function", "target": "aten.mul.Tensor", "args": [{"node": "x"}, {"int": 2}],
              "meta": _meta([0, 4])},
             {"name": "output", "kind": "output", "args": [{"node": "y"}]}]
    result = json.loads(_compile(nodes, tmp_path))
    assert result["graph_fallback"] is None


@pytest.mark.parametrize("size", [[-1, -1], [-2, 6], [4, 3]])
def test_view_size_that_cannot_give_the_metadata_names_the_node(size, tmp_path):
    nodes = [_input("x", [2, 6]),
             {"name": "bad_view", "kind": "call_function", "target": "aten.view.default",
              "args": [{"node": "x"}, {"list": [{"int": d} for d in size]}], "meta": _meta([3, 4])},
             {"name": "output", "kind": "output", "args": [{"node": "bad_view"}]}]
    with pytest.raises(ferrocore.FerrocoreError, match="node 'bad_view'.*view size"):
        _compile(nodes, tmp_path)


def test_view_size_with_one_inferred_dim_is_accepted(tmp_path):
    nodes = [_input("x", [2, 6]),
             {"name": "v", "kind": "call_function", "target": "aten.view.default",
              "args": [{"node": "x"}, {"list": [{"int": 3}, {"int": -1}]}], "meta": _meta([3, 4])},
             {"name": "output", "kind": "output", "args": [{"node": "v"}]}]
    assert json.loads(_compile(nodes, tmp_path))["graph_fallback"] is None


@pytest.mark.parametrize("step, why", [({"int": 0}, "step must be nonzero"), ({"float": 0.0}, "step must be nonzero"),
                                       ({"float": "nan"}, "must be finite")])
def test_arange_with_zero_or_nan_step_names_the_node(step, why, tmp_path):
    nodes = [{"name": "bad_arange", "kind": "call_function", "target": "aten.arange.start_step",
              "args": [{"int": 0}, {"int": 10}, step], "meta": _meta([10])},
             {"name": "output", "kind": "output", "args": [{"node": "bad_arange"}]}]
    with pytest.raises(ferrocore.FerrocoreError, match=f"node 'bad_arange'.*{why}"):
        _compile(nodes, tmp_path)


@pytest.mark.parametrize(
    "target, dtypes, other, out",
    [
        ("aten.add.Tensor", ("float32", "float32"), None, "int64"),
        ("aten.mul.Tensor", ("int32", "int64"), None, "int32"),
        ("aten.lt.Tensor", ("float32", "float32"), None, "float32"),
        ("aten.div.Tensor", ("int64", "int64"), None, "int64"),
        ("aten.add.Tensor", ("float16",), {"float": 1.5}, "float32"),
    ],
)
def test_binary_result_dtype_contradicting_promotion_names_the_node(target, dtypes, other, out, tmp_path):
    nodes = [_input(f"x{i}", [4], dtype=d) for i, d in enumerate(dtypes)]
    args = [{"node": f"x{i}"} for i in range(len(dtypes))] + ([other] if other else [])
    nodes += [{"name": "bad_op", "kind": "call_function", "target": target, "args": args, "meta": _meta([4], out)},
              {"name": "output", "kind": "output", "args": [{"node": "bad_op"}]}]
    with pytest.raises(ferrocore.FerrocoreError, match="node 'bad_op'.*contradicts the operands' promotion"):
        _compile(nodes, tmp_path)


@pytest.mark.parametrize(
    "target, dtypes, other, out",
    [
        ("aten.add.Tensor", ("float32", "float16"), None, "float32"),
        ("aten.div.Tensor", ("int64", "int64"), None, "float32"),
        ("aten.div.Tensor", ("int64", "int64"), None, "float64"),  # under torch.set_default_dtype(float64)
        ("aten.mul.Tensor", ("int64",), {"float": 0.5}, "float32"),
        ("aten.eq.Tensor", ("int64", "float32"), None, "bool"),
    ],
)
def test_binary_result_dtype_following_promotion_is_accepted(target, dtypes, other, out, tmp_path):
    nodes = [_input(f"x{i}", [4], dtype=d) for i, d in enumerate(dtypes)]
    args = [{"node": f"x{i}"} for i in range(len(dtypes))] + ([other] if other else [])
    nodes += [{"name": "y", "kind": "call_function", "target": target, "args": args, "meta": _meta([4], out)},
              {"name": "output", "kind": "output", "args": [{"node": "y"}]}]
    assert json.loads(_compile(nodes, tmp_path))["graph_fallback"] is None


OVERSTATED = {
    "index_select": (lambda x, i: torch.index_select(x, 0, i), (torch.randn(5, 3), torch.tensor([0, 2]))),
    "gather": (lambda x, i: torch.gather(x, 1, i), (torch.randn(5, 3), torch.tensor([[0], [1], [2], [0], [1]]))),
    "index": (lambda x, i: x[i], (torch.randn(5, 3), torch.tensor([0, 2]))),
    "embedding": (lambda w, i: torch.nn.functional.embedding(i, w), (torch.randn(5, 3), torch.tensor([0, 2]))),
    "reflection_pad": (lambda x: torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect"), (torch.randn(1, 2, 5, 5),)),
    "select_scatter": (lambda x, s: torch.select_scatter(x, s, 0, 1), (torch.randn(3, 4), torch.randn(4))),
    "avg_pool": (lambda x: torch.nn.functional.avg_pool2d(x, 2), (torch.randn(2, 3, 8, 8),)),
    "masked_scatter": (lambda x, m, s: x.masked_scatter(m, s), (torch.randn(4, 3), torch.rand(4, 3) > 0.5, torch.randn(12))),
    "library_call": (lambda x, w: torch.nn.functional.conv2d(x, w, groups=4, padding=1),
                     (torch.randn(1, 4, 6, 6), torch.randn(4, 1, 3, 3))),
}


@pytest.mark.parametrize("name", list(OVERSTATED))
def test_metadata_overstating_a_result_never_reads_outside_a_buffer(name):
    # a gather whose metadata claimed 1000x its rows read past the index tensor (SIGSEGV or
    # garbage): now the node is refused by name, or (a library call) the call raises
    from torch.fx.experimental.proxy_tensor import make_fx

    fn, args = OVERSTATED[name]
    gm = make_fx(fn)(*args)
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "call_function" and isinstance(val, torch.Tensor) and val.dim():
            n.meta["val"] = torch.empty((val.shape[0] * 1000, *val.shape[1:]), dtype=val.dtype)
    with pytest.raises((ferrocore.FerrocoreError, RuntimeError), match="metadata"):
        ferrocore.compile_graph(gm)(*args)


def _compile_sin(**options):
    torch._dynamo.reset()
    return torch.compile(lambda x: x.sin() + 1, backend="ferrocore", options={"graph_cache": False, **options})(
        torch.randn(8))


@pytest.mark.cpu_only("C++ kernels and their cache")
def test_a_cache_directory_that_is_a_file_says_so(tmp_path):
    # it got the message about other users planting code
    path = tmp_path / "cache"
    path.write_text("not a directory")
    with pytest.raises(Exception, match="exists and is not a directory") as raised:
        _compile_sin(cache_dir=str(path))
    assert "plant" not in str(raised.value)


@pytest.mark.cpu_only("the C++ compiler")
def test_a_missing_cxx_says_how_to_get_one(tmp_path):
    with pytest.raises(Exception, match="install g\\+\\+, or set CXX"):
        _compile_sin(cxx=str(tmp_path / "no-such-g++"), cache_dir=str(tmp_path / "cache"))


def test_a_misspelt_log_channel_warns_once_per_process():
    import subprocess
    import sys

    program = ("import torch, ferrocore\n"
               "for f in (lambda x: x.sin() + 1, lambda x: x.cos() * 2):\n"
               "    torch.compile(f, backend='ferrocore')(torch.randn(8))\n")
    env = {**__import__("os").environ, "FERROCORE_LOGS": "fusoin"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("unknown channel 'fusoin'") == 1, done.stderr


def test_a_dynamic_graph_names_each_signature_after_its_compile():
    # the third signature's graph was `graph_2`, outside the naming scheme
    torch._dynamo.reset()
    ferrocore.metrics.reset()
    f = torch.compile(lambda x: x.exp() * 2, backend="ferrocore", dynamic=True, options={"graph_cache": False})
    names = []
    for n in (3, 17, 100):
        f(torch.randn(n))
        names.append(ferrocore.metrics.last["name"])
    # (names are numbered per process: earlier tests may have used this one)
    assert len(set(names)) == 3 and all(n.startswith("lambda_0_0_inference") for n in names), names
