"""CPU convolutions the compiler runs itself instead of oneDNN (`lowering/cpu_conv.rs`): small
1x1 convolutions as GEMMs and small depthwise ones as generated kernels, in either layout, with
eager's values, shapes, strides and dtypes; oneDNN keeps the rest. The layout measurement
leaves the compiled ones out, by a rule that must match the compiler's."""

import pytest
import torch

import ferrocore
from ferrocore import conv_layout

pytestmark = [pytest.mark.ferrocore_only, pytest.mark.cpu_only("CPU convolution lowering")]

LAYOUTS = ["contiguous", "channels_last"]


def conv_then_relu(x, w, b, stride, padding, dilation, groups):
    return torch.relu(torch.conv2d(x, w, b, stride, padding, dilation, groups)) * 2


def compiled_conv(x, w, b, stride=1, padding=0, dilation=1, groups=1, layout="contiguous"):
    """Compiled vs eager (float64 reference) for one convolution; the compile's metrics."""
    args = (stride, padding, dilation, groups)
    want = conv_then_relu(x, w, b, *args)
    ref = conv_then_relu(x.double(), w.double(), None if b is None else b.double(), *args)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(conv_then_relu, backend="ferrocore", options={"conv_layout": layout})(x, w, b, *args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)
    return ferrocore.metrics.last


def library_convolutions(metrics) -> int:
    return sum("convolution" in op for op in metrics["extern_ops"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 8, 5, 7, 16), (1, 24, 4, 4, 120), (3, 168, 1, 1, 40)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_small_1x1_convolution_runs_as_a_gemm(layout, shape, bias):
    n, c, h, w, o = shape
    x = torch.randn(n, c, h, w)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    m = compiled_conv(x, torch.randn(o, c, 1, 1), torch.randn(o) if bias else None, layout=layout)
    assert library_convolutions(m) == 0, m["extern_ops"]
    assert any(op.endswith(("mm.default", "bmm.default")) for op in m["extern_ops"]), m["extern_ops"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry", [
    # (n, c, h, w, kernel, stride, padding, dilation)
    (2, 16, 9, 9, 3, 1, 1, 1),
    (2, 24, 16, 16, 5, 2, 2, 1),
    (1, 32, 8, 6, 7, 1, 3, 1),
    (2, 8, 7, 7, 3, 2, 0, 1),
    (2, 8, 11, 11, 3, 1, 2, 2),
])
@pytest.mark.parametrize("bias", [True, False])
def test_a_small_depthwise_convolution_runs_as_a_generated_kernel(layout, geometry, bias):
    n, c, h, w, k, s, p, d = geometry
    x = torch.randn(n, c, h, w)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    m = compiled_conv(x, torch.randn(c, 1, k, k), torch.randn(c) if bias else None, s, p, d, c, layout)
    assert library_convolutions(m) == 0, m["extern_ops"]
    assert m["externs"] == 0


def test_padding_does_not_leak_non_finite_values_into_the_window():
    x = torch.randn(1, 8, 6, 6)
    x[:, :, 0, :] = float("inf")  # taps of the padded border must still read zeros beside it
    w = torch.randn(8, 1, 3, 3).abs()
    want = torch.conv2d(x, w, None, 1, 1, 1, 8)
    torch._dynamo.reset()
    got = torch.compile(lambda x, w: torch.conv2d(x, w, None, 1, 1, 1, 8), backend="ferrocore")(x, w)
    torch.testing.assert_close(got, want, equal_nan=True)


def test_large_convolutions_stay_with_onednn():
    big_1x1 = compiled_conv(torch.randn(2, 256, 32, 32), torch.randn(256, 256, 1, 1), None)
    assert library_convolutions(big_1x1) == 1
    big_depthwise = compiled_conv(torch.randn(2, 64, 40, 40), torch.randn(64, 1, 3, 3), None, 1, 1, 1, 64)
    assert library_convolutions(big_depthwise) == 1
    strided_1x1 = compiled_conv(torch.randn(2, 8, 8, 8), torch.randn(16, 8, 1, 1), None, 2)
    assert library_convolutions(strided_1x1) == 1


@pytest.mark.parametrize("case", [
    # (x, w, stride, padding, dilation, groups)
    ((2, 8, 5, 7), (16, 8, 1, 1), 1, 0, 1, 1),
    ((2, 256, 32, 32), (256, 256, 1, 1), 1, 0, 1, 1),
    ((2, 8, 8, 8), (16, 8, 1, 1), 2, 0, 1, 1),
    ((2, 8, 8, 8), (16, 8, 3, 3), 1, 1, 1, 1),
    ((2, 16, 9, 9), (16, 1, 3, 3), 1, 1, 1, 16),
    ((2, 64, 40, 40), (64, 1, 3, 3), 1, 1, 1, 64),
    ((2, 16, 9, 9), (32, 1, 3, 3), 1, 1, 1, 16),
    ((1, 32, 20, 20), (32, 1, 9, 9), 1, 4, 1, 32),
])
def test_the_layout_measurement_leaves_out_exactly_the_convolutions_the_compiler_runs(case):
    xs, ws, s, p, d, g = case
    x, w = torch.randn(xs), torch.randn(ws)
    sig = {"x": list(xs), "w": list(ws), "dtype": "torch.float32", "stride": [s, s], "padding": [p, p],
           "dilation": [d, d], "transposed": False, "output_padding": [0, 0], "groups": g, "backward": False}
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lambda x, w: torch.conv2d(x, w, None, s, p, d, g), backend="ferrocore",
                      options={"conv_layout": "contiguous"})(x, w)
    assert conv_layout._compiled(sig) == (library_convolutions(ferrocore.metrics.last) == 0), sig


def test_a_model_of_depthwise_and_1x1_convolutions_trains_as_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 5, padding=2, groups=16), torch.nn.Hardswish(),
        torch.nn.Conv2d(16, 24, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Conv2d(24, 10, 1), torch.nn.Flatten())
    x = torch.randn(2, 3, 12, 12)
    compiled = torch.compile(model, backend="ferrocore", options={"conv_layout": "channels_last"})
    want = model(x)
    want.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = compiled(x)
    got.square().mean().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)
