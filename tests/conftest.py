"""Session setup for the end-to-end tests.

- `FERROCORE_CACHE_DIR` defaults to one directory shared by the whole run (set before ferrocore
  can be imported, so every compile in the run uses it); its compiled-graph entries are removed
  when a run starts, its kernels kept.
- `FERROCORE_TEST_BACKEND` selects the backend under test (default `ferrocore`); `inductor`,
  `aot_eager` and `eager` validate the tests themselves against PyTorch.
- Every test starts from a reset dynamo and a fixed seed.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

os.environ.setdefault("FERROCORE_CACHE_DIR", str(REPO_ROOT / ".ferrocore-cache-test"))
# Kernels stay cached between runs; compiled-graph entries do not: a test that checks what a
# compile prints or times must not meet an entry an earlier run stored (each run starts alike).
# Under pytest-xdist only the controlling process clears them, before its workers start.
if "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(Path(os.environ["FERROCORE_CACHE_DIR"]) / "compiled", ignore_errors=True)
# no progress lines between test results (a terminal's pytest -s would draw them)
os.environ.setdefault("FERROCORE_PROGRESS", "off")

# `examples/` (the demo's transformer block) and `tests/helpers.py` are imported by the tests.
for path in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from helpers import BACKEND, can_count_kernels, is_ferrocore  # noqa: E402

# Each test resets dynamo, but a test may compile a function for several inputs; never let a
# recompile fall back to eager silently, and never let an error be swallowed.
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 64
else:
    torch._dynamo.config.cache_size_limit = 64
torch._dynamo.config.accumulated_cache_size_limit = 4096
torch._dynamo.config.suppress_errors = False

# FERROCORE_TEST_DEVICE=cuda runs the suite on a GPU: factory calls (torch.randn in the tests and
# in the compiled functions) make CUDA tensors, so graphs go to ferrocore's Triton backend.
TEST_DEVICE = os.environ.get("FERROCORE_TEST_DEVICE", "cpu")
if TEST_DEVICE != "cpu":
    torch.set_default_device(TEST_DEVICE)

if BACKEND == "inductor":
    import torch._inductor.config

    # Round at every explicit cast, as eager does (x.half().float() must lose precision).
    torch._inductor.config.emulate_precision_casts = True


def pytest_addoption(parser):
    # The OpInfo conformance sweep (tests/test_opinfo.py); without these only its CI subset runs.
    group = parser.getgroup("opinfo", "ferrocore OpInfo conformance")
    group.addoption("--opinfo-full", action="store_true",
                    help="run the full OpInfo sweep (also: FERROCORE_OPINFO_FULL=1)")
    group.addoption("--opinfo-report", default="opinfo_report",
                    help="report path without suffix: writes PATH.json and PATH.md")
    group.addoption("--opinfo-min-pass", type=float, default=0.0,
                    help="fail the sweep if its pass rate is below this fraction (default 0)")
    group.addoption("--opinfo-max-samples", type=int, default=None,
                    help="samples per op and dtype in the sweep (default: all)")
    group.addoption("--opinfo-ops", default=None,
                    help="comma list of OpInfo names (or name prefixes ending in *) to sweep")
    group.addoption("--opinfo-range", default=None,
                    help="A:B: only op/dtype pairs A..B-1 of the sweep's order (split a sweep "
                         "over processes; merge their progress files and --opinfo-resume)")
    group.addoption("--opinfo-resume", action="store_true",
                    help="continue an interrupted sweep from PATH.progress.jsonl")


def pytest_report_header(config):
    return [
        f"ferrocore e2e: backend={BACKEND} device={TEST_DEVICE} torch={torch.__version__} "
        f"FERROCORE_CACHE_DIR={os.environ['FERROCORE_CACHE_DIR']}"
    ]


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel_count: asserts the number of generated kernels")
    config.addinivalue_line("markers", "ferrocore_only: needs the ferrocore backend's metrics")
    config.addinivalue_line("markers", "cpu_only(reason): meaningful on the CPU test device only")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("kernel_count") and not can_count_kernels():
            item.add_marker(pytest.mark.skip(reason=f"backend {BACKEND} does not count kernels"))
        if item.get_closest_marker("ferrocore_only") and not is_ferrocore():
            item.add_marker(pytest.mark.skip(reason=f"needs ferrocore, backend is {BACKEND}"))
        cpu_only = item.get_closest_marker("cpu_only")
        if cpu_only and TEST_DEVICE != "cpu":
            why = cpu_only.args[0] if cpu_only.args else "CPU-specific"
            item.add_marker(pytest.mark.skip(reason=f"on {TEST_DEVICE}: {why}"))


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_seed():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def compile_log(monkeypatch, capfd):
    """`compile_log("attention,trace")` turns those log channels on for the compiles that follow
    (the graph cache off: the lines come from a compile, not a cache hit) and returns a reader of
    what they printed since."""

    def start(channels: str):
        monkeypatch.setenv("FERROCORE_LOGS", channels)
        monkeypatch.setenv("FERROCORE_GRAPH_CACHE", "0")
        capfd.readouterr()
        return lambda: capfd.readouterr().err

    return start
