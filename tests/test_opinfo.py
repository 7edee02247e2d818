"""Core ATen ops against eager, with PyTorch's own OpInfo samples (`op_db`).

Two modes:

- CI subset (default): `test_opinfo_subset[op-dtype]`, one test per (op, dtype) of `FAST_OPS`
  (representative OpInfos of every op family, float32 plus one other dtype each), on the first
  `FAST_SAMPLES` samples. Each must pass: right values, shapes, dtypes and strides, and no ATen
  fallback. Pairs listed in `KNOWN_FAILURES` are strict xfails with their reason (a pair that starts passing must leave the list).
- Full sweep (`--opinfo-full` or FERROCORE_OPINFO_FULL=1): `test_opinfo_full_sweep` runs every
  core-relevant OpInfo (see `opinfo_support.select_core_ops`) on every harness dtype it supports
  on CPU and every sample, writes `opinfo_report.json` / `.md` (`--opinfo-report PATH`), and
  fails only if the pass rate is below `--opinfo-min-pass` (default 0: report only).
  `bash bench/opinfo_sweep.sh` runs it and prints the totals.

Comparison, tolerances, random ops and the classification are in `tests/opinfo_support.py`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("expecttest", reason="torch's OpInfo database needs `pip install expecttest`")

import opinfo_support as S  # noqa: E402
from helpers import is_ferrocore  # noqa: E402

FAST_SAMPLES = 2

F32, F16, BF16, I64, B8 = "float32", "float16", "bfloat16", "int64", "bool"

# The CI subset: OpInfo -> the second dtype it runs in besides float32 (None: float32 only). The
# second dtypes rotate so that every harness dtype is covered in every family.
FAST_OPS: dict[str, str | None] = {
    # unary pointwise
    "abs": I64, "neg": BF16, "exp": F16, "log": BF16, "sin": F16, "tanh": BF16,
    "sigmoid": F16, "sqrt": BF16, "rsqrt": F16, "erf": BF16, "floor": I64, "round": F16,
    "sign": I64, "reciprocal": BF16, "logical_not": B8, "bitwise_not": I64, "isnan": F16,
    "nan_to_num": BF16,
    # binary / ternary pointwise
    "add": I64, "sub": BF16, "mul": B8, "div.no_rounding_mode": F16, "div.floor_rounding": I64,
    "remainder": I64, "fmod": BF16, "pow": F16, "maximum": I64, "minimum": BF16, "eq": B8,
    "lt": I64, "where": BF16, "logical_and": B8, "bitwise_and": I64, "atan2": F16,
    "clamp": BF16, "lerp": F16, "addcmul": I64,
    # reductions and scans
    "sum": I64, "mean": BF16, "amax": I64, "amin": F16, "argmax": I64, "prod": BF16,
    "var": F16, "std": BF16, "any": B8, "all": I64, "logsumexp": BF16, "cumsum": I64,
    "max.reduction_with_dim": F16,
    # normalization, activations, losses
    "softmax": BF16, "log_softmax": F16, "nn.functional.layer_norm": BF16,
    "nn.functional.batch_norm": F16, "nn.functional.group_norm": BF16,
    "nn.functional.gelu": F16, "nn.functional.relu": I64, "nn.functional.silu": BF16,
    "nn.functional.leaky_relu": F16, "nn.functional.hardtanh": I64, "nn.functional.elu": BF16,
    "nn.functional.softplus": F16, "nn.functional.mse_loss": BF16,
    "nn.functional.cross_entropy": None,
    # views and data movement
    "reshape": B8, "permute": I64, "transpose": BF16, "expand": F16, "squeeze": B8,
    "unsqueeze": I64, "cat": BF16, "stack": I64, "select": F16, "narrow": B8,
    "__getitem__": I64, "flip": BF16, "roll": I64, "repeat": F16, "tril": B8, "triu": I64,
    "constant_pad_nd": BF16, "nn.functional.pad.constant": F16, "clone": B8,
    "contiguous": I64, "to": BF16,
    # indexing
    "gather": I64, "scatter": BF16, "scatter_add": F16, "index_select": I64,
    "index_add": BF16, "index_put": F16, "nn.functional.embedding": BF16,
    "masked_fill": B8, "scatter_reduce.amax": I64, "scatter_reduce.mean": BF16,
    "masked_scatter": B8, "index_fill": F16, "combinations": I64,
    # data-dependent sizes and values (dynamo's capture settings; python/ferrocore/partition.py)
    "nonzero": B8, "masked_select": F16, "item": BF16, "argwhere": I64,
    "nn.functional.grid_sample": None, "nn.functional.interpolate.bilinear": F16,
    # matmul, convolution, pooling, attention
    "mm": BF16, "bmm": F16, "addmm": BF16, "matmul": I64, "nn.functional.linear": BF16,
    "nn.functional.conv2d": None, "nn.functional.max_pool2d": BF16,
    "nn.functional.avg_pool2d": F16, "nn.functional.scaled_dot_product_attention": BF16,
    "nn.functional.max_pool3d": I64, "nn.functional.avg_pool3d": None,
    "nn.functional.adaptive_max_pool2d": BF16, "nn.functional.fractional_max_pool2d": F16,
    "nn.functional.bilinear": BF16, "svd": None, "searchsorted": I64, "linalg.tensorinv": None,
    # complex values inside real graphs (FFT library calls, complex copies)
    "fft.fft2": I64, "fft.hfft": None, "cdouble": BF16, "chalf": I64,
    # sorting, creation
    "sort": I64, "topk": BF16, "full_like": I64, "zeros_like": B8, "arange": I64,
    "linspace": BF16,
    # random (compared by distribution when not bit-identical, and by reproducibility)
    "bernoulli": BF16, "nn.functional.dropout": F16, "rand_like": BF16,
    "nn.functional.dropout3d": BF16, "nn.functional.rrelu": BF16,
    # special functions
    "mvlgamma.mvlgamma_p_1": F16, "special.log_ndtr": I64,
}

# Pairs that fail today, grouped by reason: (op, dtype or None for every dtype) -> reason.
# Burn this down; a pair that starts passing is reported as XPASS (strict=False).
KNOWN_FAILURES: dict[tuple[str, str | None], str] = {}


def _known(reason: str, *pairs) -> None:
    for pair in pairs:
        key = (pair, None) if isinstance(pair, str) else tuple(pair)
        assert key not in KNOWN_FAILURES, f"{key} listed twice in KNOWN_FAILURES"
        KNOWN_FAILURES[key] = reason


# Measured 2026-11-22 (tests/test_opinfo.py at FAST_SAMPLES=2; ferrocore working tree of that
# day). The full sweep's report ranks the same causes over every OpInfo.

# -- missing lowerings (values right, some node runs through ATen) ------------------------------

# -- whole graph or whole function not compiled --------------------------------------------------

# torch 2.11's dynamo raises PendingUnbackedSymbolNotFound tracing narrow at a tensor start on a
# CUDA tensor, with every backend (eager included; measured on an H100): no graph reaches ferrocore
if torch.get_default_device().type == "cuda" and S.torch_version() < (2, 12):
    _known("torch < 2.12: dynamo fails on narrow at a tensor start on CUDA (every backend)", "narrow")

# -- wrong results -------------------------------------------------------------------------------


def _known_reason(op: str, dtype: str) -> str | None:
    return KNOWN_FAILURES.get((op, dtype)) or KNOWN_FAILURES.get((op, None))


def _subset_params():
    ops = S.op_db_by_id()
    params = []
    for name, other in FAST_OPS.items():
        op = ops.get(name)
        if op is None:  # torch renamed an OpInfo: the list must be updated, loudly
            params.append(pytest.param(name, F32, id=f"{name}-missing"))
            continue
        supported = {S.DTYPE_NAMES[d] for d in S.cpu_dtypes(op)}
        for dtype in dict.fromkeys([F32, other]):
            if dtype is None or dtype not in supported:
                continue
            marks = []
            reason = _known_reason(name, dtype)
            if reason:
                marks.append(pytest.mark.xfail(reason=reason, strict=True))
            params.append(pytest.param(name, dtype, id=f"{name}-{dtype}", marks=marks))
    return params


@pytest.fixture(scope="module")
def op_db():
    return S.op_db_by_id()


@pytest.fixture(autouse=True)
def _quiet_torch_logs():
    """torch's structured-trace logger emits DEBUG records for every compile; captured by pytest
    they bury a failure's message. Untouched when TORCH_TRACE asks for them."""
    trace = logging.getLogger("torch.__trace")
    level = trace.level
    if not os.environ.get("TORCH_TRACE"):
        trace.setLevel(logging.WARNING)
    yield
    trace.setLevel(level)


@pytest.mark.ferrocore_only
@pytest.mark.parametrize(("name", "dtype"), _subset_params())
def test_opinfo_subset(op_db, name, dtype):
    assert name in op_db, f"OpInfo {name!r} is not in torch's op_db: update FAST_OPS"
    op = op_db[name]
    results = S.run_op_dtype(op, S.DTYPES_BY_NAME[dtype], FAST_SAMPLES)
    ran = [r for r in results if r.status != "skipped"]
    assert ran, f"no sample of {name} [{dtype}] ran: {[r.error for r in results]}"
    bad = [r for r in ran if r.status != "passed"]
    if bad:
        pytest.fail("\n".join(
        f"sample {r.index} ({r.description}): {r.status}"
        + (f" ({r.kind})" if r.kind else "")
        + (f": {r.error}" if r.error else "")
        + (f" fallback_ops={r.fallback_ops}" if r.fallback_ops else "")
        for r in bad
        ), pytrace=False)


def test_known_failures_name_real_pairs():
    """Every KNOWN_FAILURES entry names a pair the subset runs (no stale entries)."""
    pairs = {(p.values[0], p.values[1]) for p in _subset_params()}
    for op, dtype in KNOWN_FAILURES:
        assert (op, dtype) in pairs or (dtype is None and any(o == op for o, _ in pairs)), (
            f"KNOWN_FAILURES entry {(op, dtype)} is not in the CI subset"
        )


def test_distribution_check_tells_seeds_from_shifts():
    """The random-op comparison accepts another seed of the same distribution and rejects a
    shifted or rescaled one (it must be able to fail)."""
    torch.manual_seed(0)
    a = torch.rand(S.LARGE_SAMPLE_NUMEL)
    torch.manual_seed(1)
    b = torch.rand(S.LARGE_SAMPLE_NUMEL)
    S._assert_same_distribution(a, b)
    with pytest.raises(AssertionError, match="mean"):
        S._assert_same_distribution(a, b + 0.05)
    with pytest.raises(AssertionError, match="std"):
        S._assert_same_distribution(a, (b - 0.5) * 1.2 + 0.5)


# ----------------------------------------------------------------------------------------------
# The full sweep.


def _full_requested(config) -> bool:
    return bool(config.getoption("--opinfo-full")) or os.environ.get("FERROCORE_OPINFO_FULL") == "1"


def _wanted(name: str, patterns: list[str] | None) -> bool:
    if not patterns:
        return True
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


@pytest.mark.ferrocore_only
def test_opinfo_full_sweep(request):
    config = request.config
    if not _full_requested(config):
        pytest.skip("full OpInfo sweep: pass --opinfo-full or set FERROCORE_OPINFO_FULL=1")
    if not is_ferrocore():
        pytest.skip("the sweep reports ferrocore's fallbacks")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # graph-break warnings
    base = Path(config.getoption("--opinfo-report"))
    max_samples = config.getoption("--opinfo-max-samples")
    patterns = config.getoption("--opinfo-ops")
    patterns = [p.strip() for p in patterns.split(",")] if patterns else None

    selection_cache = Path(str(config.cache.mkdir("opinfo"))) / "selection.json"
    selected = S.select_core_ops(selection_cache)
    ops = S.op_db_by_id()
    report = S.Report(base.with_suffix(".progress.jsonl"))
    if config.getoption("--opinfo-resume"):
        report.load()
    elif report.progress_file.exists():
        report.progress_file.unlink()

    span = config.getoption("--opinfo-range")
    lo, hi = (int(x) if x else None for x in span.split(":")) if span else (None, None)
    start = time.perf_counter()
    position = -1
    for name, info in selected.items():
        if not _wanted(name, patterns):
            continue
        for dtype_name in info["dtypes"]:
            position += 1
            if (lo is not None and position < lo) or (hi is not None and position >= hi):
                continue
            if (name, dtype_name) in report.finished:
                continue
            report.start(name, dtype_name)
            results = S.run_op_dtype(ops[name], S.DTYPES_BY_NAME[dtype_name], max_samples)
            report.add(name, dtype_name, results)
            s = S.summarize(results)
            print(
                f"[opinfo] {name} [{dtype_name}] pass {s['passed']} fallback {s['fallback']} "
                f"fail {s['failed']} error {s['errored']} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )

    json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
    report.write(json_path, md_path)
    totals = report.totals()
    print(f"\n[opinfo] totals: {json.dumps(totals)}\n[opinfo] report: {json_path} {md_path}")
    min_pass = config.getoption("--opinfo-min-pass")
    assert totals["pass_rate"] >= min_pass, (
        f"OpInfo pass rate {totals['pass_rate']:.1%} is below --opinfo-min-pass {min_pass:.1%}"
    )
