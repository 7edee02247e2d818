"""The getting-started scripts in `examples/` run as a user runs them (`python examples/X.py`)
and finish with their own checks passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import is_ferrocore

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_DEVICE = os.environ.get("FERROCORE_TEST_DEVICE", "cpu")

pytestmark = [
    pytest.mark.skipif(not is_ferrocore(), reason="the examples compile with ferrocore"),
    pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the examples run on the CPU"),
]

EXAMPLES = ["cpu_inference.py", "training_loop.py", "huggingface_model.py", "dynamic_shapes.py", "compile_report.py"]


def test_every_example_is_listed_here():
    scripts = sorted(p.name for p in (REPO_ROOT / "examples").glob("*.py"))
    assert sorted(EXAMPLES + ["__init__.py", "demo.py", "models.py"]) == scripts


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs(script, tmp_path):
    args = [sys.executable, str(REPO_ROOT / "examples" / script)]
    if script == "compile_report.py":
        args.append(str(tmp_path / "report"))
    env = {k: v for k, v in os.environ.items() if k != "FERROCORE_LOGS"}
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("OK"), done.stdout
