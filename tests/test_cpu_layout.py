"""CPU performance decisions that must not change results: the layout a convolution graph takes
(measured per shape), index checks hoisted out of inner loops, and the kernel clock the model
benchmark reads."""

import pytest
import torch

import ferrocore
from ferrocore import conv_layout
from helpers import check

pytestmark = [pytest.mark.ferrocore_only, pytest.mark.cpu_only("CPU layout and C++ kernels")]


class UNetLevel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.down = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x):
        y = torch.relu(self.down(x))
        y = torch.nn.functional.max_pool2d(self.dw(y) * torch.sigmoid(y), 2)
        return self.up(y).sum(1, keepdim=True) + x[:, :1]


@pytest.mark.parametrize("nhwc_faster", [True, False])
def test_a_cpu_convolution_graph_takes_the_layout_its_convolutions_measured_faster_in(
        nhwc_faster, monkeypatch, capfd, tmp_path):
    def measure(sig, channels_last):
        return 1.0 if channels_last == nhwc_faster else 2.0

    monkeypatch.setattr(conv_layout, "_measure", measure)
    model = UNetLevel()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend="ferrocore",
                            options={"logs": "layout", "cache_dir": str(tmp_path), "graph_cache": False})(x)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()
    err = capfd.readouterr().err
    expect = "layout: channels-last" if nhwc_faster else "layout: eager's"
    assert f"{expect}: 2 convolutions measured" in err, err
    # measured once per shape: a second compile reads the timings back from the cache
    monkeypatch.setattr(conv_layout, "_measure", lambda sig, cl: pytest.fail("measured again"))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="ferrocore", options={"logs": "layout", "cache_dir": str(tmp_path), "graph_cache": False})(x)
    assert f"{expect}: 2 convolutions measured" in capfd.readouterr().err


def test_an_asked_for_layout_is_not_measured(monkeypatch):
    monkeypatch.setattr(conv_layout, "_measure", lambda sig, cl: pytest.fail("measured"))
    model = UNetLevel()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        got = torch.compile(model, backend="ferrocore", options={"conv_layout": "contiguous"})(x)
        torch.testing.assert_close(got, model(x))


def test_an_index_fixed_across_the_inner_loop_is_checked_before_it():
    # an embedding row feeding a LayerNorm: the row index is checked once per row, outside the
    # vectorized loop over the row's elements
    def f(table, ids):
        return torch.nn.functional.layer_norm(table[ids], (64,))

    table, ids = torch.randn(50, 64), torch.randint(0, 50, (8,))
    check(f, table, ids)
    source = open(ferrocore.metrics.last["module_path"]).read()
    kernel = source[source.index('extern "C" int cpp_red'):]
    inner = kernel[kernel.index("#pragma omp simd"):]
    inner = inner[:inner.index("}")]
    assert "bad" in kernel and "|| (" not in inner, inner
    compiled = torch.compile(f, backend="ferrocore")
    with pytest.raises(IndexError):
        compiled(table, torch.tensor([0, 50]))


def test_profiled_kernels_clock_their_calls_and_compute_the_same(monkeypatch):
    from ferrocore.runtime.cpp_library import kernel_clock

    monkeypatch.setenv("FERROCORE_PROFILE_KERNELS", "1")

    def f(x):
        return (x.sin() * 2).sum(0)

    x = torch.randn(64, 33)
    compiled = torch.compile(f, backend="ferrocore")
    compiled(x)
    for entry in kernel_clock.values():
        entry[:] = [0, 0]
    for _ in range(3):
        torch.testing.assert_close(compiled(x), f(x))
    counted = {k: v for k, v in kernel_clock.items() if v[1]}
    assert counted and all(calls == 3 and ns > 0 for ns, calls in counted.values()), counted
    assert all(name in open(ferrocore.metrics.last["module_path"]).read() for name in counted)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_group_norm_in_either_layout(layout, affine):
    """Channels-last: statistics reduced in memory order, applied as a per-channel scale and
    shift (eager's CPU form); eager's layout: the group statistics applied directly."""
    conv = torch.nn.Conv2d(3, 32, 3, padding=1)
    norm = torch.nn.GroupNorm(4, 32, affine=affine)
    if affine:
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)

    def block(x):
        return torch.nn.functional.silu(norm(conv(x))) + 1

    with torch.no_grad():
        x = torch.randn(2, 3, 12, 12) * 3 + 1
        got = torch.compile(block, backend="ferrocore", options={"conv_layout": layout})(x)
        torch.testing.assert_close(got, block(x), rtol=1e-5, atol=1e-5)
