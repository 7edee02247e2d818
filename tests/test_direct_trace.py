"""The direct trace (`ferrocore/direct_trace.py`): the ATen graph it records is AOT autograd's
inference graph, node for node, for every model of the model zoo, and for training graphs AOT
autograd's joint graph; the graphs it must not handle (mutated inputs, aliased outputs, symbolic
sizes) go through AOT autograd; and what it compiles gives eager's values, strides and dtypes.
How a joint graph is split into forward and backward (`ferrocore/joint_split.py`) is tested in
test_joint_split.py."""

from __future__ import annotations

import collections
import hashlib
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from helpers import is_ferrocore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import model_zoo  # noqa: E402

pytestmark = pytest.mark.skipif(not is_ferrocore(), reason="ferrocore's own tracer")

DEVICE = torch.get_default_device()


def _digests(gm: torch.fx.GraphModule):
    """The graph up to node names and order: a multiset of per-node digests (op, operands'
    digests, and the value's shape, strides and dtype) and the outputs' digests."""
    digests = {}
    placeholders = 0

    def of(a):
        if isinstance(a, torch.fx.Node):
            return digests[a]
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(of(x) for x in a) + ")"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{of(v)}" for k, v in sorted(a.items())) + "}"
        return repr(a)

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            text = f"placeholder {placeholders}"
            placeholders += 1
        elif n.op == "output":
            return collections.Counter(digests.values()), of(n.args[0])
        else:
            val = n.meta.get("val")
            layout = (tuple(val.shape), tuple(val.stride()), val.dtype) if isinstance(val, torch.Tensor) else None
            text = f"{n.op} {n.target} {of(n.args)} {of(n.kwargs)} {layout}"
        digests[n] = hashlib.sha256(text.encode()).hexdigest()[:20]
    raise AssertionError("no output node")


def _both_traces(fn, *inputs):
    """(the direct trace's graph or its NeedsAot reason, AOT autograd's inference graph) of
    each graph Dynamo makes of `fn`."""
    from ferrocore import decompositions, direct_trace
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def capture(gm, example_inputs, **kwargs):
        table = decompositions.decompositions(training=False)
        try:
            direct_trace.check_graph(gm, example_inputs)
            direct = direct_trace.trace(gm, example_inputs, table, as_written=True)
        except direct_trace.NeedsAot as e:
            direct = str(e)
        aot = []
        compiled = aot_module_simplified(gm, example_inputs, decompositions=table, keep_inference_input_mutations=True,
                                         fw_compiler=lambda g, _: aot.append(g) or g,
                                         inference_compiler=lambda g, _: aot.append(g) or g)
        graphs.append((direct, aot[0]))
        return compiled

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=capture)(*inputs)
    return graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(model_zoo.MODELS))
def test_zoo_graph_is_aot_autograds(name, dtype):
    with torch.device("cpu"):
        case = model_zoo.build(name, "tiny", str(DEVICE), dtype)
        inputs = case.make_inputs()
    graphs = _both_traces(case.model.eval(), *inputs)
    assert graphs
    for direct, aot in graphs:
        assert not isinstance(direct, str), f"{name} went through AOT autograd: {direct}"
        assert _digests(direct) == _digests(aot), f"{name}:\n{direct.code}\nAOT autograd's:\n{aot.code}"


def _compiled(fn, *inputs, capfd, **compile_kwargs):
    """Runs `fn` compiled by ferrocore with the `trace` log on; returns (outputs, the log)."""
    import ferrocore

    torch._dynamo.reset()
    ferrocore.metrics.reset()
    capfd.readouterr()
    options = {"logs": "trace", "graph_cache": False, **compile_kwargs.pop("options", {})}
    out = torch.compile(fn, backend="ferrocore", options=options, **compile_kwargs)(*inputs)
    return out, capfd.readouterr().err


def _same(got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), (g, w)
        torch.testing.assert_close(g, w)


def _in_place_on_intermediate(x):
    y = torch.nn.functional.relu(x * 2, inplace=True)
    y.add_(1).mul_(3)
    z = torch.empty_like(y)
    z.copy_(y)
    return z.sum(0), y


def _factories_and_constants(x):
    return x + torch.arange(x.shape[-1], device=x.device) + torch.tensor(0.5, device=x.device) * torch.ones_like(x)


def _channels_last_pool(x):
    # adaptive_avg_pool2d's decomposition restrides its mean in place (as_strided_)
    return torch.nn.functional.adaptive_avg_pool2d(x.relu(), 1).flatten(1)


def _write_into_view(x):
    y = x * 2
    y[0].add_(1)
    return y


def _write_into_view_read_through_another(x):
    y = x * 2
    row, column = y[0], y[:, 1]
    row.add_(1)  # `column` shares y[0, 1] with it
    return column * 3, y.sum()


@pytest.mark.parametrize("fn, make", [
    (_in_place_on_intermediate, lambda: (torch.randn(8, 16),)),
    (_write_into_view, lambda: (torch.randn(4, 4),)),
    (_write_into_view_read_through_another, lambda: (torch.randn(4, 4),)),
    (_factories_and_constants, lambda: (torch.randn(4, 16),)),
    (_channels_last_pool, lambda: (torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last),)),
])
def test_traced_directly(fn, make, capfd):
    import ferrocore

    inputs = make()
    want = fn(*[x.clone() for x in inputs])
    got, log = _compiled(fn, *inputs, capfd=capfd)
    _same(got, want)
    assert "traced directly" in log, log
    parts = ferrocore.metrics.compile_time()
    assert parts["trace"] > 0 and parts["aot"] == 0, parts


def test_in_place_ops_are_recorded_as_their_functional_ops():
    direct, aot = _both_traces(_in_place_on_intermediate, torch.randn(8, 16))[0]
    targets = [n.target for n in direct.graph.nodes if n.op == "call_function"]
    assert all(not t._schema.is_mutable for t in targets), targets
    assert torch.ops.aten.relu.default in targets and torch.ops.aten.copy.default in targets
    assert _digests(direct) == _digests(aot)


def test_a_write_into_a_view_becomes_a_scatter_into_its_base():
    # (AOT autograd scatters by the view's own op, select_scatter here; the values are the same)
    direct, _ = _both_traces(_write_into_view_read_through_another, torch.randn(4, 4))[0]
    targets = [n.target for n in direct.graph.nodes if n.op == "call_function"]
    assert all(not t._schema.is_mutable for t in targets), targets
    assert torch.ops.aten.as_strided_scatter.default in targets, targets


def _write_into_input(x):
    x.add_(1)
    return x * 2


def _write_into_viewed_tensor(x):
    y = x * 2
    row = y[0]
    y.add_(1)  # `row` sees the write
    return row * 3 + y.sum()


def _output_is_view_of_input(x):
    return x.view(-1), x + 1


def _outputs_alias(x):
    y = x + 1
    return y, y.t()


@pytest.mark.parametrize("fn, why", [
    (_write_into_input, "writes into a graph input"),
    (_write_into_viewed_tensor, "has views"),
    (_output_is_view_of_input, "aliases an input"),
    (_outputs_alias, "alias each other"),
])
def test_goes_through_aot_autograd(fn, why, capfd):
    import ferrocore

    x = torch.randn(4, 4)
    want, x_eager = fn(*[x.clone()]), x.clone()
    fn(x_eager)
    got, log = _compiled(fn, x, capfd=capfd)
    _same(got, want)
    torch.testing.assert_close(x, x_eager)  # the input was written as eager writes it
    assert "goes through AOT autograd" in log and why in log, log
    parts = ferrocore.metrics.compile_time()
    assert parts["aot"] > 0, parts
    if isinstance(got, tuple) and fn is _output_is_view_of_input:
        assert got[0]._base is x  # AOT autograd's runtime rebuilds the alias


def test_symbolic_sizes_go_through_aot_autograd(capfd):
    w = torch.randn(8, 8)

    def f(x):
        return (x @ w).relu()

    with torch.no_grad():
        for n in (4, 6):
            x = torch.randn(n, 8)
            got, log = _compiled(f, x, capfd=capfd, dynamic=True)
            _same(got, f(x))
            assert "symbolic size" in log, log


def test_option_off_sends_every_graph_to_aot_autograd(capfd):
    import ferrocore

    x = torch.randn(8, 16)
    with torch.no_grad():
        got, log = _compiled(_in_place_on_intermediate, x, capfd=capfd, options={"direct_trace": False})
    _same(got, _in_place_on_intermediate(x.clone()))
    assert "[ferrocore:trace]" not in log, log
    parts = ferrocore.metrics.compile_time()
    assert parts["trace"] == 0 and parts["aot"] > 0, parts


def test_under_autocast(capfd):
    if DEVICE.type == "cpu":
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16)
    w = torch.randn(16, 16)

    def f(x):
        return torch.nn.functional.gelu(x @ w).float().softmax(-1)

    x = torch.randn(8, 16)
    with torch.no_grad(), autocast:
        want = f(x)
        got, log = _compiled(f, x, capfd=capfd)
    assert "traced directly" in log, log
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_static_inputs_are_aot_autograds():
    # what a CUDA graph reads where it lives (parameters, buffers) and what it copies
    from ferrocore import direct_trace
    from torch._functorch.aot_autograd import aot_module_simplified

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    found = []

    def capture(gm, example_inputs, **kwargs):
        def compiler(graph, _):
            found.append(torch._guards.TracingContext.get().fw_metadata.static_input_indices)
            return graph

        compiled = aot_module_simplified(gm, example_inputs, fw_compiler=compiler, inference_compiler=compiler)
        found.append(direct_trace.static_inputs(gm))
        return compiled

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(torch.randn(3, 4))
    aot, direct = found
    assert direct == aot and len(direct) == 6, found


# ---- training graphs: the joint trace ------------------------------------------------------------

# a write into a view of an intermediate (functionalization replays it as a scatter)
def _both_joint_traces(fn, *inputs):
    """(the direct joint trace, common subexpressions merged, or its NeedsAot reason; AOT
    autograd's joint graph, likewise) of each graph Dynamo makes of a training step of `fn`."""
    from ferrocore import decompositions, direct_trace, joint_split, tracing
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    graphs = []

    def capture(gm, example_inputs, **kwargs):
        table = decompositions.decompositions(training=True)
        try:
            direct_trace.check_graph(gm, example_inputs, training=True)
            # (attention as written: AOT autograd rewrites none)
            joint = direct_trace.trace_joint(gm, example_inputs, table, as_written=True)
            direct = joint.graph
            joint_split.eliminate_common_subexpressions(direct.graph)
        except direct_trace.NeedsAot as e:
            joint, direct = None, str(e)
        joints = []

        def partition(joint, joint_inputs, **kw):
            joints.append(joint)
            return tracing._partition(joint, joint_inputs, **kw)

        compiled = aot_module_simplified(gm, example_inputs, decompositions=table, keep_inference_input_mutations=True,
                                         fw_compiler=lambda g, _: make_boxed_func(g),
                                         bw_compiler=lambda g, _: make_boxed_func(g), partition_fn=partition)
        if not joints:  # no output needs a gradient: AOT autograd traced an inference graph
            assert joint is not None and not joint.differentiable, direct
            return compiled
        joint_split.eliminate_common_subexpressions(joints[0].graph)
        graphs.append((direct, joints[0]))
        return compiled

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*inputs).backward()
    return graphs


@pytest.mark.parametrize("name", [m for m, case in model_zoo.MODELS.items()])
def test_zoo_joint_graph_is_aot_autograds(name):
    with torch.device("cpu"):
        case = model_zoo.build(name, "tiny", str(DEVICE), torch.float32)
        if case.train is None:
            pytest.skip("no training loss")
        inputs = case.make_train_inputs()
    graphs = _both_joint_traces(case.train.train(), *inputs)
    assert graphs
    for direct, aot in graphs:
        assert not isinstance(direct, str), f"{name} went through AOT autograd: {direct}"
        assert _digests(direct)[0] == _digests(aot)[0], f"{name}:\n{direct.code}\nAOT autograd's:\n{aot.code}"


class _NormedMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(self.fc1(x))).mul(self.fc2.weight.sum()).pow(2).mean() \
            + self.fc2(self.norm(self.fc1(x))).logsumexp(-1).mean()


def _training_step_against_eager(batch: int, capfd):
    """A training step of `_NormedMlp` compiled and eager: (the compiled model, the eager one);
    checks the loss and the gradients, and that the graph was traced directly."""
    import copy

    torch.manual_seed(0)
    model, x = _NormedMlp().train(), torch.randn(batch, 8)
    eager = copy.deepcopy(model)
    want = eager(x)
    want.backward()
    got, log = _compiled(model, x, capfd=capfd)
    got.backward()
    assert "traced directly with its backward" in log, log
    torch.testing.assert_close(got, want)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    return model, eager, x


def test_training_step_is_eagers(capfd):
    import ferrocore

    model, eager, x = _training_step_against_eager(6, capfd)
    parts = ferrocore.metrics.compile_time()
    assert parts["trace"] > 0 and parts["aot"] == 0, parts
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):  # running statistics, written twice
        torch.testing.assert_close(b, c, msg=name)
        assert b.dtype == c.dtype
    assert model.norm.num_batches_tracked.item() == 2
    # a second step reuses the compiled graphs
    got2 = torch.compile(model, backend="ferrocore", options={"graph_cache": False})(x)
    assert got2.requires_grad


@pytest.mark.cpu_only("C++ kernels")
def test_training_forward_cpp_compiles_on_a_thread_of_its_own(capfd, monkeypatch):
    import threading

    import ferrocore
    from ferrocore.runtime import cpp_library

    on_main_thread = []  # of each C++ library compiled (or found cached) and loaded
    load = cpp_library.load_kernels_reporting

    def recording(source, options=None):
        on_main_thread.append(threading.current_thread() is threading.main_thread())
        return load(source, options)

    monkeypatch.setattr(cpp_library, "load_kernels_reporting", recording)
    _training_step_against_eager(7, capfd)
    assert False in on_main_thread, on_main_thread  # the forward's C++ (KernelsLater)
    total = ferrocore.metrics.total
    assert total["graphs"] == 2 and total["timings_ms"]["cpp_compile"] > 0, total


def _strided_view_of_a_permute(x, w):
    # as_strided's backward copies the gradient into an as_strided view of zeros it makes
    return (x * w).permute(1, 0).as_strided((2, 4), (1, 2)).sin().sum()


def test_backward_writing_into_a_view_of_its_own_tensor_is_traced_directly(capfd):
    x, w = torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    eager_w = w.detach().clone().requires_grad_()
    want = _strided_view_of_a_permute(x, eager_w)
    want.backward()
    got, log = _compiled(_strided_view_of_a_permute, x, w, capfd=capfd)
    got.backward()
    assert "traced directly with its backward" in log, log
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(w.grad, eager_w.grad)


def _writes_into_view_of_input(x, w):
    x[0].mul_(2)
    return (x * w).sum()


def _returns_its_input(x, w):
    return w[:2], (x * w).sum()


@pytest.mark.parametrize("fn, why", [
    (_writes_into_view_of_input, "has views"),
    (_returns_its_input, "aliases an input"),
])
def test_training_graph_goes_through_aot_autograd(fn, why, capfd):
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    got, log = _compiled(fn, x.clone(), w, capfd=capfd)
    want = fn(x.clone(), w)
    assert "goes through AOT autograd" in log and why in log, log
    _same(got, want)


def test_training_graph_writing_into_an_input(capfd):
    def f(x, w):
        x.mul_(2)
        return (x * w).sum()

    w = torch.randn(4, requires_grad=True)
    x, x_eager = torch.randn(4), None
    x_eager = x.clone()
    want = f(x_eager, w)
    (grad_want,) = torch.autograd.grad(want, w)
    got, log = _compiled(f, x, w, capfd=capfd)
    assert "traced directly with its backward" in log, log
    (grad_got,) = torch.autograd.grad(got, w)
    _same(got, want)
    torch.testing.assert_close(x, x_eager)
    torch.testing.assert_close(grad_got, grad_want)


def test_output_viewing_an_intermediate_is_differentiable(capfd):
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        return (x @ w).view(-1)

    x = torch.randn(3, 4)
    got, log = _compiled(f, x, capfd=capfd)
    assert "traced directly with its backward" in log, log
    assert got._base is None  # autograd sees a plain output (AOT autograd's _unsafe_view)
    got.mul_(2)  # an output viewing an intermediate may be written into, as in eager
    got.sum().backward()
    want = w.grad.clone()
    w.grad = None
    y = f(x)
    y.mul_(2)
    y.sum().backward()
    torch.testing.assert_close(want, w.grad)


def test_training_graph_with_a_no_grad_block(capfd):
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        y = x @ w
        with torch.no_grad():
            scale = y.abs().amax()
        return (y / scale).tanh().sum()

    x = torch.randn(4, 8)
    got, log = _compiled(f, x, capfd=capfd)
    assert "traced directly with its backward" in log, log
    (grad_got,) = torch.autograd.grad(got, w)
    want = f(x)
    (grad_want,) = torch.autograd.grad(want, w)
    _same(got, want)
    torch.testing.assert_close(grad_got, grad_want)
    assert torch.is_grad_enabled()


def test_training_bfloat16_batch_norm_statistics(capfd):
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(torch.bfloat16).train()
    eager = copy.deepcopy(model)
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    got, log = _compiled(lambda t: model(t).float().pow(2).mean(), x, capfd=capfd)
    got.backward()
    eager(x).float().pow(2).mean().backward()
    assert "traced directly with its backward" in log, log
    for b, c in zip(model.buffers(), eager.buffers()):
        assert b.dtype == c.dtype
        torch.testing.assert_close(b, c, atol=2e-2, rtol=2e-2)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=5e-2, rtol=5e-2)


def test_training_dropout_is_traced_directly(capfd):
    # in-place dropout (torchvision's classifiers) on a CPU tensor writes its mask with
    # `bernoulli_.float`, whose functional form is
    # `bernoulli.p` (another overload name): traced directly, not sent to AOT autograd
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    w = torch.randn(32, requires_grad=True)
    got, log = _compiled(lambda a, b: torch.nn.functional.dropout(a * b, 0.5, training=True, inplace=True), x, w, capfd=capfd)
    got.sum().backward()
    assert "traced directly with its backward" in log, log
    kept = got != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(got[kept], (2 * x * w.detach())[kept])
    torch.testing.assert_close(w.grad, (2 * x * kept).sum(0))


def test_a_backward_is_compiled_when_it_first_runs():
    # a model called for inference without torch.no_grad() (the README's usage) compiled its
    # backward at the first forward call: two graphs for a model never trained
    import ferrocore

    torch._dynamo.reset()
    ferrocore.metrics.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    compiled = torch.compile(model, backend="ferrocore", options={"graph_cache": False})
    out = compiled(x)
    assert ferrocore.metrics.total["graphs"] == 1
    _same(out, model(x))
    out = compiled(x)
    assert ferrocore.metrics.total["graphs"] == 1
    out.square().sum().backward()
    assert ferrocore.metrics.total["graphs"] == 2
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    compiled(x).square().sum().backward()
    assert ferrocore.metrics.total["graphs"] == 2
