"""Differential-testing helpers for the end-to-end suite.

`check(fn, *inputs)` runs `fn` eagerly and through `torch.compile` with the backend named by
`FERROCORE_TEST_BACKEND` (default `ferrocore`) and asserts that every output agrees in type,
shape, stride, dtype, device and value. With the ferrocore backend it also asserts that the graph
was really compiled (no whole-graph eager fallback, no per-node ATen fallback unless allowed) and,
when asked, how many kernels were generated.

Setting the backend to `inductor`, `aot_eager` or `eager` runs the same tests against PyTorch's own
backends; that is how the tests themselves are validated.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable
from unittest import mock

import torch
import torch._dynamo
from torch.utils import _pytree as pytree

BACKEND = os.environ.get("FERROCORE_TEST_BACKEND", "ferrocore")

# Backends whose generated kernels can be counted after a compile.
KERNEL_COUNTING_BACKENDS = ("ferrocore", "inductor")

# (rtol, atol) per floating dtype; integer and bool results are compared exactly.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


def is_ferrocore() -> bool:
    return BACKEND == "ferrocore"


def can_count_kernels() -> bool:
    return BACKEND in KERNEL_COUNTING_BACKENDS


def ferrocore_metrics():
    """The `ferrocore.metrics` module; importing it registers the backend."""
    import ferrocore  # noqa: F401  (registers the dynamo backend)
    import ferrocore.metrics

    return ferrocore.metrics


def lookup_backend() -> Callable:
    """The selected dynamo backend as a callable `(GraphModule, example_inputs) -> callable`."""
    if is_ferrocore():
        ferrocore_metrics()  # fail loudly here if ferrocore is not importable
    return torch._dynamo.lookup_backend(BACKEND)


class CountingBackend:
    """Wraps a dynamo backend and counts the graphs handed to it.

    A test whose function never reaches the backend (dynamo skipped the frame, or the graph was
    empty) would compare eager with eager; `check` refuses that.
    """

    def __init__(self, inner: Callable):
        self.inner = inner
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


def compile_fn(fn: Callable, backend: Callable | None = None) -> tuple[Callable, CountingBackend]:
    counting = CountingBackend(backend if backend is not None else lookup_backend())
    compiled = torch.compile(fn, backend=counting, dynamic=False, fullgraph=True)
    return compiled, counting


# ----------------------------------------------------------------------------------------------
# Compile statistics (kernel counts, fallbacks), uniform over the backends that report them.


def _as_count(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    return len(value)


@dataclass
class CompileStats:
    kernels: int | None = None  # None: the backend cannot count kernels
    externs: int | None = None
    fallbacks: int = 0
    fallback_ops: list = field(default_factory=list)
    graph_fallback: bool = False
    raw: dict = field(default_factory=dict)


def reset_stats() -> None:
    if is_ferrocore():
        ferrocore_metrics().reset()


def read_stats() -> CompileStats:
    """Statistics of the graph compiled since the last `reset_stats()` (ferrocore only)."""
    if is_ferrocore():
        metrics = ferrocore_metrics()
        last = metrics.last
        assert last, (
            "ferrocore.metrics.last is empty after compiling: the ferrocore backend did not "
            "compile this graph"
        )
        # `check` compiles with fullgraph=True, so the last graph is the function's only graph
        # (dynamo may hand the backend the same graph twice when it restarts an analysis; the
        # summed `metrics.total` would count that twice).
        kernels = _as_count(last.get("kernels"))
        externs = _as_count(last.get("externs"))
        fallbacks = _as_count(last.get("fallbacks"))
        graph_fallback = bool(last.get("graph_fallback", False))
        return CompileStats(
            kernels=kernels,
            externs=externs,
            fallbacks=fallbacks,
            fallback_ops=list(last.get("fallback_ops") or []),
            graph_fallback=graph_fallback,
            raw=dict(last),
        )
    return CompileStats()


@contextlib.contextmanager
def capture_inductor_kernels(stats: CompileStats):
    """Counts the kernels in the wrapper modules inductor generates inside the block.

    (`torch._inductor.metrics.generated_kernel_count` counts every C++ loop variant, scalar,
    vectorized and tail, so it is not a kernel count on CPU.) The FX graph cache is off so that
    the code is generated, not loaded.
    """
    import torch._inductor.config
    from torch._inductor.graph import GraphLowering

    sources: list[str] = []
    original = GraphLowering.save_output_code

    def save_output_code(code: str) -> None:
        sources.append(code)
        if original is not None:
            original(code)

    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        mock.patch.object(GraphLowering, "save_output_code", staticmethod(save_output_code)),
    ):
        yield
    assert sources, "inductor generated no wrapper module"
    # The last module is the final graph (dynamo may restart an analysis and compile twice).
    stats.kernels = len(re.findall(r"async_compile\.(?:cpp_pybinding|cpp|triton)\(", sources[-1]))


# ----------------------------------------------------------------------------------------------
# Output comparison.


def _is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    from ferrocore.strides import is_dense

    return is_dense(t.shape, t.stride())


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Strides agree on every dim of size > 1 (strides of size-0/1 dims are meaningless)."""
    if a.dim() != b.dim():
        return False
    return all(size <= 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _aliases_any(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return False
    ptr = storage.data_ptr()
    return any(i.untyped_storage().data_ptr() == ptr for i in inputs)


def _is_constant(t: torch.Tensor) -> bool:
    """All elements equal (NaNs count as equal to each other)."""
    if t.numel() < 2:
        return False
    flat = t.detach().reshape(-1)
    first = flat[0]
    if t.is_floating_point() and bool(torch.isnan(first)):
        return bool(torch.isnan(flat).all())
    return bool((flat == first).all())


def _tolerances(dtype: torch.dtype, rtol, atol) -> tuple[float, float]:
    """Per-dtype defaults, overridden by the test; integers and bools are always exact."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return (0.0, 0.0)
    default = TOLERANCES.get(dtype, (1e-4, 1e-5))
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def assert_same_output(
    expected: Any,
    actual: Any,
    *,
    inputs: list[torch.Tensor],
    rtol: float | None = None,
    atol: float | None = None,
    what: str = "output",
) -> None:
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    assert exp_spec == act_spec, (
        f"{what}: structure differs: eager {exp_spec} vs compiled {act_spec}"
    )
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        where = f"{what}[{i}]"
        assert type(e) is type(a), f"{where}: type {type(a).__name__}, eager {type(e).__name__}"
        if not isinstance(e, torch.Tensor):
            if isinstance(e, float) and math.isnan(e):
                assert math.isnan(a), f"{where}: {a!r}, eager {e!r}"
            else:
                assert e == a, f"{where}: {a!r}, eager {e!r}"
            continue
        e, a = e.detach(), a.detach()
        alias = _aliases_any(e, inputs)
        assert a.shape == e.shape, f"{where}: shape {tuple(a.shape)}, eager {tuple(e.shape)}"
        # Outputs that alias an input in eager are compared by value, shape and stride only:
        # the compiled program may return a view or an equivalent copy.
        if not alias:
            assert a.dtype == e.dtype, f"{where}: dtype {a.dtype}, eager {e.dtype}"
            assert a.device == e.device, f"{where}: device {a.device}, eager {e.device}"
        if e.numel() > 1 and (alias or _is_non_overlapping_and_dense(e)):
            assert _same_strides(e, a), (
                f"{where}: stride {a.stride()}, eager {e.stride()} (shape {tuple(e.shape)})"
            )
        r, t = _tolerances(e.dtype, rtol, atol)
        torch.testing.assert_close(
            a, e, rtol=r, atol=t, equal_nan=True, msg=lambda m, where=where: f"{where}: {m}"
        )


def _snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _assert_inputs_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for i, (b, a) in enumerate(zip(before, after)):
        torch.testing.assert_close(
            a.detach(),
            b,
            rtol=0,
            atol=0,
            equal_nan=True,
            msg=lambda m, i=i: f"input {i} was modified by the compiled function: {m}",
        )


# ----------------------------------------------------------------------------------------------
# The entry point used by the tests.


def check(
    fn: Callable,
    *inputs: Any,
    atol: float | None = None,
    rtol: float | None = None,
    expect_kernels: int | None = None,
    max_kernels: int | None = None,
    allow_fallbacks: bool = False,
    allow_constant: bool = False,
    backend: Callable | None = None,
) -> CompileStats:
    """Compare `fn(*inputs)` eager vs compiled; return the compile statistics.

    expect_kernels / max_kernels: asserted when the backend can count kernels (ferrocore,
    inductor); ignored for `eager`/`aot_eager`.
    allow_fallbacks: permit per-node ATen fallbacks in ferrocore (never a whole-graph fallback).
    allow_constant: permit an output whose elements are all equal; otherwise such an output is
    rejected because a wrong compiler could produce it by accident (all zeros, all False).
    backend: a dynamo backend callable to use instead of the selected one (for testing this
    harness); compile statistics are then not read.
    """
    tensor_inputs = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    before = _snapshot(tensor_inputs)

    expected = fn(*inputs)
    _assert_inputs_unchanged(before, tensor_inputs)
    exp_leaves = pytree.tree_leaves(expected)
    assert any(isinstance(x, torch.Tensor) for x in exp_leaves), "fn must return a tensor"
    if not allow_constant:
        for i, leaf in enumerate(exp_leaves):
            if isinstance(leaf, torch.Tensor):
                assert not _is_constant(leaf), (
                    f"test bug: eager output {i} is constant ({leaf.reshape(-1)[0].item()!r}); "
                    "choose inputs that make it vary or pass allow_constant=True"
                )

    selected = backend is None
    torch._dynamo.reset()
    if selected:
        reset_stats()
    compiled, counting = compile_fn(fn, backend)
    count_inductor = (
        selected
        and BACKEND == "inductor"
        and (expect_kernels is not None or max_kernels is not None)
    )
    inductor_stats = CompileStats()
    graphs_after_first_call = None
    for call in ("first", "second"):
        if count_inductor and call == "first":
            with capture_inductor_kernels(inductor_stats):
                actual = compiled(*inputs)
        else:
            actual = compiled(*inputs)
        assert counting.graphs >= 1, "the backend was never called: nothing was compiled"
        if graphs_after_first_call is None:
            graphs_after_first_call = counting.graphs
        _assert_inputs_unchanged(before, tensor_inputs)
        assert_same_output(
            expected,
            actual,
            inputs=tensor_inputs,
            rtol=rtol,
            atol=atol,
            what=f"{call} compiled call, output",
        )
    assert counting.graphs == graphs_after_first_call, "the second call recompiled"

    if not selected:
        return CompileStats()
    stats = inductor_stats if count_inductor else read_stats()
    if is_ferrocore():
        assert not stats.graph_fallback, (
            "ferrocore ran the whole graph eagerly (graph_fallback): "
            f"{stats.raw.get('graph_fallback_reason', stats.raw)}"
        )
        if not allow_fallbacks:
            assert stats.fallbacks == 0, f"ferrocore fell back to ATen for {stats.fallback_ops}"
    if stats.kernels is not None:
        if expect_kernels is not None:
            assert stats.kernels == expect_kernels, (
                f"{BACKEND} generated {stats.kernels} kernels, expected {expect_kernels}"
            )
        if max_kernels is not None:
            assert stats.kernels <= max_kernels, (
                f"{BACKEND} generated {stats.kernels} kernels, expected at most {max_kernels}"
            )
    return stats


def assert_mixed_bool(t: torch.Tensor) -> None:
    """A boolean result must contain both values, or the test could not catch a constant."""
    assert t.dtype == torch.bool
    assert bool(t.any()) and not bool(t.all()), "test bug: boolean result is all one value"


def raises_index_error(call: Callable[[], Any]) -> bool:
    """Whether `call()` with an out-of-range gather index raises IndexError: at once on the host;
    on a GPU at a later call of the same graph (the check reads its flag without waiting), as
    eager CUDA reports a device-side assert at a later synchronization."""
    try:
        out = call()
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize()
            call()
    except IndexError:
        return True
    return False
