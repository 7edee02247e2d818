"""The Python front around a stand-in for the Rust extension: backend plumbing, graph fallback,
metrics, options and the runtime helpers. The real extension is exercised by tests/test_e2e*.py.
"""

from __future__ import annotations

import os
import re
import shutil
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("ferrocore") is None:  # not installed: use the source tree
    sys.path.append(str(Path(__file__).resolve().parent.parent / "python"))

import ferrocore  # noqa: E402
from ferrocore import options  # noqa: E402
from ferrocore.backend import ferrocore_backend  # noqa: E402
from ferrocore.extension import extension  # noqa: E402
from ferrocore.runtime import report, wrapper  # noqa: E402

_COMPILER = extension()  # the real extension, before a test stands in for it


class FakeExtension:
    """Writes a wrapper module that runs the graph eagerly, and answers like compile_graph."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.graphs = []  # (graph document, options) per compile_graph call
        self.cpp_options = []

    class CompileProgress:
        def snapshot(self):
            return ("", 0, 0)

    class FerrocoreError(Exception):
        pass

    def default_cache_dir(self) -> str:
        return os.environ["FERROCORE_CACHE_DIR"]  # (the fixture sets it)

    def option_schema(self) -> str:
        return _COMPILER.option_schema()  # the options as the compiler states them

    def dtype_names(self) -> list:
        return _COMPILER.dtype_names()

    def cache_read(self, cache_dir: str, rel: str):
        return None  # (the module's bytecode: compiled each time)

    def cache_write(self, cache_dir: str, rel: str, data: bytes) -> None:
        pass

    def compile_graph(self, graph_json: str, options_json: str, progress=None) -> str:
        doc = json.loads(graph_json)
        self.graphs.append((doc, json.loads(options_json)))
        path = self.tmp_path / f"{doc['name']}.py"
        # The module loads "kernels" at import, like a real wrapper, then runs the graph eagerly.
        path.write_text(
            "import sys\n"
            "from ferrocore.runtime.cpp_library import load_kernels\n"
            "lib = load_kernels('// kernels')\n"
            "def call(args):\n"
            f"    return sys.modules['fake_front_graphs'][{doc['name']!r}](args)\n"
        )
        return json.dumps(
            {
                "module_path": str(path),
                "module_source": path.read_text(),
                "kernels": 2,
                "externs": 1,
                "fallbacks": [{"node": "x", "target": "aten.foo.default", "reason": "test"}],
                "timings_ms": {"lowering": 1.0, "cpp_compile": 5.0},
                "cpp_cache_hit": True,
                "logs": [{"channel": "output_code", "text": "def call(args): ...\n"}],
                # the compiled graph: two C++ kernels, no Triton flag, nothing donated
                "artifact": json.dumps({"language": "cpp", "unit": {"source": "// kernels", "prelude": {"start": 0, "end": 0}},
                                        "kernels": [], "index_check": None, "donated_writes": [], "cuda_graph_hazards": []}),
                "artifact_path": str(path.with_suffix(".graph.json")),
            }
        )

    def load_cpp(self, source: str, options_json: str):
        self.cpp_options.append(json.loads(options_json))
        # a library in a directory of its own, handed over open, as the real one is
        path = self.tmp_path / "libm.so"
        if not path.exists():
            shutil.copy(_libm_path(), path)
        return str(path), os.open(path, os.O_RDONLY), True


def _libm_path() -> str:
    """The file of the libm this process has loaded."""
    import re

    found = re.search(r"(/\S*libm\.so[.0-9]*)$", Path("/proc/self/maps").read_text(), re.MULTILINE)
    return found.group(1) if found else "/lib/x86_64-linux-gnu/libm.so.6"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    ext = FakeExtension(tmp_path)
    monkeypatch.setattr(ferrocore, "_ferrocore", ext, raising=False)
    # Keep each graph so the stand-in wrapper can run it: serialize -> remember the FX module.
    graphs = {}
    import ferrocore.static_compile as static_compile

    serialize = static_compile.serialize_graph

    def remembering(gm, name, *args, **kwargs):
        doc = serialize(gm, name, *args, **kwargs)
        graphs[name] = lambda args: gm(*args)
        return doc

    monkeypatch.setattr(static_compile, "serialize_graph", remembering)
    monkeypatch.setitem(sys.modules, "fake_front_graphs", graphs)
    monkeypatch.setenv("FERROCORE_LOGS", "output_code,fallback")
    monkeypatch.setenv("FERROCORE_CACHE_DIR", str(tmp_path / "cache"))
    # the stand-in has no cache of its own to keep compiled graphs in
    monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")
    ferrocore.metrics.reset()
    return ext


def test_entry_point_is_declared_for_dynamo():
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert "[project.entry-points.torch_dynamo_backends]" in text
    assert 'ferrocore = "ferrocore.backend:ferrocore_backend"' in text


def test_compiles_through_the_extension(fake, capfd):
    fn = torch.compile(lambda x: torch.relu(x) * 2, backend=ferrocore_backend, dynamic=False)
    x = torch.randn(4, 5)
    torch.testing.assert_close(fn(x), torch.relu(x) * 2)

    (doc, opts), = fake.graphs
    assert doc["nodes"][1]["target"] == "aten.relu.default"
    assert opts["logs"] == ["output_code", "fallback"]
    # The wrapper's kernels are looked up with the options of the compile importing it.
    assert fake.cpp_options == [opts]

    last = ferrocore.metrics.last
    assert (last["kernels"], last["externs"], last["fallbacks"]) == (2, 1, 1)
    assert last["fallback_ops"] == ["aten.foo.default"]
    assert last["graph_fallback"] is False and last["cpp_cache_hit"] is True
    assert {"trace", "serialize", "lowering", "cpp_compile", "load"} <= set(last["timings_ms"])
    assert ferrocore.metrics.total["graphs"] == 1
    # the block names its graph and the module's file
    header = f"[ferrocore:output_code] {last['name']} ({last['module_path']})\ndef call(args): ..."
    assert header in capfd.readouterr().err


def test_training_compiles_forward_and_backward(fake):
    x = torch.randn(3, 5)
    w = torch.randn(5, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    fn = torch.compile(lambda x: (x * w).sin().sum(), backend=ferrocore_backend, dynamic=False)
    fn(x).backward()
    (x * w_ref).sin().sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    assert len(fake.graphs) == 2  # forward and backward
    assert ferrocore.metrics.total["graphs"] == 2
    assert ferrocore.metrics.total["kernels"] == 4


def test_a_compile_defers_full_collections_and_restores_the_collector(fake, monkeypatch):
    import contextlib
    import gc

    from ferrocore import backend, tracing

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with tracing.collector_spared():
        if frozen == 0 and gc.isenabled():
            assert gc.get_threshold()[2] == max(before[2], tracing._FULL_COLLECTION_DEFERRED)
            assert gc.get_freeze_count() > 0
        else:  # the program's own settings stand
            assert (gc.get_threshold(), gc.get_freeze_count()) == (before, frozen)
    assert (gc.get_threshold(), gc.get_freeze_count()) == (before, frozen)
    gc.disable()
    try:
        with tracing.collector_spared():
            assert (gc.get_threshold(), gc.get_freeze_count()) == (before, frozen)
    finally:
        gc.enable()

    # every backend call runs inside it
    entered, calls = [], []
    spared, compile_graph = backend.collector_spared, backend._compile_dynamo_graph

    @contextlib.contextmanager
    def counted():
        entered.append(True)
        with spared():
            yield

    def counted_compile(*args):
        calls.append(True)
        return compile_graph(*args)

    monkeypatch.setattr(backend, "collector_spared", counted)
    monkeypatch.setattr(backend, "_compile_dynamo_graph", counted_compile)
    fn = torch.compile(lambda x: x.cos() + 1, backend=ferrocore_backend, dynamic=False)
    x = torch.randn(4)
    torch.testing.assert_close(fn(x), x.cos() + 1)
    assert calls and len(entered) == len(calls)


def test_symbolic_graph_is_specialized_to_the_call_shapes(fake):
    fn = torch.compile(lambda x: x.cos() + 1, backend=ferrocore_backend, dynamic=True)
    x = torch.randn(6)
    torch.testing.assert_close(fn(x), x.cos() + 1)
    (graph, _options), = fake.graphs
    inputs = [n for n in graph["nodes"] if n["kind"] == "placeholder"]
    assert [n["meta"]["tensor"]["shape"] for n in inputs] == [[6]]  # the SymInt input is bound
    assert ferrocore.metrics.last["graph_fallback"] is False


def test_extension_errors_propagate(fake, monkeypatch):
    class Broken(Exception):
        pass

    def fail(graph_json, options_json, progress=None):
        raise Broken("node add: malformed")

    monkeypatch.setattr(fake, "compile_graph", fail)
    fn = torch.compile(lambda x: x + 1, backend=ferrocore_backend, dynamic=False)
    with pytest.raises(Exception, match="node add: malformed"):
        fn(torch.randn(3))


def test_torch_compile_options_and_mode_are_accepted(fake, tmp_path):
    fn = torch.compile(
        lambda x: x * 3,
        backend=ferrocore_backend,
        dynamic=False,
        options={"cxx": "clang++", "logs": ["graph"], "debug_dir": tmp_path / "dumps", "cpp_jobs": 2},
    )
    fn(torch.randn(2))
    (_, opts), = fake.graphs
    assert opts["cxx"] == "clang++" and opts["logs"] == ["graph"] and opts["cpp_jobs"] == 2
    assert opts["debug_dir"] == str(tmp_path / "dumps")
    fn = torch.compile(lambda x: x * 4, backend=ferrocore_backend, dynamic=False, mode="default")
    fn(torch.randn(2))


def test_an_unusable_debug_dir_raises_an_error_naming_it(fake, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    fn = torch.compile(lambda x: x * 6, backend=ferrocore_backend, dynamic=False,
                       options={"debug_dir": str(blocker / "dumps")})
    with pytest.raises(Exception, match=re.escape("option 'debug_dir' (FERROCORE_DEBUG_DIR): cannot make")):
        fn(torch.randn(2))
    monkeypatch.setenv("FERROCORE_DEBUG_DIR", str(blocker))  # a file, not a directory
    with pytest.raises(options.OptionError, match="debug_dir"):
        options.build_options()
    monkeypatch.setenv("FERROCORE_DEBUG_DIR", str(tmp_path / "new" / "dumps"))
    assert options.build_options()["debug_dir"] == str(tmp_path / "new" / "dumps")
    assert (tmp_path / "new" / "dumps").is_dir()


def test_a_debug_dir_others_may_write_into_is_refused(tmp_path, monkeypatch):
    # as the cache: a world-writable folder (the README's example was /tmp/fc) lets another user
    # plant links at the dump names, which are the same in every process
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("FERROCORE_DEBUG_DIR", str(shared))
    with pytest.raises(options.OptionError, match="others may write into"):
        options.build_options()
    monkeypatch.setenv("FERROCORE_DEBUG_DIR", str(tmp_path / "mine"))
    options.build_options()
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700


def test_a_symlink_planted_at_a_graph_dump_name_is_not_written_through(tmp_path, monkeypatch):
    import itertools

    from torch.fx.experimental.proxy_tensor import make_fx

    from ferrocore import graph_names

    gm = make_fx(lambda x: (x.sin() * 2,))(torch.randn(4))
    debug, target = tmp_path / "debug", tmp_path / "elsewhere"
    target.mkdir()
    monkeypatch.setattr(graph_names, "_counter", itertools.count())
    ferrocore.compile_graph(gm, options={"debug_dir": str(debug)})
    (dump,) = debug.iterdir()
    shutil.rmtree(dump)
    dump.symlink_to(target)
    monkeypatch.setattr(graph_names, "_counter", itertools.count())
    with pytest.raises(Exception, match="is a symlink"):
        ferrocore.compile_graph(gm, options={"debug_dir": str(debug)})
    assert not list(target.iterdir())


@pytest.mark.parametrize("kwargs, message", [
    ({"options": {"unknown": 1}}, "unknown option 'unknown'; the options are cache_dir, logs"),
    ({"options": {"cpp_jobs": "2"}}, "option 'cpp_jobs': expected int, got str '2'"),
    ({"options": {"graph_cache": 0}}, "option 'graph_cache': expected bool, got int 0"),
    ({"options": {"cpp_jobs": True}}, "option 'cpp_jobs': expected int, got bool True"),
    ({"options": {"compile_workers": -1}}, "option 'compile_workers': must be >= 0"),
    ({"options": {"logs": "graph,fusoin"}}, "option 'logs': unknown channel 'fusoin'"),
    ({"options": {"pad_mm": "sometimes"}}, "option 'pad_mm': 'sometimes' is not one of measured"),
    ({"mode": "bogus"}, "unknown mode 'bogus'; the modes are default, reduce-overhead"),
], ids=["key", "type", "bool", "int-not-bool", "range", "log-channel", "choice", "mode"])
def test_wrong_options_and_modes_raise_errors_naming_them(fake, kwargs, message):
    fn = torch.compile(lambda x: x * 5, backend=ferrocore_backend, dynamic=False, **kwargs)
    # raised as it is, not in Dynamo's BackendCompilerFailed
    with pytest.raises(options.OptionError, match=re.escape(message)):
        fn(torch.randn(2))
    assert not fake.graphs


def test_triton_kernels_for_a_cpu_graph_without_the_interpreter_raise_a_clear_error(monkeypatch):
    """The module is generated (tests and compile workers read it); running it says why not."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 7, backend=ferrocore_backend, dynamic=False, options={"backend": "triton"})
    with pytest.raises(options.OptionError, match=re.escape("run only under Triton's interpreter; set TRITON_INTERPRET=1")):
        fn(torch.randn(2, device="cpu"))
    assert ferrocore.metrics.last["backend"] == "triton" and ferrocore.metrics.last["kernels"] == 1


def test_max_autotune_on_a_cpu_graph_says_what_it_tunes(fake, monkeypatch, capfd):
    from ferrocore import prepare

    monkeypatch.setitem(prepare._said, "cpu_autotune", False)
    fn = torch.compile(lambda x: x * 9, backend=ferrocore_backend, dynamic=False, mode="max-autotune-no-cudagraphs")
    fn(torch.randn(2, device="cpu"))
    assert "times each float32 GEMM as a C++ kernel against the library call" in capfd.readouterr().err


def test_readme_describes_every_option():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    described = set(re.findall(r"^\| `(\w+)` \| ", readme, re.M))
    assert set(options._TYPES) <= described, set(options._TYPES) - described


def test_compile_graph_helper_on_make_fx_graph(fake):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: (x.exp() - 1,), tracing_mode="fake")(torch.randn(3))
    f = ferrocore.compile_graph(gm)
    x = torch.randn(3)
    (out,) = f(x)
    torch.testing.assert_close(out, x.exp() - 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_graph_without_a_gpu_fails_at_compile_time(fake):
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        x = torch.empty(8, device="cuda")
        gm = make_fx(lambda a: (a.exp() + 1,), tracing_mode="fake")(x)
    with pytest.raises(RuntimeError, match=r"computes on cuda(:0)?, but this machine has no usable GPU"):
        ferrocore.compile_graph(gm)
    assert not fake.graphs


def test_options_read_env_at_each_call(monkeypatch, tmp_path):
    monkeypatch.delenv("FERROCORE_LOGS", raising=False)
    monkeypatch.delenv("FERROCORE_DEBUG_DIR", raising=False)
    monkeypatch.delenv("FERROCORE_CACHE_DIR", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    opts = options.build_options()
    assert opts["logs"] == [] and opts["debug_dir"] is None and opts["cxx"] == "g++"
    assert opts["cache_dir"].endswith("/.cache/ferrocore")

    monkeypatch.setenv("FERROCORE_LOGS", " graph, +fusion ,graph")
    monkeypatch.setenv("FERROCORE_DEBUG_DIR", str(tmp_path / "dbg"))
    monkeypatch.setenv("CXX", "clang++")
    opts = json.loads(options.options_json())
    assert opts["logs"] == ["graph", "fusion"]
    assert opts["debug_dir"] == str(tmp_path / "dbg") and opts["cxx"] == "clang++"
    assert options.parse_logs("all") == list(options.log_channels())
    with pytest.warns(UserWarning, match="unknown channel"):
        assert options.parse_logs("graph,nope") == ["graph"]


def test_metrics_sum_over_graphs():
    m = type(ferrocore.metrics)()
    m.record({"kernels": 2, "externs": 1, "fallbacks": 1, "timings_ms": {"cpp_compile": 3.0},
              "fallback_ops": ["aten.foo.default"], "extern_ops": ["torch.ops.aten.mm.default"]})
    m.record({"graph_fallback": True, "timings_ms": {"cpp_compile": 1.5, "aot": 2.0, "lowering": 0.5, "load": 1.0},
              "extern_ops": ["torch.ops.aten.mm.default"]})
    m.record({"timings_ms": {"graph_cache": 0.5, "load": 1.0}, "graph_cache": "hit", "kernel_binary_hits": 4})
    assert m.total == {
        "graphs": 3,
        "kernels": 2,
        "externs": 1,
        "fallbacks": 1,
        "kernel_binary_hits": 4,
        "compiled_in_workers": 0,
        "graph_fallbacks": 1,
        "fallback_ops": {"aten.foo.default": 1},
        "extern_ops": {"torch.ops.aten.mm.default": 2},
        "timings_ms": {"cpp_compile": 4.5, "aot": 2.0, "lowering": 0.5, "load": 2.0, "graph_cache": 0.5},
        "graph_cache": {"hit": 1},
    }
    assert m.last["graph_cache"] == "hit"
    parts = m.compile_time()
    assert parts["cpp_compile"] == pytest.approx(4.5e-3) and parts["aot"] == pytest.approx(2e-3)
    assert parts["stages"] == pytest.approx(0.5e-3) and parts["load"] == pytest.approx(2e-3)
    assert parts["backend"] == pytest.approx((4.5 + 2.0 + 0.5 + 2.0 + 0.5) * 1e-3)
    assert "3 graphs" in repr(m) and "compiled-graph cache: hit 1" in repr(m)
    m.reset()
    assert m.last == {} and m.total["graphs"] == 0


def test_runtime_helpers():
    base = torch.arange(12.0)
    for reinterpret in (wrapper.reinterpret, wrapper._reinterpret_as_strided):
        # the offset counts from the tensor's own storage offset
        t = reinterpret(base[1:], (3, 2), (4, 1), 0)
        assert t.tolist() == [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]
    e = wrapper.empty_strided((2, 3), (1, 2), torch.float32, "cpu")
    assert e.stride() == (1, 2)
    assert report.benchmark(lambda args: args[0] + 1, [base], reps=3) > 0


def test_dynamic_shapes_compile_once_per_signature():
    # symbolic graphs (sym_size & co.) are specialized per input signature, never run eagerly
    import ferrocore

    def f(x, y):
        return (x * 2).sum(0) + y.shape[0], x.reshape(-1)[: x.shape[0]]

    torch._dynamo.reset()
    cf = torch.compile(f, backend="ferrocore", dynamic=True)
    graphs, recompiles = ferrocore.metrics.total["graphs"], ferrocore.metrics.total.get("recompiles", 0)
    for rows, n in ((3, 5), (6, 7), (6, 7), (2, 9)):
        x, y = torch.randn(rows, 4), torch.randn(n)
        for got, want in zip(cf(x, y), f(x, y)):
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
        assert not ferrocore.metrics.last["graph_fallback"]
    assert ferrocore.metrics.total["graphs"] - graphs == 3  # one per distinct signature
    assert ferrocore.metrics.total["recompiles"] - recompiles == 2  # the first is no recompile

    xr = torch.randn(5, 3, requires_grad=True)
    g = torch.compile(lambda t: (t.sin() * t.shape[0]).sum(), backend="ferrocore", dynamic=True)
    g(xr).backward()
    torch.testing.assert_close(xr.grad, xr.detach().cos() * 5)


def test_each_specialization_of_a_dynamic_graph_is_announced_with_what_changed(monkeypatch, capfd):
    monkeypatch.setenv("FERROCORE_LOGS", "recompiles")
    torch._dynamo.reset()
    cf = torch.compile(lambda x: x.cos() * x.shape[0], backend="ferrocore", dynamic=True)
    for rows in (3, 6, 6, 2):
        cf(torch.randn(rows, 4))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[ferrocore:recompiles]")]
    assert len(lines) == 3
    assert "signature 1, compiled as lambda_0_0_inference" in lines[0] and lines[0].endswith(": its first call")
    # (Dynamo passes the symbolic sizes as int inputs too)
    assert "signature 2" in lines[1] and "sizes (3, 4) -> (6, 4)" in lines[1] and "(int) 3 -> 6" in lines[1]
    assert "signature 3" in lines[2] and "sizes (6, 4) -> (2, 4)" in lines[2]


def test_cpu_scalars_of_a_gpu_graph_are_found():
    # a 0-d CPU tensor may join a CUDA op in ATen; the front moves it to the GPU for the kernels
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ferrocore.prepare import _host_scalars, _move_host_scalars

    with FakeTensorMode():
        vals = {"a": torch.empty(3, device="cuda"), "s": torch.empty((), device="cpu"),
                "c": torch.empty(2, device="cpu")}
    graph = torch.fx.Graph()
    for name, val in vals.items():
        graph.placeholder(name).meta["val"] = val
    graph.output(())
    gm = torch.fx.GraphModule({}, graph)
    assert _host_scalars(gm) == (torch.device("cuda", 0), [1])
    _move_host_scalars(gm, torch.device("cuda", 0), [1])  # declared on the GPU for the kernels
    assert [n.meta["val"].device.type for n in gm.graph.nodes if n.op == "placeholder"] == ["cuda", "cuda", "cpu"]
    cpu_only = torch.fx.Graph()
    cpu_only.placeholder("s").meta["val"] = vals["s"]
    cpu_only.output(())
    assert _host_scalars(torch.fx.GraphModule({}, cpu_only)) == (None, [])


def test_cpu_scalars_made_inside_a_gpu_graph_move_to_the_gpu():
    # `y[idx] = 7.0` makes a 0-d CPU tensor (a constant and its copy, or scalar_tensor) that only
    # feeds a CUDA op: it is made on the GPU so the op compiles; a CPU output stays on the CPU
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ferrocore.prepare import _move_host_scalars

    aten = torch.ops.aten
    gpu = torch.device("meta")  # stands in for CUDA on a machine without one
    mode = FakeTensorMode()
    with mode:
        x, i = torch.empty(4, 3, device=gpu), torch.zeros(2, dtype=torch.long, device=gpu)
        cpu0 = torch.empty((), device="cpu")
    root = torch.nn.Module()
    root.c = torch.tensor(7.0, device="cpu")
    g = torch.fx.Graph()
    px, pi = g.placeholder("x"), g.placeholder("i")
    px.meta["val"], pi.meta["val"] = x, i
    const = g.get_attr("c")
    const.meta["val"] = cpu0
    copy = g.call_function(aten.lift_fresh_copy.default, (const,))
    copy.meta["val"] = cpu0
    made = g.call_function(aten.scalar_tensor.default, (2.0,), {"dtype": torch.float32, "device": torch.device("cpu")})
    made.meta["val"] = cpu0
    kept = g.call_function(aten.scalar_tensor.default, (3.0,), {"dtype": torch.float32, "device": torch.device("cpu")})
    kept.meta["val"] = cpu0
    # a literal converted (FlexAttention's `score * 0.125` under vmap): no device named, so the CPU
    literal = g.call_function(aten._to_copy.default, (0.125,), {"dtype": torch.float32})
    literal.meta["val"] = cpu0
    with mode:
        put = g.call_function(aten.index_put.default, (px, [pi], copy))
        put.meta["val"] = torch.empty(4, 3, device=gpu)
        scaled = g.call_function(aten.mul.Tensor, (put, literal))
        scaled.meta["val"] = torch.empty(4, 3, device=gpu)
        out = g.call_function(aten.mul.Tensor, (scaled, made))
        out.meta["val"] = torch.empty(4, 3, device=gpu)
    g.output((out, kept))
    gm = torch.fx.GraphModule(root, g)
    with mode:  # as under dynamo: the moved constant must still be a real tensor
        _move_host_scalars(gm, gpu, [])
    assert gm.c.device.type == "meta" and type(gm.c) is torch.Tensor
    assert [n.meta["val"].device.type for n in (const, copy, made, literal, kept)] == ["meta", "meta", "meta", "meta", "cpu"]
    assert made.kwargs["device"] == gpu and literal.kwargs["device"] == gpu and kept.kwargs["device"] == torch.device("cpu")


def test_kernels_compiled_later_run_on_another_thread_and_errors_surface_at_wait():
    import threading

    from ferrocore.static_compile import KernelsLater

    ran = []
    later = KernelsLater()
    later.submit(lambda: ran.append(threading.current_thread() is threading.main_thread()))
    later.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        later.wait()
    assert ran == [False]
