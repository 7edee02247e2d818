"""What a new user runs first: the getting-started scripts in `examples/` (as `python
examples/X.py`, each finishing with its own checks passed) and the README's install line."""

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


def test_the_readme_pip_install_line_installs_ferrocore(tmp_path):
    # `pip install ./ferrocore` failed from a checkout; the line is run as written, as a dry run
    # (no build, no network: the checkout's own pyproject through the venv's maturin)
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Install with pip", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    line = next(raw.split("#")[0].split() for raw in section.splitlines() if raw.startswith("pip install ."))
    assert line == ["pip", "install", "."], line
    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "maturin")):
        pytest.skip("no maturin beside this Python (scripts/setup.sh installs it)")
    report = tmp_path / "report.json"
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run([sys.executable, "-m", *line[:2], "--dry-run", "--no-deps", "--no-build-isolation",
                           "--report", str(report), *line[2:]], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    import json

    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["ferrocore"], installed
