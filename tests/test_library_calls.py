"""Library calls as the compiler treats them: results ATen leaves undefined, CUDA-graph hazards,
GEMMs on padded operands (the `padding` pass) and channels-last convolution graphs (the `layout`
pass). GPU-only graphs are traced with fake CUDA tensors and compiled without running (no GPU
needed); the rest run on the CPU against eager."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from conftest import TEST_DEVICE
from helpers import check

pytestmark = pytest.mark.ferrocore_only


def compile_fake_cuda(fn, *shapes, dtype=torch.bfloat16, device="cuda", **options) -> dict:
    """`fn` traced on fake CUDA tensors of `shapes` (or of `device`) and compiled (module text only)."""
    import ferrocore
    from ferrocore.options import build_options
    from ferrocore.serialize import serialize_graph

    with FakeTensorMode():
        args = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        gm = make_fx(fn, tracing_mode="fake")(*args)
    opts = build_options({"skip_native_compile": True, **options})
    opts["skip_native_compile"] = True
    return json.loads(ferrocore._ferrocore.compile_graph(serialize_graph(gm, "g"), json.dumps(opts)))


def test_undefined_attention_results_are_not_bound():
    # flash attention's RNG state and debug mask are undefined tensors (None) without dropout:
    # only the output is bound, and the call is safe to record in a CUDA graph
    def attention(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, True)[0] * 2

    result = compile_fake_cuda(attention, (2, 4, 128, 64), (2, 4, 128, 64), (2, 4, 128, 64))
    src = result["module_source"]
    assert "_r = torch.ops.aten._scaled_dot_product_flash_attention.default(" in src
    assert "restride(_r[0]" in src and "_r[6]" not in src and "_r[7]" not in src
    assert "del _r" in src
    assert json.loads(result["artifact"])["cuda_graph_hazards"] == []
    assert result["extern_ops"] == ["torch.ops.aten._scaled_dot_product_flash_attention.default"]
    assert result["fallbacks"] == []


def test_restride_passes_undefined_results_through():
    from ferrocore.runtime.wrapper import restride

    assert restride(None, (2,), (1,), torch.float32) is None
    t = torch.ones(2, 3).t()
    assert restride(t, (3, 2), (1, 3), torch.float32) is t
    copy = restride(t, (3, 2), (2, 1), torch.float32)
    assert copy.stride() == (2, 1) and torch.equal(copy, t)


def test_a_synchronizing_library_call_keeps_the_graph_out_of_cuda_graphs():
    def permuted(x):
        return x[torch.ops.aten.randperm.default(16, device="cuda")] + 1

    hazards = json.loads(compile_fake_cuda(permuted, (16,), dtype=torch.float32)["artifact"])["cuda_graph_hazards"]
    assert len(hazards) == 1 and "randperm may draw the permutation on the host" in hazards[0]


def test_a_graph_naming_a_hazard_is_not_recorded():
    import ferrocore.runtime.cudagraphs as cg

    hazard = "ATen fallback torch.ops.aten.foo.default of unknown capture safety"
    compiled = {"language": "triton", "kernels": [], "cuda_graph_hazards": [hazard]}
    cuda = torch.device("cuda:0")
    assert "unknown capture safety" in cg.blocker(compiled, cuda, [], False)
    assert cg.blocker({**compiled, "cuda_graph_hazards": []}, cuda, [], False) is None
    # C++ kernels run on the host, whatever the graph's device
    host = {**compiled, "language": "cpp", "kernels": [{"name": "k"}], "cuda_graph_hazards": []}
    assert cg.blocker(host, cuda, [], False) == "it runs C++ kernels on the host"


@pytest.mark.parametrize("shapes", [((6, 13), (21, 13)), ((32, 64), (50, 64))])
def test_padded_gemms_match_eager(shapes, capfd):
    # linear forward and backward (addmm, mm with the transposed operands) on padded operands
    torch.manual_seed(0)
    x = torch.randn(shapes[0], dtype=torch.bfloat16)
    w = torch.randn(shapes[1], dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(shapes[1][0], dtype=torch.bfloat16, requires_grad=True)

    def f(x):
        return torch.nn.functional.linear(x, w, b).float().square().mean()

    expected = f(x)
    expected.backward()
    grads = w.grad.clone(), b.grad.clone()
    w.grad = b.grad = None
    got = torch.compile(f, backend="ferrocore", options={"pad_mm": "always", "logs": "padding"})(x)
    got.backward()
    assert torch.allclose(got, expected, rtol=2e-2, atol=1e-2)
    assert torch.allclose(w.grad.float(), grads[0].float(), rtol=2e-2, atol=2e-2)
    assert torch.allclose(b.grad.float(), grads[1].float(), rtol=2e-2, atol=2e-2)
    assert w.grad.stride() == w.stride()
    assert "pad: addmm" in capfd.readouterr().err


def test_padded_bmm_and_never(capfd):
    a, b = torch.randn(3, 5, 7, dtype=torch.bfloat16), torch.randn(3, 7, 9, dtype=torch.bfloat16)
    # a padded GEMM's result is returned as the view of its padded storage (as Inductor's)
    for mode, padded, stride in (("always", True, (8 * 16, 16, 1)), ("never", False, (45, 9, 1))):
        torch._dynamo.reset()
        got = torch.compile(torch.bmm, backend="ferrocore", options={"pad_mm": mode, "logs": "padding"})(a, b)
        assert torch.equal(got, torch.bmm(a, b)) and got.stride() == stride
        err = capfd.readouterr().err
        assert ("pad: bmm" in err) == padded
        assert ("returned as a view of its padded GEMM result" in err) == padded


def test_a_padded_linear_adds_its_bias_in_the_gemm_and_returns_the_padded_view(capfd):
    # an LM head: addmm of one bias row on padded operands, the logits returned without a copy
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 37).bfloat16()
    x = torch.randn(5, 24, dtype=torch.bfloat16)
    with torch.no_grad():
        got = torch.compile(head, backend="ferrocore", options={"pad_mm": "always", "logs": "padding,output_code"})(x)
        want = head(x)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert got.stride() == (40, 1)
    err = capfd.readouterr().err
    assert "returned as a view of its padded GEMM result" in err
    assert "torch.addmm(" in err, "the bias is added by the library call"


def test_a_padded_gemm_reads_an_operand_that_needs_no_padding_in_place(capfd):
    # an LM head over a layer norm saved for the backward: only the weight and the bias are
    # padded, and the GEMMs read the normalized rows themselves (a copy of them was live
    # beside BERT's logits GEMM)
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 37).bfloat16()
    ln = torch.nn.LayerNorm(24).bfloat16()
    x = torch.randn(2, 8, 24, dtype=torch.bfloat16, requires_grad=True)

    def f(x):
        return head(ln(x).view(16, 24)).float().square().mean()

    f(x).backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in (*head.parameters(), *ln.parameters())]
    x.grad = None
    for p in (*head.parameters(), *ln.parameters()):
        p.grad = None
    torch._dynamo.reset()
    options = {"pad_mm": "always", "logs": "output_code", "graph_cache": False}
    loss = torch.compile(f, backend="ferrocore", options=options)(x)
    loss.backward()
    got = [x.grad] + [p.grad for p in (*head.parameters(), *ln.parameters())]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    code = capfd.readouterr().err
    forward, backward = code.split("# ferrocore output code for graph")[1:]
    # the forward's GEMM reads the normalized rows where the layer norm wrote them, uncopied
    assert not re.search(r"empty_strided\w*\(\(16, 24\)", forward), forward
    # and the backward's weight gradient reads them as saved
    inputs = re.search(r"\n    (.*) = args\n", backward).group(1).split(", ")
    read = re.findall(r"mm\(.*?reinterpret\((\w+), \(16, 24\), \(24, 1\), 0\)", backward)
    assert any(name in inputs for name in read), read


def test_measured_padding_pads_exactly_the_named_gemm():
    def two(a, b, c):
        return a @ b, a @ c

    result = compile_fake_cuda(lambda a, b, c: two(a, b, c), (64, 13), (13, 50), (13, 64), logs=["padding"])
    assert not any(log["channel"] == "padding" for log in result["logs"])
    import ferrocore
    from ferrocore.options import build_options
    from ferrocore.serialize import serialize_graph

    with FakeTensorMode():
        args = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in ((64, 13), (13, 50), (13, 64))]
        gm = make_fx(two, tracing_mode="fake")(*args)
    doc = serialize_graph(gm, "g", padded_matmuls={"mm": "measured 1.000 ms as traced, 0.500 ms padded"})
    opts = build_options({"logs": "padding"})
    opts["skip_native_compile"] = True
    out = json.loads(ferrocore._ferrocore.compile_graph(doc, json.dumps(opts)))
    text = "".join(log["text"] for log in out["logs"] if log["channel"] == "padding")
    assert text.startswith("pad: mm [64, 13] x [13, 50]") and "0.500 ms padded" in text
    assert "mm_1" not in text


def test_only_gemms_with_an_unaligned_leading_dimension_are_measured():
    from ferrocore import padding

    def gemm(a, b):
        return a @ b

    cases = [
        ((3152, 768), (768, 3072), False),  # BERT's rows: only M is odd, and M leads nothing
        ((4096, 768), (768, 30522), True),  # an LM head: the result's rows are 30522 wide
        ((4096, 30522), (30522, 768), True),  # its input gradient: the left operand's rows
        ((768, 4096), (4096, 30522), True),
        ((64, 768), (768, 64), False),
    ]
    for a_shape, b_shape, measured in cases:
        with FakeTensorMode():
            args = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in (a_shape, b_shape)]
            gm = make_fx(gemm, tracing_mode="fake")(*args)
        (mm,) = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert (padding._unaligned_operands(mm) is not None) == measured, (a_shape, b_shape)
    # a column-major operand leads with its rows' count
    with FakeTensorMode():
        a = torch.empty(13, 61, dtype=torch.bfloat16, device="cuda").t()
        b = torch.empty(13, 64, dtype=torch.bfloat16, device="cuda")
        gm = make_fx(gemm, tracing_mode="fake")(a, b)
    (mm,) = [n for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    assert padding._unaligned_operands(mm) is not None


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pool = torch.nn.MaxPool2d(2)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.stem(x)))
        y = self.pool(y + self.dw(y))
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("train", [False, True])
def test_channels_last_conv_graph_matches_eager(train, capfd):
    torch.manual_seed(0)
    net = ConvNet().train(train)
    x = torch.randn(2, 3, 16, 16)

    def step(f):
        for p in net.parameters():
            p.grad = None
        with torch.set_grad_enabled(train):
            out = f(x)
            if train:
                out.square().mean().backward()
        return [out.detach()] + ([p.grad.clone() for p in net.parameters()] if train else [])

    expected = step(net)
    compiled = torch.compile(net, backend="ferrocore", options={"conv_layout": "channels_last", "logs": "layout"})
    got = step(compiled)
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.stride() == e.stride()
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-5)
    assert "layout: channels-last for 4-D activations: 2 convolutions (1 grouped or depthwise)" in capfd.readouterr().err


def test_a_gpu_convolutions_bias_is_added_by_the_kernel_after_it():
    # ATen adds a bias after cuDNN's kernel in a pass of its own; the lowering calls the
    # convolution without it and the next kernel (here the ReLU's) adds it on its loads
    def conv_relu(x, w, b):
        return torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1, groups=8)) * 2

    src = compile_fake_cuda(conv_relu, (2, 8, 16, 16), (8, 1, 3, 3), (8,))["module_source"]
    call = src[src.index("def _call("):]
    assert "torch.convolution(buf3, w_1, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8)" in call
    assert call.count("launch_triton_") == 2  # channels-last copy of x, then bias + ReLU + mul
    assert "launch_triton_poi_fused_convolution_relu_mul_1(buf4, b_1, buf5)" in call
    # a CPU convolution keeps its bias (oneDNN adds it in the convolution); a grouped one goes
    # channels-last (see lowering/layout.rs), its input and weight copied so
    def grouped_conv_relu(x, w, b):
        return torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1, groups=2)) * 2

    cpu = compile_fake_cuda(grouped_conv_relu, (2, 8, 16, 16), (8, 4, 3, 3), (8,), device="cpu")["module_source"]
    assert "cpp_poi_fused_w_1(w_1.data_ptr(), buf4.data_ptr())" in cpu
    assert "torch.convolution(buf3, buf4, b_1, [1, 1], [1, 1], [1, 1], False, [0, 0], 2), (2, 8, 16, 16), (2048, 1, 128, 8)" in cpu


def test_the_compilers_cpu_rule_puts_graphs_with_grouped_convolutions_channels_last():
    # the rule for graphs the front did not measure (see ferrocore/conv_layout.py)
    def layout_log(groups):
        result = compile_fake_cuda(lambda x, w: torch.nn.functional.conv2d(x, w, groups=groups).relu(),
                                   (1, 8, 8, 8), (8, 8 // groups, 3, 3), device="cpu", logs=["layout"])
        return "".join(log["text"] for log in result["logs"] if log["channel"] == "layout")

    assert layout_log(1).startswith("layout: eager's: 1 dense convolutions run on the CPU")
    assert layout_log(8).startswith("layout: channels-last for 4-D activations: 1 convolutions (1 grouped")


def test_channels_last_only_where_convolutions_dominate():
    def conv_then(x, w, steps):
        y = torch.nn.functional.conv2d(x, w)
        for _ in range(steps):
            y = y * 1.5 + 1.0
        return y

    def layout_log(steps):
        result = compile_fake_cuda(lambda x, w: conv_then(x, w, steps), (1, 3, 8, 8), (4, 3, 3, 3), logs=["layout"])
        return "".join(log["text"] for log in result["logs"] if log["channel"] == "layout")

    assert layout_log(2).startswith("layout: channels-last for 4-D activations: 1 convolutions")
    # a lone convolution among hundreds of nodes (a transformer's patch embedding) is left as is
    assert layout_log(200).startswith("layout: eager's: 1 convolution(s) among")


def test_a_library_result_copied_into_a_fresh_tensor_of_its_layout_is_not_copied(monkeypatch):
    # `out = empty(..); out.copy_(a @ b)` (FlexAttention's output is spelled so): the GEMM's
    # buffer is the copy; a copy of an input stays a copy (GEMMs library calls: on the CPU
    # one this small is otherwise a kernel)
    monkeypatch.setenv("FERROCORE_GEMM_TEMPLATE", "never")
    a, b = torch.randn(64, 48, device=TEST_DEVICE), torch.randn(48, 32, device=TEST_DEVICE)

    def into_fresh(a, b):
        out = torch.empty(64, 32, device=a.device)
        out.copy_(a @ b)
        return out

    check(into_fresh, a, b, expect_kernels=0)

    def copy_of_input(a):
        out = torch.empty(64, 48, device=a.device)
        out.copy_(a)
        return out

    check(copy_of_input, a, expect_kernels=1)
    torch._dynamo.reset()
    assert torch.compile(copy_of_input, backend="ferrocore")(a).data_ptr() != a.data_ptr()

    def product_and_its_copy(a, b):
        y = a @ b
        out = torch.empty(64, 32, device=a.device)
        out.copy_(y)
        return y, out

    torch._dynamo.reset()
    y, out = torch.compile(product_and_its_copy, backend="ferrocore")(a, b)
    assert y.data_ptr() != out.data_ptr(), "two returned tensors share a storage"
    torch.testing.assert_close(out, a @ b)
