"""What compiled code does with inputs it was not compiled for: `as_strided` views that reach
outside their storage raise eager's error; a compiled module checks the size, stride, dtype and
device of each input (`wrapper/checks.rs`, switch `check_inputs` / FERROCORE_CHECK_INPUTS);
symbolic graphs specialize safely when several threads bring new shapes at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ferrocore
from ferrocore import options
from ferrocore.runtime import wrapper
from helpers import lookup_backend

DEVICE = torch.get_default_device()


def _eager_error(fn, *args) -> str:
    with pytest.raises(RuntimeError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("stride", [3, 1 << 20])
def test_as_strided_of_an_input_past_its_storage_raises_eagers_error(stride):
    def f(x):
        return x.as_strided((4,), (stride,)) + 1

    x = torch.arange(6.0)
    expected = _eager_error(f, x)
    compiled = torch.compile(f, backend=lookup_backend())
    with pytest.raises(RuntimeError) as info:
        compiled(x)
    assert str(info.value) == expected
    assert "out of bounds for storage of size 24" in expected


def test_as_strided_of_an_input_at_an_explicit_offset_past_its_storage_raises_eagers_error():
    def f(x):
        return x.as_strided((4,), (1,), 4) + 1

    x = torch.arange(6.0)
    expected = _eager_error(f, x)
    with pytest.raises(RuntimeError) as info:
        torch.compile(f, backend=lookup_backend())(x)
    assert str(info.value) == expected


def test_as_strided_of_an_intermediate_past_its_storage_raises_eagers_error():
    def f(x):
        return (x + 1).as_strided((4,), (3,)) + 1

    x = torch.arange(6.0)
    expected = _eager_error(f, x)
    with pytest.raises(RuntimeError) as info:
        torch.compile(f, backend=lookup_backend())(x)
    assert str(info.value) == expected


def test_as_strided_within_a_larger_storage_reads_what_eager_reads():
    # the input is a view: its storage reaches past its own elements, which as_strided may read
    def f(x):
        return x.as_strided((4,), (3,)) + 1

    base = torch.arange(16.0)
    x = base[:6]
    out = torch.compile(f, backend=lookup_backend())(x)
    torch.testing.assert_close(out, f(x))
    assert out.shape == (4,) and out.stride() == (1,) and out.dtype == torch.float32


def test_as_strided_of_a_slice_without_an_offset_starts_at_the_slice():
    # no storage offset given: the operand's own (1 here), not the input's
    def f(x):
        return x[1:].as_strided((4,), (1,)) + 1

    x = torch.arange(6.0)
    torch.testing.assert_close(torch.compile(f, backend=lookup_backend())(x), f(x))


def _compiled_graph(opts: dict | None = None):
    def f(a, b):
        return (a @ b).relu() + a

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    return f, ferrocore.compile_graph(gm, options=opts)


WRONG_INPUTS = {
    "size": (lambda: torch.randn(3, 3), "size (3, 3), stride (3, 1)"),
    "stride": (lambda: torch.randn(4, 4).t(), "size (4, 4), stride (1, 4)"),
    "dtype": (lambda: torch.randn(4, 4, dtype=torch.float64), "float64 on"),
    "device": (lambda: torch.randn(4, 4, device="meta"), "on meta"),
    "non-tensor": (lambda: 1.5, "got a float"),
}


@pytest.mark.ferrocore_only
@pytest.mark.parametrize("wrong", list(WRONG_INPUTS))
def test_a_compiled_module_rejects_an_input_unlike_the_one_it_was_compiled_for(wrong):
    f, fn = _compiled_graph()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(fn(a, b)[0], f(a, b))
    make, got = WRONG_INPUTS[wrong]
    with pytest.raises(wrapper.InputMismatch) as info:
        fn(a, make())
    message = str(info.value)
    assert "input 1 (b_1)" in message, message
    assert f"expected float32 on {DEVICE}, size (4, 4), stride (4, 1)" in message, message
    assert got in message, message


@pytest.mark.ferrocore_only
@pytest.mark.parametrize("count", [1, 3])
def test_a_compiled_module_rejects_a_wrong_number_of_inputs(count):
    _, fn = _compiled_graph()
    with pytest.raises(wrapper.InputMismatch, match=f"takes 2 inputs; got {count}"):
        fn(*[torch.randn(4, 4) for _ in range(count)])


@pytest.mark.ferrocore_only
def test_a_compiled_module_rejects_a_large_input_of_the_wrong_size():
    # 3000x3000 into a 4x4 graph read out of bounds (a segfault) before the check
    _, fn = _compiled_graph()
    with pytest.raises(wrapper.InputMismatch, match=r"size \(3000, 3000\)"):
        fn(torch.randn(3000, 3000), torch.randn(4, 4))


@pytest.mark.ferrocore_only
def test_the_input_check_switch_leaves_the_check_out_of_the_module():
    _, checked = _compiled_graph()
    checked_source = ferrocore.metrics.last["module_path"]
    _, unchecked = _compiled_graph({"check_inputs": False})
    unchecked_source = ferrocore.metrics.last["module_path"]
    assert "assert_size_stride_grouped" in open(checked_source).read()
    assert "assert_size_stride_grouped" not in open(unchecked_source).read()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(unchecked(a, b)[0], checked(a, b)[0])


def test_the_input_check_switch_reads_its_environment_variable(monkeypatch):
    assert options.build_options()["check_inputs"] is True
    monkeypatch.setenv("FERROCORE_CHECK_INPUTS", "0")
    assert options.build_options()["check_inputs"] is False
    assert options.build_options({"check_inputs": True})["check_inputs"] is True


@pytest.mark.ferrocore_only
@pytest.mark.cpu_only("runs the saved module on CPU tensors in a subprocess")
def test_a_saved_module_run_on_its_own_rejects_a_wrong_input():
    _compiled_graph()
    path = ferrocore.metrics.last["module_path"]
    script = (
        "import runpy, torch\n"
        f"m = runpy.run_path({path!r})\n"
        "out = m['call'](m['make_inputs']())\n"
        "assert out[0].shape == (4, 4)\n"
        "m['call']([torch.randn(4, 4), torch.randn(3000, 3000)])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 1, proc.stderr
    assert "InputMismatch: ferrocore: input 1 (b_1)" in proc.stderr, proc.stderr
    assert "got float32 on cpu, size (3000, 3000), stride (3000, 1)" in proc.stderr, proc.stderr


# torch before 2.12 keeps "an FX trace is running" in a module global: while one thread
# specializes (make_fx), another entering a compiled function raises torch's "Detected that you
# are using FX to symbolically trace a dynamo-optimized function" (seen on torch 2.11)
FX_TRACING_FLAG_PER_THREAD = hasattr(torch.fx._symbolic_trace, "_is_fx_tracing_tls")


@pytest.mark.ferrocore_only
@pytest.mark.xfail(not FX_TRACING_FLAG_PER_THREAD, reason="this torch's FX-tracing flag is global", strict=False)
def test_new_shapes_from_several_threads_at_once_compile_each_shape_once():
    def f(x):
        return (x * 2).sin().sum(0)

    compiled = torch.compile(f, backend=lookup_backend(), dynamic=True)
    # warmed up in a thread: the main thread's default-device mode (GPU runs) is a guard that a
    # thread without it fails, and Dynamo would trace again
    warm = threading.Thread(target=lambda: compiled(torch.randn(3, 5, device=DEVICE)))
    warm.start()
    warm.join()
    ferrocore.metrics.reset()
    threads, errors, results = 4, [], {}
    barrier = threading.Barrier(threads)

    def work(i):
        x = torch.randn(7 + i % 2, 9, device=DEVICE)  # two threads per new shape (the default device is per thread)
        barrier.wait()
        try:
            results[i] = (compiled(x), f(x))
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(f"{type(e).__name__}: {e}")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    # torch 2.11 patches `dynamic=True`'s settings into the global config around each call, not
    # per thread: calls that overlap can leave them set for later tests
    saved = {k: getattr(torch._dynamo.config, k) for k in ("assume_static_by_default", "automatic_dynamic_shapes")}
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        for k, v in saved.items():
            setattr(torch._dynamo.config, k, v)
    assert not errors, errors
    for got, want in results.values():
        torch.testing.assert_close(got, want)
    assert len(results) == threads
    assert ferrocore.metrics.total["graphs"] == 2  # (7, 9) and (8, 9), once each


def test_zero_dim_inputs_declared_on_the_gpu_are_the_ones_moved_there():
    # an attention's saved random-number state: declared on the GPU by torch's fake tensors,
    # handed over on the CPU; the compiled call moves it (found by the CUDA test run)
    from torch._subclasses import FakeTensorMode

    from ferrocore.prepare import declared_gpu_scalars

    graph = torch.fx.Graph()
    with FakeTensorMode():
        vals = [torch.empty((), dtype=torch.int64, device="cuda"), torch.empty((), device="cpu"),
                torch.empty((3,), device="cuda"), torch.empty((), dtype=torch.int64, device="cuda")]
    for i, v in enumerate(vals):
        graph.placeholder(f"a{i}").meta["val"] = v
    graph.output(())
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert declared_gpu_scalars(gm, host=[]) == [0, 3]
    assert declared_gpu_scalars(gm, host=[3]) == [0]
