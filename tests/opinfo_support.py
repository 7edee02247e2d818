"""The OpInfo conformance harness: PyTorch's OpInfo samples, run eagerly and through ferrocore.

`tests/test_opinfo.py` is the pytest front; this module owns everything else:

- selection: which OpInfos of `op_db` reach core ATen (`select_core_ops`), decided by tracing one
  sample per OpInfo with `make_fx` and torch's core-ATen decompositions (what AOT autograd hands
  ferrocore) and keeping those whose graph calls an overload tagged `torch.Tag.core`;
- one sample, compiled with `torch.compile(backend="ferrocore", dynamic=False, fullgraph=False)`
  and compared with eager (`run_sample`), classified as passed / failed / errored / fallback
  (or skipped when eager itself rejects the sample);
- tolerances (`tolerances`): the per-dtype defaults of `tests/helpers.py`, raised to the OpInfo's
  own `toleranceOverride` where it declares one; float16/bfloat16 results may instead match an
  eager run on float32 inputs rounded to the low dtype (ferrocore, like Inductor, computes half
  types in float32 and rounds only at stores);
- random ops: compared by value first (ferrocore may fall back to ATen's generator); when that
  fails, by distribution (mean and standard deviation within a sampling bound) and, always, by
  reproducibility (same seed, same result, twice through the compiled function);
- the sweep report (`Report`): per op and dtype counts, first error line, fallback ops, and the
  ATen overloads that the failing graphs contained, as JSON and Markdown.

It must not decide what passes in CI: `tests/test_opinfo.py` holds the subset and KNOWN_FAILURES.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch._dynamo
from torch.utils import _pytree as pytree

from helpers import TOLERANCES, _is_non_overlapping_and_dense, _same_strides, assert_same_output

# The dtypes the harness tests, in the order reports list them.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.bool,
)
DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in DTYPES}
DTYPES_BY_NAME = {n: d for d, n in DTYPE_NAMES.items()}
LOW_PRECISION = (torch.float16, torch.bfloat16)

STATUSES = ("passed", "failed", "errored", "fallback", "skipped")

# A sample that compiles or runs longer than this is an error (a hang must not stall the sweep).
SAMPLE_TIMEOUT_S = 120
NO_GRAPH = "<no graph: dynamo ran it eagerly>"

# Random outputs with at least this many elements get the tight distribution bound; smaller ones
# (OpInfo samples are mostly 5x5) only a loose sanity bound.
LARGE_SAMPLE = 1024
# Random ops get one extra sample of about this many elements (when eager accepts it).
LARGE_SAMPLE_NUMEL = 16384

# Overloads that only move or relabel data; they appear in almost every graph, so a failing graph
# is not attributed to them when it holds anything else.
LAYOUT_OVERLOADS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.permute.default",
    "aten.expand.default",
    "aten.clone.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.squeeze.default",
    "aten.alias.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.as_strided.default",
    "aten.copy.default",
    "aten._to_copy.default",
}


def op_id(op) -> str:
    """The OpInfo's name as PyTorch's own tests spell it (`name.variant`)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_db_by_id() -> dict:
    from torch.testing._internal.common_methods_invocations import op_db

    return {op_id(op): op for op in op_db}


# The device samples are made on: FERROCORE_TEST_DEVICE=cuda runs the harness on a GPU (ferrocore's
# Triton backend); the default is the CPU (the C++ backend).
DEVICE = os.environ.get("FERROCORE_TEST_DEVICE", "cpu")


def cpu_dtypes(op) -> list[torch.dtype]:
    """The harness dtypes the OpInfo supports on the harness device, in `DTYPES` order."""
    supported = op.supported_dtypes(torch.device(DEVICE).type)
    return [d for d in DTYPES if d in supported]


# ----------------------------------------------------------------------------------------------
# Selection: the OpInfos whose samples reach core ATen.


def _traced_overloads(op, dtype) -> tuple[set[str], set[str]]:
    """(core, non-core) ATen overloads in the core-ATen graph of the OpInfo's first sample (the
    first four for random ops, whose first samples are often no-ops: dropout with p=0)."""
    core: set[str] = set()
    noncore: set[str] = set()
    samples = op.sample_inputs(DEVICE, dtype, requires_grad=False)
    for i, sample in enumerate(samples):
        c, n = _sample_overloads(op, sample)
        core |= c
        noncore |= n
        if core or i >= (3 if is_random(op) else 0):
            break
    return core, noncore


def _sample_overloads(op, sample) -> tuple[set[str], set[str]]:
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    seen: dict[str, bool] = {}
    with _plain_random_ops():
        try:
            gm = make_fx(
                lambda inp, args, kwargs: op.op(inp, *args, **kwargs),
                decomposition_table=core_aten_decompositions(),
            )(sample.input, sample.args, sample.kwargs)
            targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        except Exception:
            # Data-dependent ops (item, equal, one_hot) cannot be traced; record what eager
            # dispatches instead (no decompositions: an upper bound on what reaches a backend).
            targets = _dispatched_overloads(op, sample)
    for target in targets:
        if isinstance(target, torch._ops.OpOverload):
            seen[str(target)] = torch.Tag.core in target.tags
    return {o for o, core in seen.items() if core}, {o for o, core in seen.items() if not core}


def _dispatched_overloads(op, sample) -> list:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(func)
            return func(*args, **(kwargs or {}))

    with Record() as record:
        op.op(sample.input, *sample.args, **sample.kwargs)
    return record.calls


def _selection_key() -> str:
    from torch.testing._internal.common_methods_invocations import op_db

    dtypes = ",".join(DTYPE_NAMES.values())
    return f"v2 torch={torch.__version__} ops={len(op_db)} dtypes={dtypes}"


def select_core_ops(cache_file: Path | None = None) -> dict[str, dict]:
    """{op id: {"core": [...], "noncore": [...], "dtypes": [...]}} for the core-relevant OpInfos.

    Excluded: OpInfos with none of the harness dtypes on CPU (CUDA-only, sparse- or complex-only),
    in-place-only variants (no functional `op`), OpInfos whose sample cannot be built or run on
    CPU, and those whose graph contains no core-tagged overload. The result is cached in
    `cache_file` (keyed by the torch version and op_db size); a trace of all ~700 OpInfos takes
    ~10 s.
    """
    key = _selection_key()
    if cache_file is not None and cache_file.exists():
        try:
            cached = json.loads(cache_file.read_text())
            if cached.get("key") == key:
                return cached["ops"]
        except (OSError, ValueError):
            pass
    from torch.testing._internal.common_methods_invocations import op_db

    selected: dict[str, dict] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in op_db:
            dtypes = cpu_dtypes(op)
            in_place_only = op.name.endswith("_") and not op.name.startswith("__")  # zero_
            if not dtypes or op.op is None or in_place_only:
                continue
            core: set[str] = set()
            noncore: set[str] = set()
            for dtype in dtypes:  # `float` is a no-op on float32 but a copy on the others
                try:
                    c, n = _traced_overloads(op, dtype)
                except Exception:
                    continue  # no CPU sample (jiterator, sparse CSR ...)
                core |= c
                noncore |= n
                if core:
                    break
            if core:
                selected[op_id(op)] = {
                    "core": sorted(core),
                    "noncore": sorted(noncore),
                    "dtypes": [DTYPE_NAMES[d] for d in dtypes],
                }
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps({"key": key, "ops": selected}, indent=1))
    return selected


# ----------------------------------------------------------------------------------------------
# Random ops.


@contextlib.contextmanager
def _plain_random_ops():
    """OpInfos wrap random ops in `wrapper_set_seed` (freeze the RNG, seed 42). Dynamo cannot
    trace the RNG-state save/restore, so the op would never reach the backend; inside this block
    the wrapper just calls the op and the harness seeds the generator itself."""
    import torch.testing._internal.common_methods_invocations as cmi

    saved = cmi.wrapper_set_seed
    cmi.wrapper_set_seed = lambda fn, *args, **kwargs: fn(*args, **kwargs)
    try:
        yield
    finally:
        cmi.wrapper_set_seed = saved


def is_random(op) -> bool:
    """OpInfos of random ops call `wrapper_set_seed` (the rand_like family, dropout, bernoulli,
    normal, multinomial, rrelu, ...); `item` also does, harmlessly."""
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


def _enlarged(sample, random_op: bool):
    """A copy of a random op's sample with a large first input (repeated along a new leading
    dim), so its distribution can be checked tightly; None if the sample does not lend itself."""
    if sample is None:
        return None
    inp = sample.input
    if not random_op or not isinstance(inp, torch.Tensor) or inp.numel() == 0:
        return None
    if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((sample.args, sample.kwargs))):
        return None  # other tensor operands would no longer broadcast
    reps = max(1, math.ceil(LARGE_SAMPLE_NUMEL / inp.numel()))
    big = inp.detach().unsqueeze(0).expand(reps, *inp.shape).contiguous()
    return sample.__class__(big, args=sample.args, kwargs=sample.kwargs)


# ----------------------------------------------------------------------------------------------
# Tolerances.

# Test classes whose toleranceOverride decorators describe a backend-vs-eager comparison.
_TOLERANCE_CLASSES = (None, "TestInductorOpInfo", "TestDecomp", "TestCommon")


def opinfo_tolerance(op, dtype) -> tuple[float, float] | None:
    """The largest (rtol, atol) the OpInfo's own `toleranceOverride`s give `dtype` on CPU for the
    inductor, decomposition and common (eager-consistency) tests; None if it declares none."""
    from torch.testing._internal.common_device_type import toleranceOverride

    rtol = atol = None
    for info in getattr(op, "decorators", ()) or ():
        if getattr(info, "cls_name", "unset") not in _TOLERANCE_CLASSES:
            continue
        device = info.device_type
        here = torch.device(DEVICE).type
        if device is not None and device != here and (
            not isinstance(device, (list, tuple)) or here not in device
        ):
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
            continue
        if callable(info.active_if) or not info.active_if:
            continue
        for decorator in info.decorators:
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                tol = decorator.d[dtype]
                rtol = max(rtol or 0.0, tol.rtol)
                atol = max(atol or 0.0, tol.atol)
    return None if rtol is None else (rtol, atol)


def tolerances(op, dtype) -> tuple[float, float]:
    """(rtol, atol) for results of floating dtype `dtype` (integers and bools are exact)."""
    rtol, atol = TOLERANCES.get(dtype, (1e-4, 1e-5))
    own = opinfo_tolerance(op, dtype)
    if own is not None:
        rtol, atol = max(rtol, own[0]), max(atol, own[1])
    return rtol, atol


# ----------------------------------------------------------------------------------------------
# Observing ferrocore: every graph it is handed, its fallbacks and its overloads.


@dataclass
class Observed:
    graphs: int = 0
    graph_fallbacks: int = 0
    fallback_ops: list = field(default_factory=list)
    overloads: set = field(default_factory=set)
    fallback_reasons: dict = field(default_factory=dict)  # target -> ferrocore's reason

    @property
    def fallbacks(self) -> int:
        return len(self.fallback_ops)


@contextlib.contextmanager
def observe_ferrocore():
    """Records every `ferrocore.metrics` entry (a call may compile several graphs when dynamo
    breaks the function; `metrics.last` holds only the last) and the ATen overloads of each graph
    handed to ferrocore (through `ferrocore.dispatch.compile_request`, when it exists), why a graph ran
    eagerly (the reason of the `serialize_graph` exception) and why each node fell back (the
    `reason` of each fallback in the Rust result)."""
    import ferrocore.dispatch as dispatch
    import ferrocore.static_compile as static_compile
    from ferrocore.metrics import metrics

    observed = Observed()

    reasons: list[str] = []

    def record(entry, *more, _original=type(metrics).record):
        observed.graphs += 1
        observed.graph_fallbacks += int(bool(entry.get("graph_fallback")))
        observed.fallback_ops.extend(entry.get("fallback_ops") or [])
        if entry.get("graph_fallback"):
            reason = reasons.pop() if reasons else "?"
            observed.fallback_ops.append(f"<graph ran eagerly: {reason}>")
        _original(metrics, entry, *more)

    original_compile = getattr(dispatch, "compile_request", None)
    original_serialize = getattr(static_compile, "serialize_graph", None)

    def serialize(*args, **kwargs):
        try:
            return original_serialize(*args, **kwargs)
        except Exception as e:  # UnsupportedGraph: the graph will run eagerly
            reasons.append(str(getattr(e, "reason", e)).splitlines()[0][:120])
            raise

    def compile_(request):
        for node in request.gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                observed.overloads.add(str(node.target))
        return original_compile(request)

    try:
        from ferrocore import _ferrocore as extension
    except ImportError:  # compiling will say what is missing
        extension = None
    original_rust = getattr(extension, "compile_graph", None)

    def compile_graph(*args, **kwargs):
        out = original_rust(*args, **kwargs)
        try:
            for f in json.loads(out).get("fallbacks", ()):
                observed.fallback_reasons.setdefault(f.get("target", "?"), f.get("reason", ""))
        except (TypeError, ValueError, AttributeError):
            pass
        return out

    metrics.record = record
    if original_rust is not None:
        extension.compile_graph = compile_graph
    if original_compile is not None:
        dispatch.compile_request = compile_
    if original_serialize is not None:
        static_compile.serialize_graph = serialize
    try:
        yield observed
    finally:
        del metrics.record
        if original_rust is not None:
            extension.compile_graph = original_rust
        if original_compile is not None:
            dispatch.compile_request = original_compile
        if original_serialize is not None:
            static_compile.serialize_graph = original_serialize


# ----------------------------------------------------------------------------------------------
# One sample.


@dataclass
class SampleResult:
    op: str
    dtype: str
    index: int
    status: str  # one of STATUSES
    kind: str = ""  # failed: values|shape|dtype|stride|structure|type|mutation|reproducibility
    error: str = ""  # first line(s) of the failure or exception
    fallback_ops: list = field(default_factory=list)
    overloads: list = field(default_factory=list)  # ATen overloads ferrocore was handed
    fallback_reasons: dict = field(default_factory=dict)  # fallback target -> ferrocore's reason
    seconds: float = 0.0
    description: str = ""  # shapes of the sample, for reproducing it
    dynamo: str = "default"  # the DYNAMO_MODES entry whose graphs ferrocore compiled


class SampleTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise SampleTimeout(f"sample took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _innermost(exc: BaseException) -> BaseException:
    """Dynamo wraps backend errors (BackendCompilerFailed, InternalTorchDynamoError); the cause
    is the informative part."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc


_NOISE = re.compile(
    r"^(Set TORCH_LOGS|You can suppress|from user code|Traceback|  File "
    r"|backend='ferrocore' raised)"
)


def error_line(exc: BaseException) -> str:
    """`Type: message`, compressed to one line: the first lines that say something."""
    inner = _innermost(exc)
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip() and not _NOISE.match(ln)]
    text = " | ".join(lines[:4])
    return f"{type(inner).__name__}: {text}"[:400]


def describe(sample) -> str:
    def one(x) -> str:
        if isinstance(x, torch.Tensor):
            dense = "" if x.is_contiguous() else " noncontig"
            return f"T{list(x.shape)}{dense}"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(one(y) for y in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
        return repr(x)

    parts = [str(one(sample.input))] + [str(one(a)) for a in sample.args]
    parts += [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    return ", ".join(parts)[:200]


def _tensor_leaves(tree) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def _changed(before, tensors) -> bool:
    return any(
        b.shape != t.shape or not torch.equal(torch.nan_to_num(b), torch.nan_to_num(t.detach()))
        for b, t in zip(before, tensors)
    )


def _freeze(tree):
    """A copy of every tensor in `tree`, with the same strides where it is dense."""

    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach()
        if x.numel() <= 1 or _is_non_overlapping_and_dense(x):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)
        return x.clone()

    return pytree.tree_map(copy, tree)


def _restore(before, tensors) -> None:
    with torch.no_grad():
        for b, t in zip(before, tensors):
            if b.shape == t.shape:
                t.copy_(b)


def _failure_kind(message: str) -> str:
    m = re.search(r"\]: (structure|type|shape|dtype|device|stride) ", message)
    if m:
        return m.group(1)
    return "structure" if "structure differs" in message else "values"


def _upcast(tree, dtype):
    return pytree.tree_map(
        lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype == dtype else x, tree
    )


def _downcast(tree, dtype):
    return pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x,
        tree,
    )


def _compare(expected, actual, inputs, rtol, atol, *, values=True) -> None:
    """helpers.assert_same_output (values, shapes, dtypes, strides where eager's output is dense,
    non-tensors with ==); with values=False only structure and metadata."""
    if values:
        assert_same_output(expected, actual, inputs=inputs, rtol=rtol, atol=atol)
        return
    exp, exp_spec = pytree.tree_flatten(expected)
    act, act_spec = pytree.tree_flatten(actual)
    assert exp_spec == act_spec, (
        f"output: structure differs: eager {exp_spec} vs compiled {act_spec}"
    )
    for i, (e, a) in enumerate(zip(exp, act)):
        where = f"output[{i}]"
        assert type(e) is type(a), f"{where}: type {type(a).__name__}, eager {type(e).__name__}"
        if isinstance(e, torch.Tensor):
            assert a.shape == e.shape, f"{where}: shape {tuple(a.shape)}, eager {tuple(e.shape)}"
            assert a.dtype == e.dtype, f"{where}: dtype {a.dtype}, eager {e.dtype}"
            if e.numel() > 1 and _is_non_overlapping_and_dense(e):
                assert _same_strides(e, a), f"{where}: stride {a.stride()}, eager {e.stride()}"


# Random ops that draw one value per feature map (channel-wise dropout): the number of
# independent draws is the element count divided by the feature-map size (trailing dims).
_FEATURE_MAP_DIMS = {
    "nn.functional.dropout2d": 2,
    "nn.functional.dropout3d": 3,
    "nn.functional.feature_alpha_dropout.with_train": None,  # every dim after (N, C)
}


def _independent_draws(op_name: str, t: torch.Tensor) -> int:
    dims = _FEATURE_MAP_DIMS.get(op_name, 0)
    if dims == 0 or t.dim() < 2:
        return t.numel()
    trailing = t.shape[2:] if dims is None else t.shape[-dims:]
    return max(1, t.numel() // max(1, math.prod(trailing)))


def _assert_same_distribution(expected, actual, op_name: str = "") -> None:
    """Each floating output's mean and standard deviation agree with eager's within a sampling
    bound (6 sigma for large outputs, a loose sanity bound for small ones) for the number of
    independent draws behind it; integer and bool outputs are compared as float. NaN/inf counts
    must agree."""
    for i, (e, a) in enumerate(zip(_tensor_leaves(expected), _tensor_leaves(actual))):
        where = f"output[{i}]"
        draws = _independent_draws(op_name, e)
        e = e.detach().double().reshape(-1)
        a = a.detach().double().reshape(-1)
        n = min(e.numel(), draws)
        if n == 0:
            continue
        assert int(torch.isnan(e).sum()) == int(torch.isnan(a).sum()) or n >= LARGE_SAMPLE, (
            f"{where}: {int(torch.isnan(a).sum())} NaNs, eager {int(torch.isnan(e).sum())}"
        )
        fe, fa = e[torch.isfinite(e)], a[torch.isfinite(a)]
        if fe.numel() < 2 or fa.numel() < 2:
            continue
        # the pooled spread too: two small samples may each be constant (bernoulli over 3
        # probabilities: eager all 0, ferrocore all 1) without either being wrong
        pooled = float(torch.cat([fe, fa]).std())
        std = max(float(fe.std()), float(fa.std()), pooled, 1e-12)
        k = 6.0 if n >= LARGE_SAMPLE else 3.0 * math.sqrt(n)
        mean_bound = k * std * math.sqrt(2.0 / n) + 1e-6
        std_bound = k * std * math.sqrt(1.0 / n) + 1e-6
        dm = abs(float(fe.mean()) - float(fa.mean()))
        ds = abs(float(fe.std()) - float(fa.std()))
        assert dm <= mean_bound, (
            f"{where}: distribution: mean {float(fa.mean()):.6g}, eager {float(fe.mean()):.6g} "
            f"(|diff| {dm:.3g} > {mean_bound:.3g}, n={n})"
        )
        assert ds <= std_bound, (
            f"{where}: distribution: std {float(fa.std()):.6g}, eager {float(fe.std()):.6g} "
            f"(|diff| {ds:.3g} > {std_bound:.3g}, n={n})"
        )


def _capture_allowed() -> bool:
    return os.environ.get("FERROCORE_OPINFO_GRAPH_BREAKS") != "1"


# Dynamo settings tried in turn, each only when the previous handed ferrocore no graph at all;
# SampleResult.dynamo names the one used and the report counts them.
DYNAMO_MODES = ("default", "capture", "torch_frames")


def _dynamo_settings(mode: str):
    """default: dynamo as shipped.
    capture: `capture_scalar_outputs` / `capture_dynamic_output_shape_ops` hand data-dependent
      ops (`item`, `nonzero`, `masked_select`, ...) to the backend instead of running them
      eagerly behind a graph break, as a user who wants them compiled sets them.
    torch_frames: after a graph break inside a torch function (gaussian_nll_loss's data-dependent
      check, a `warnings.warn`), dynamo skips the rest of that torch frame by default and runs it
      eagerly; `dont_skip_tracing` compiles it, and `warnings.warn` is moved after the graph
      (`reorderable_logging_functions`) because dynamo cannot trace through that builtin.
    `FERROCORE_OPINFO_GRAPH_BREAKS=1` uses only the default."""
    if mode == "default":
        return contextlib.nullcontext()
    if mode == "capture":
        return torch._dynamo.config.patch(
            capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True
        )
    if mode == "torch_frames":
        return torch._dynamo.config.patch(
            dont_skip_tracing=True, reorderable_logging_functions={warnings.warn}
        )
    raise ValueError(f"unknown dynamo mode {mode!r}")


def _call(op, inp, args, kwargs):
    return op.op(inp, *args, **kwargs)


def run_sample(op, sample, dtype, index: int, *, timeout_s: int = SAMPLE_TIMEOUT_S) -> SampleResult:
    """Runs one OpInfo sample eagerly and through ferrocore and classifies the outcome.

    passed: outputs (and any input the op mutates) agree and ferrocore compiled every node.
    fallback: they agree, but some node ran through ATen (`fallback_ops`), a graph ran eagerly,
      or dynamo handed ferrocore no graph at all (`<no graph: dynamo ran it eagerly>`).
    failed: wrong structure, type, shape, dtype, stride, values, input mutation, or (random ops)
      the same seed gave two different results.
    errored: an exception while compiling or running (`error` is its first line).
    skipped: eager itself raised.
    """
    name, dname = op_id(op), DTYPE_NAMES[dtype]
    result = SampleResult(name, dname, index, "skipped", description=describe(sample))
    random_op = is_random(op)
    nondeterministic = bool(getattr(op, "has_nondeterministic_output", False))
    inp, args, kwargs = sample.input, sample.args, sample.kwargs
    inputs = _tensor_leaves((inp, args, kwargs))
    start = time.perf_counter()
    with warnings.catch_warnings(), _plain_random_ops():
        warnings.simplefilter("ignore")
        before = _snapshot(inputs)
        try:
            torch.manual_seed(0)
            expected = _call(op, inp, args, kwargs)
        except Exception as e:
            result.error = "eager: " + error_line(e)
            return result
        mutates = _changed(before, inputs)
        expected_inputs = _snapshot(inputs) if mutates else None
        if mutates:  # the outputs may be the mutated inputs (uniform_ returns self): keep them
            expected = _freeze(expected)
            _restore(before, inputs)

        def fn(inp, args, kwargs):
            return op.op(inp, *args, **kwargs)

        modes = DYNAMO_MODES if _capture_allowed() else DYNAMO_MODES[:1]
        kept = None  # (mode, seen, actual, again, actual_inputs) of the last attempt that ran
        actual_inputs = None
        for mode in modes:
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="ferrocore", dynamic=False, fullgraph=False)
            try:
                with observe_ferrocore() as seen, _time_limit(timeout_s), _dynamo_settings(mode):
                    torch.manual_seed(0)
                    actual = compiled(inp, args, kwargs)
                    again = None
                    if random_op:
                        actual_inputs = _snapshot(inputs) if mutates else None
                        if mutates:
                            actual = _freeze(actual)
                            _restore(before, inputs)
                        torch.manual_seed(0)
                        again = compiled(inp, args, kwargs)
            except Exception as e:
                if mutates:
                    _restore(before, inputs)
                if kept is not None and seen.graphs == 0:
                    # dynamo itself cannot trace under this setting: the earlier run stands
                    continue
                result.dynamo = mode
                result.status, result.error = "errored", error_line(e)
                result.overloads = sorted(seen.overloads)
                result.fallback_ops = list(seen.fallback_ops)
                result.fallback_reasons = dict(seen.fallback_reasons)
                result.seconds = time.perf_counter() - start
                return result
            finally:
                torch._dynamo.reset()
            if not random_op:
                actual_inputs = _snapshot(inputs) if mutates else None
            kept = (mode, seen, actual, again, actual_inputs)
            if mutates:
                _restore(before, inputs)
            if seen.graphs > 0:
                break
        mode, seen, actual, again, actual_inputs = kept
        result.dynamo = mode
        result.overloads = sorted(seen.overloads)
        result.fallback_ops = list(seen.fallback_ops)
        result.fallback_reasons = dict(seen.fallback_reasons)
        if seen.graphs == 0:
            result.fallback_ops.append(NO_GRAPH)
        result.seconds = time.perf_counter() - start

        rtol, atol = tolerances(op, dtype)
        try:
            _check_outputs(
                expected, actual, inputs, rtol, atol, dtype, op, sample,
                random_op=random_op, nondeterministic=nondeterministic,
            )
            if mutates:
                try:
                    _compare(expected_inputs, actual_inputs, [], rtol, atol, values=not random_op)
                except AssertionError as e:
                    raise AssertionError(f"mutated input: {e}") from None
            if random_op:
                try:
                    _compare(actual, again, [], 0.0, 0.0)
                except AssertionError as e:
                    raise AssertionError(
                        f"reproducibility: same seed, different result: {e}"
                    ) from None
        except AssertionError as e:
            message = str(e)
            result.status = "failed"
            result.kind = (
                "reproducibility" if message.startswith("reproducibility")
                else "mutation" if message.startswith("mutated input")
                else _failure_kind(message)
            )
            result.error = error_line(e)
        except Exception as e:  # a comparison that cannot even run (odd output types)
            result.status, result.kind, result.error = "failed", "structure", error_line(e)
        else:
            result.status = "fallback" if result.fallback_ops else "passed"
        finally:
            if mutates:
                _restore(before, inputs)
    return result


def _check_outputs(expected, actual, inputs, rtol, atol, dtype, op, sample, *, random_op,
                   nondeterministic) -> None:
    if nondeterministic:  # empty, empty_like ...: only the metadata is defined
        _compare(expected, actual, inputs, rtol, atol, values=False)
        return
    try:
        _compare(expected, actual, inputs, rtol, atol)
        return
    except AssertionError as e:
        if _failure_kind(str(e)) != "values":
            raise
        first = e
    if random_op:
        _compare(expected, actual, inputs, rtol, atol, values=False)
        _assert_same_distribution(expected, actual, op_id(op))
        return
    if dtype in LOW_PRECISION:
        # The reference Inductor uses for half types: eager on float32 inputs, rounded.
        try:
            reference = _downcast(
                _call(op, _upcast(sample.input, dtype), _upcast(sample.args, dtype),
                      _upcast(sample.kwargs, dtype)),
                dtype,
            )
            _compare(reference, actual, [], rtol, atol)
            return
        except Exception:
            pass
    raise first


def samples_for(op, dtype, limit: int | None) -> Iterable[tuple[int, Any]]:
    """The first `limit` samples (all when None), plus for random ops one enlarged sample."""
    count = 0
    first = None
    for sample in op.sample_inputs(DEVICE, dtype, requires_grad=False):
        if limit is not None and count >= limit:
            break
        if first is None:
            first = sample
        yield count, sample
        count += 1
    if is_random(op):
        big = _enlarged(_random_sample(op, dtype), True)
        if big is not None:
            yield count, big


def _random_sample(op, dtype, candidates: int = 20):
    """The first sample (of the first `candidates`) whose eager result depends on the seed: the
    first samples of dropout have p=0 or training=False."""
    with warnings.catch_warnings(), _plain_random_ops():
        warnings.simplefilter("ignore")
        for i, sample in enumerate(op.sample_inputs(DEVICE, dtype, requires_grad=False)):
            if i >= candidates:
                break
            try:
                outs = []
                for seed in (0, 1):
                    torch.manual_seed(seed)
                    clones = pytree.tree_map(
                        lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
                        (sample.input, sample.args, sample.kwargs),
                    )
                    outs.append(_tensor_leaves(op.op(clones[0], *clones[1], **clones[2])))
            except Exception:
                continue
            if any(not torch.equal(a, b) for a, b in zip(*outs) if a.shape == b.shape):
                return sample
    return None


def run_op_dtype(op, dtype, limit: int | None, *, timeout_s: int = SAMPLE_TIMEOUT_S
                 ) -> list[SampleResult]:
    from ferrocore.runtime import cpp_library

    results = []
    loaded_before = set(cpp_library._libraries)
    try:
        for index, sample in samples_for(op, dtype, limit):
            result = run_sample(op, sample, dtype, index, timeout_s=timeout_s)
            if result.status == "skipped" and index >= (limit or 1 << 30):
                continue  # the enlarged random sample: eager rejects the new shape
            results.append(result)
    except Exception as e:  # building the samples failed
        results.append(
            SampleResult(op_id(op), DTYPE_NAMES[dtype], len(results), "skipped",
                         error="sample_inputs: " + error_line(e))
        )
    finally:
        torch._dynamo.reset()
        _unload_kernel_libraries(loaded_before)
    return results


def _unload_kernel_libraries(keep: set) -> None:
    """Unloads the kernel libraries of the graphs just dropped: a sweep compiles tens of
    thousands of graphs, and each loaded library holds a few memory mappings (the kernel's
    limit, vm.max_map_count, is 65530 by default). A library unloads when the last wrapper
    module using it goes (`runtime.cpp_library.load_kernels`); collecting makes that now, not at the next
    cycle. `keep` (those loaded before) stay loaded while their graphs live."""
    import gc

    gc.collect()


def summarize(results: list[SampleResult]) -> dict:
    counts = Counter(r.status for r in results)
    first = next((r for r in results if r.status in ("failed", "errored")), None)
    fallback_ops = sorted({o for r in results for o in r.fallback_ops})
    return {
        **{s: counts.get(s, 0) for s in STATUSES},
        "first_error": f"[{first.index}] {first.error}" if first else "",
        "fallback_ops": fallback_ops,
    }


# ----------------------------------------------------------------------------------------------
# The sweep report.


def _suspects(result: SampleResult, passing_overloads: set[str]) -> list[str]:
    """The overloads a failing sample is blamed on (a heuristic, for ranking work):
    the overload an error names (`FerrocoreError: lowering: node 'x' (aten.x.y)`); else the
    overloads of its graphs (ignoring pure layout ops when there is anything else) that never
    appear in a passing sample of the same dtype; else, when each of them passes elsewhere, the
    combination is at fault and the sample is blamed on `<graph: ...>` (output layout, fusion)."""
    named = re.findall(r"\((aten\.[\w.]+)\)", result.error)
    if named:
        return sorted(set(named))
    if not result.overloads:
        return ["<no ATen graph>"]
    compute = [o for o in result.overloads if o not in LAYOUT_OVERLOADS] or result.overloads
    unproven = [o for o in compute if o not in passing_overloads]
    if unproven:
        return unproven
    kind = result.kind or result.status
    return [f"<graph: {kind}; every overload passes elsewhere>"]


class Report:
    """Per-sample results of a sweep, appended as JSON lines as they come (so a sweep that dies
    can resume: `done()` says which op/dtype pairs are finished), then aggregated."""

    def __init__(self, progress_file: Path):
        self.progress_file = progress_file
        self.results: list[SampleResult] = []
        self.started: set[tuple[str, str]] = set()
        self.finished: set[tuple[str, str]] = set()

    def load(self) -> None:
        if not self.progress_file.exists():
            return
        for line in self.progress_file.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if row.get("event") == "start":
                self.started.add((row["op"], row["dtype"]))
            elif row.get("event") == "done":
                self.finished.add((row["op"], row["dtype"]))
            else:
                self.results.append(SampleResult(**row))
        # A pair started but never finished took the process down with it.
        for op, dtype in sorted(self.started - self.finished):
            self.results.append(
                SampleResult(op, dtype, -1, "errored", error="crashed: the process died here")
            )
            self.finished.add((op, dtype))
            self._write({"event": "done", "op": op, "dtype": dtype})
            self._write(asdict(self.results[-1]))

    def _write(self, row: dict) -> None:
        with self.progress_file.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def start(self, op: str, dtype: str) -> None:
        self.progress_file.parent.mkdir(parents=True, exist_ok=True)
        self._write({"event": "start", "op": op, "dtype": dtype})

    def add(self, op: str, dtype: str, results: list[SampleResult]) -> None:
        for r in results:
            self._write(asdict(r))
        self._write({"event": "done", "op": op, "dtype": dtype})
        self.results.extend(results)
        self.finished.add((op, dtype))

    # -- aggregation --------------------------------------------------------------------------

    def totals(self) -> dict:
        counts = Counter(r.status for r in self.results)
        ran = sum(counts[s] for s in ("passed", "failed", "errored", "fallback"))
        # samples dynamo ran eagerly without handing ferrocore any graph (data-dependent ops:
        # item, nonzero, ...): counted as fallbacks, and also reported on their own
        no_graph = sum(1 for r in self.results if r.status == "fallback" and r.fallback_ops == [NO_GRAPH])
        compiled = ran - no_graph
        by_mode = Counter((r.dynamo, r.status) for r in self.results if r.status != "skipped")
        return {
            "samples": len(self.results),
            **{s: counts.get(s, 0) for s in STATUSES},
            "no_graph": no_graph,
            "pass_rate": counts["passed"] / ran if ran else 0.0,
            "pass_rate_with_graph": counts["passed"] / compiled if compiled else 0.0,
            "correct_rate": (counts["passed"] + counts["fallback"]) / ran if ran else 0.0,
            "op_dtype_pairs": len({(r.op, r.dtype) for r in self.results}),
            "ops": len({r.op for r in self.results}),
            "seconds": round(sum(r.seconds for r in self.results), 1),
            # which dynamo settings produced the compiled run (see DYNAMO_MODES)
            "dynamo_modes": {
                mode: {s: n for (m, s), n in sorted(by_mode.items()) if m == mode}
                for mode in DYNAMO_MODES
            },
        }

    def per_op(self) -> dict:
        grouped: dict[str, dict[str, list[SampleResult]]] = defaultdict(lambda: defaultdict(list))
        for r in self.results:
            grouped[r.op][r.dtype].append(r)
        return {
            op: {dtype: summarize(rs) for dtype, rs in sorted(by_dtype.items(),
                                                             key=lambda kv: _dtype_order(kv[0]))}
            for op, by_dtype in grouped.items()
        }

    def failure_groups(self, top: int = 25) -> dict:
        """The work list: fallback overloads, failing and erroring overloads, error messages."""
        passing: dict[str, set[str]] = defaultdict(set)
        for r in self.results:
            if r.status == "passed":
                passing[r.dtype].update(r.overloads)

        fallbacks: dict[str, dict] = {}
        blamed: dict[str, dict] = {}
        messages: dict[str, dict] = {}

        def bump(table, key, r, example):
            row = table.setdefault(key, {"count": 0, "ops": Counter(), "dtypes": Counter(),
                                         "example": example})
            row["count"] += 1
            row["ops"][r.op] += 1
            row["dtypes"][r.dtype] += 1

        for r in self.results:
            if r.status == "fallback":
                for o in sorted(set(r.fallback_ops)):
                    reason = (r.fallback_reasons or {}).get(o)
                    why = f" -- {reason}" if reason else ""
                    bump(fallbacks, o, r, f"{r.op} [{r.dtype}] {r.description}{why}")
            elif r.status in ("failed", "errored"):
                what = f"{r.status} ({r.kind})" if r.kind else r.status
                for o in _suspects(r, passing[r.dtype]):
                    bump(blamed, o, r, f"{what}: {r.op} [{r.dtype}] {r.error}")
                bump(messages, _message_pattern(r), r, f"{r.op} [{r.dtype}] {r.error}")

        def ranked(table):
            rows = sorted(table.items(), key=lambda kv: -kv[1]["count"])[:top]
            return [
                {"key": key, "count": row["count"], "core": is_core_overload(key),
                 "ops": [f"{o} x{n}" for o, n in row["ops"].most_common(6)],
                 "dtypes": dict(row["dtypes"]), "example": row["example"]}
                for key, row in rows
            ]

        return {
            "fallback_overloads": ranked(fallbacks),
            "failing_overloads": ranked(blamed),
            "error_messages": ranked(messages),
        }

    def write(self, json_path: Path, md_path: Path) -> None:
        data = {
            "totals": self.totals(),
            "failure_groups": self.failure_groups(),
            "ops": self.per_op(),
            "torch": torch.__version__,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1, default=list))
        md_path.write_text(render_markdown(data))


def is_core_overload(name: str) -> bool | None:
    """Whether `aten.op.overload` is tagged `torch.Tag.core`; None for anything else."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    try:
        return torch.Tag.core in getattr(getattr(torch.ops.aten, parts[1]), parts[2]).tags
    except (AttributeError, RuntimeError):
        return None


def _dtype_order(name: str) -> int:
    return list(DTYPE_NAMES.values()).index(name) if name in DTYPES_BY_NAME else 99


def _message_pattern(r: SampleResult) -> str:
    """The error with numbers, shapes and names of graph nodes blanked, so that one cause groups."""
    text = r.error
    text = re.sub(r"(?<=[\s(\[,=:])-?\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    text = re.sub(r"\b(buf|node|arg|graph_|output)\w*", r"\1_", text)
    text = re.sub(r"\(shape[^)]*\)", "", text)
    kind = f"{r.status}/{r.kind}" if r.kind else r.status
    return f"{kind}: {text[:160]}"


def render_markdown(data: dict) -> str:
    t = data["totals"]
    out = [
        "# ferrocore OpInfo conformance report",
        "",
        f"torch {data['torch']}; {t['ops']} OpInfos, {t['op_dtype_pairs']} op/dtype pairs, "
        f"{t['samples']} samples, {t['seconds']} s in samples.",
        "",
        f"**pass rate {t['pass_rate']:.1%}** (passed / samples run); "
        f"correct {t['correct_rate']:.1%} (passed + fallback). "
        f"{t.get('no_graph', 0)} fallback samples were run by dynamo without any graph for "
        f"ferrocore; over the other samples the pass rate is {t.get('pass_rate_with_graph', 0):.1%}.",
        "",
        "| passed | fallback | failed | errored | skipped (eager rejects) |",
        "|---|---|---|---|---|",
        f"| {t['passed']} | {t['fallback']} | {t['failed']} | {t['errored']} | {t['skipped']} |",
        "",
        "Dynamo settings each sample ran under (the first that handed ferrocore a graph; "
        "`opinfo_support.DYNAMO_MODES`):",
        "",
        "| dynamo | " + " | ".join(STATUSES[:4]) + " |",
        "|---|" + "---|" * 4,
    ]
    for mode, by_status in t.get("dynamo_modes", {}).items():
        out.append(f"| {mode} | " + " | ".join(str(by_status.get(s, 0)) for s in STATUSES[:4]) + " |")
    out += [""]
    groups = data["failure_groups"]
    titles = {
        "fallback_overloads": "Fallback overloads (correct, but ran through ATen)",
        "failing_overloads": "Overloads in failing / erroring graphs (blamed: not seen passing)",
        "error_messages": "Failures and errors by message",
    }
    for key, title in titles.items():
        out += [f"## {title}", "", "| # | what | core | samples | ops | example |",
                "|---|---|---|---|---|---|"]
        for i, row in enumerate(groups[key], 1):
            core = {True: "yes", False: "no", None: ""}[row.get("core")]
            out.append(
                f"| {i} | `{_md(row['key'])}` | {core} | {row['count']} | "
                f"{_md(', '.join(row['ops']))} | {_md(row['example'][:260])} |"
            )
        out.append("")
    out += [
        "## Per op and dtype",
        "",
        "| op | dtype | pass | fallback | fail | error | skip | first error | fallback ops |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for op, by_dtype in sorted(data["ops"].items()):
        for dtype, s in by_dtype.items():
            out.append(
                f"| {op} | {dtype} | {s['passed']} | {s['fallback']} | {s['failed']} | "
                f"{s['errored']} | {s['skipped']} | {_md(s['first_error'][:160])} | "
                f"{_md(', '.join(s['fallback_ops']))} |"
            )
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def torch_version() -> tuple:
    """torch's (major, minor)."""
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
