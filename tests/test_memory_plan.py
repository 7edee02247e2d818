"""The host plan's memory: inputs dropped after their last reader (a backward frees saved
activations as it goes), results written in place of a buffer that dies in the same kernel,
values realized once, and training graphs decomposed so the partitioner saves less."""

import json

import pytest
import torch

import ferrocore
from ferrocore import artifact
from helpers import check


def test_results_in_place_of_dying_buffers_are_correct():
    x = torch.randn(64, 32)
    # cumsum's result dies in the relu, element for element: one storage for both
    check(lambda t: torch.relu(torch.cumsum(t, 0)) * 2, x)
    # a transposed read of the dying buffer must not share its storage
    check(lambda t: torch.cumsum(t, 0).T + t.T, torch.randn(32, 32))
    # the dying buffer is also returned: its values must survive
    check(lambda t: (torch.cumsum(t, 0), torch.cumsum(t, 0).sin()), x)


def test_compiled_call_takes_over_its_argument_list():
    def f(a, b):
        return (a.exp() + b).sum(0)

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(4, 5), torch.randn(4, 5))
    fn = ferrocore.compile_graph(gm)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    torch.testing.assert_close(fn(a, b)[0], f(a, b))
    from ferrocore import dispatch, static_compile

    boxed = dispatch.compile_request(static_compile.CompileRequest(gm, {}, {}))
    args = [a, b]
    boxed(args)
    assert args == [], "the boxed call clears the list so that inputs can be freed early"


@pytest.fixture
def compiled_graphs(monkeypatch) -> list:
    """The FX graphs handed to ferrocore's compiler, in order (forward, then backward)."""
    from ferrocore import dispatch

    graphs = []
    compile_graph = dispatch.compile_request

    def spy(request):
        graphs.append(request.gm)
        return compile_graph(request)

    monkeypatch.setattr(dispatch, "compile_request", spy)
    return graphs


def test_training_gradients_with_decomposed_softmax_and_norms(compiled_graphs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))

    def step(m):
        for p in model.parameters():
            p.grad = None
        loss = torch.nn.functional.cross_entropy(m(x), y) + m(x).softmax(-1).pow(2).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = step(model)
    loss, grads = step(torch.compile(model, backend="ferrocore"))
    torch.testing.assert_close(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    # the training graphs reached ferrocore decomposed: no opaque normalization or softmax left
    seen = [str(n.target) for gm in compiled_graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert seen and not any("layer_norm" in t or "softmax" in t for t in seen), seen


def test_a_backward_writes_into_donated_saved_activations(capfd):
    # the GEMM's saved result dies in tanh's gradient kernel, which reads it element for element:
    # AOT autograd donates it, so the gradient takes its storage
    torch.manual_seed(0)
    a, w = torch.randn(64, 32), torch.randn(32, 48, requires_grad=True)

    def f(t):
        return torch.tanh(t @ w).sum()

    f(a).backward()
    want = w.grad.clone()
    w.grad = None
    torch._dynamo.reset()
    torch.compile(f, backend="ferrocore", options={"logs": "fusion"})(a).backward()
    torch.testing.assert_close(w.grad, want)
    assert "is written into mm (its last reader" in capfd.readouterr().err
    # kept for a second backward, the saved values are not donated and stay intact
    w.grad = None
    torch._dynamo.reset()
    loss = torch.compile(f, backend="ferrocore")(a)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * want)


def test_a_cuda_graph_recordings_references_count_only_where_no_returned_result_takes_the_storage():
    # `held` (the forward recording's references to its pool) is discounted for a donated GEMM
    # result that an intermediate takes (tanh's gradient, read by the next GEMM); not where a
    # gradient the graph returns takes it (`s`'s): `.grad` would then keep the forward's
    # recording from replaying
    import ferrocore

    torch.manual_seed(0)
    a, w = torch.randn(64, 32), torch.randn(32, 48, requires_grad=True)
    s = torch.randn(64, 48, requires_grad=True)
    for f, expect in ((lambda t: (torch.tanh(t @ w) * s).sum(), "mm = owned_storage(mm, 3072, held)"),
                      (lambda t: ((t @ w) * s).sum(), "mm = owned_storage(mm, 3072)")):
        torch._dynamo.reset()
        w.grad = s.grad = None
        f(a).backward()
        want = [w.grad.clone(), s.grad.clone()]
        w.grad = s.grad = None
        torch.compile(f, backend="ferrocore")(a).backward()
        torch.testing.assert_close([w.grad, s.grad], want)
        source = open(ferrocore.metrics.last["module_path"]).read()
        # (not the provenance comments, which quote this test's own lines)
        writes = [line.strip() for line in source.splitlines()
                  if "= owned_storage(" in line and not line.lstrip().startswith("#")]
        assert writes == [expect]
        compiled = json.loads(open(ferrocore.metrics.last["artifact_path"]).read())
        assert artifact.holds_donated_inputs(compiled) == expect.endswith("held)")


def test_a_donated_input_is_copied_before_it_is_written_when_its_storage_is_shared_or_short():
    from ferrocore.runtime.wrapper import owned_storage

    t = torch.randn(4, 4)
    view = t[1:]
    assert owned_storage(t, 16) is not t and torch.equal(owned_storage(t, 16), t)
    assert owned_storage(t, 16).stride() == t.stride()
    del view
    assert owned_storage(t, 16) is t
    # a padded result written over the unpadded view needs the padding's room too
    from ferrocore.runtime.wrapper import reinterpret

    base = torch.randn(4, 6)
    corner = reinterpret(base, (4, 5), (6, 1), 0)  # as the wrapper returns it: no view of base
    del base
    assert owned_storage(corner, 24) is corner
    roomy = owned_storage(corner, 32)
    assert roomy is not corner and torch.equal(roomy, corner) and roomy.untyped_storage().nbytes() >= 32 * 4


def test_a_training_max_pool_saves_int8_window_offsets(compiled_graphs):
    graphs = compiled_graphs
    F = torch.nn.functional
    torch.manual_seed(0)
    cases = [
        (F.max_pool2d, (2, 8, 17, 19), dict(kernel_size=3, stride=2, padding=1), False),
        (F.max_pool2d, (2, 8, 16, 16), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), True),
        (F.max_pool2d, (2, 4, 9, 7), dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0)), False),
        (F.max_pool3d, (1, 3, 5, 6, 7), dict(kernel_size=2, stride=2, padding=1), False),
    ]
    for pool, shape, kw, channels_last in cases:
        x = torch.randn(shape)
        x[0, 0, :4, :4] = 1.0  # ties: the first tap in scan order wins
        x[0, 1, :3, :3] = float("-inf")  # a window of -inf: its first valid tap
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()

        def f(t, with_indices):
            values, indices = pool(t, return_indices=True, **kw)
            loss = (values * torch.arange(values.numel(), dtype=values.dtype, device=values.device).view(values.shape)).sum()
            return (loss, indices) if with_indices else loss

        ref_loss, ref_indices = f(x, True)
        ref_grad = torch.autograd.grad(ref_loss, x)[0]
        for with_indices in (False, True):
            torch._dynamo.reset()
            graphs.clear()
            out = torch.compile(f, backend="ferrocore")(x, with_indices)
            loss = out[0] if with_indices else out
            torch.testing.assert_close(loss, ref_loss)
            torch.testing.assert_close(torch.autograd.grad(loss, x)[0], ref_grad)
            assert ferrocore.metrics.last["fallbacks"] == 0
            forward, backward = graphs
            targets = {str(n.target) for n in forward.graph.nodes if n.op == "call_function"}
            assert "prims._low_memory_max_pool_with_offsets.default" in targets, targets
            saved = {n.meta["val"].dtype for n in backward.graph.nodes if n.op == "placeholder"}
            if with_indices:
                assert out[1].dtype == torch.int64 and torch.equal(out[1], ref_indices)
            else:
                # the backward takes the window offsets as bytes, not ATen's int64 indices
                assert saved == {torch.float32, torch.int8}, saved


def test_a_relu_takes_the_storage_of_the_gemm_result_it_reads_last(capfd, monkeypatch):
    # the GEMM's [64, 48] result dies in the relu over its [4, 16, 48] view: the relu's result
    # (a graph output, in its own shape) lives in the GEMM's storage (a library call's: on the
    # CPU a GEMM this small is otherwise a kernel with the relu in it)
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "never")
    torch.manual_seed(0)
    a, w = torch.randn(64, 32), torch.randn(32, 48)

    def f(x, y):
        return torch.relu((x @ y).view(4, 16, 48))

    want = f(a, w)
    torch._dynamo.reset()
    got = torch.compile(f, backend="ferrocore", options={"logs": "fusion"})(a, w)
    torch.testing.assert_close(got, want)
    assert got.shape == want.shape and got.stride() == want.stride()
    assert "is written into" in capfd.readouterr().err


def test_a_result_takes_the_gemm_results_storage_beside_a_mask_of_it(capfd, monkeypatch):
    # the doubled GEMM result and a mask of the GEMM result share one kernel: the mask reads each
    # element before the doubling overwrites it in the GEMM's storage (a library call's)
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "never")
    torch.manual_seed(0)
    a, w = torch.randn(64, 32), torch.randn(32, 48)

    def f(x, y):
        h = x @ y
        return (h * 2).view(4, 16, 48), h > 1

    want = f(a, w)
    torch._dynamo.reset()
    got = torch.compile(f, backend="ferrocore", options={"logs": "fusion"})(a, w)
    for g, t in zip(got, want):
        torch.testing.assert_close(g, t)
        assert g.shape == t.shape and g.stride() == t.stride() and g.dtype == t.dtype
    assert "is written into" in capfd.readouterr().err


def test_a_returned_result_in_a_gemm_results_storage_is_never_taken_again():
    # the relu's result lives in the first GEMM's storage and is returned: the sum that reads it
    # last must not take that storage too
    torch.manual_seed(0)
    a, w, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(48, 48)

    def f(x, y, z):
        r = torch.relu((x @ y).view(4, 16, 48))
        return r, r + (r.view(64, 48) @ z).view(4, 16, 48)

    want = f(a, w, w2)
    torch._dynamo.reset()
    got = torch.compile(f, backend="ferrocore")(a, w, w2)
    for g, t in zip(got, want):
        torch.testing.assert_close(g, t)
