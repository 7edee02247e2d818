"""The compile report: one HTML page per compiled graph beside the stage dumps, its runtime
section filled in by the module's own benchmark, rendered by headless Chromium and its links
between graph nodes and kernels followed there."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from examples.models import make_block, make_block_input

import ferrocore

CHROMIUM = os.environ.get("FERROCORE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# a machine with no network: no background fetches or updates; root needs --no-sandbox
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def block_report(tmp_path_factory):
    """The demo's transformer block compiled with a debug folder, and its module's benchmark run
    with `--report`: (the report's path, the metrics entry)."""
    debug = tmp_path_factory.mktemp("debug")
    torch._dynamo.reset()
    model, x = make_block(), make_block_input()
    with torch.no_grad():
        out = torch.compile(model, backend="ferrocore", options={"debug_dir": str(debug)})(x)
        torch.testing.assert_close(out, model(x))
    entry = ferrocore.metrics.last
    report = Path(entry["report_path"])
    assert report.parent.parent == debug and report.name == "report.html"
    assert "Not measured yet." in report.read_text()
    run = subprocess.run([sys.executable, entry["module_path"], "--reps", "3", "--report", str(report)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "runtime by kernel written into" in run.stdout
    return report, entry


def _kernels(page: str) -> list:
    return re.findall(r'<div class="step" id="kernel-(\w+)">', page)


def test_every_kernel_names_its_model_source_lines(block_report):
    report, entry = block_report
    page = report.read_text()
    kernels = _kernels(page)
    assert len(kernels) == entry["kernels"] > 0
    for name in kernels:
        section = page.split(f'id="kernel-{name}"')[1].split("</div>")[0]
        assert 'class="src">File &quot;' in section and 'models.py&quot;, line ' in section, name
        assert "Graph nodes: <a href=\"#node-" in section, name
    # every anchor the page links to exists, graph rows and kernels alike
    ids = set(re.findall(r'id="([^"]+)"', page))
    assert {t for t in re.findall(r'href="#([^"]+)"', page)} <= ids


def test_runtime_section_lists_every_kernel(block_report):
    report, entry = block_report
    page = report.read_text()
    runtime = page.split('<section id="runtime">')[1]
    assert "Not measured yet." not in runtime and "Median wall time per run" in runtime
    timed = set(re.findall(r'<a href="#kernel-(\w+)">', runtime))
    # a Triton kernel identical to an earlier one is launched under that one's name
    shared = set(re.findall(r'<div class="step" id="kernel-(\w+)">(?:(?!</div>).)*?<p class="note">Launched as ', page, re.S))
    assert timed == set(_kernels(page)) - shared
    assert "<td>library</td>" in runtime  # the linear layers are library calls (aten::addmm, cuBLAS)


def test_report_renders_and_its_links_work_in_chromium(block_report):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup.sh installs Debian's)")
    report, entry = block_report
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(report.as_uri())
            assert page.title() == f"ferrocore: {entry['name']}"
            for section in ("time", "graph", "kernels", "fusion", "memory", "runtime"):
                assert page.locator(f"section#{section}").is_visible(), section
            dangling = page.evaluate("""() => Array.from(document.querySelectorAll('a[href^="#"]'))
                .filter(a => !document.getElementById(a.getAttribute('href').slice(1))).length""")
            assert dangling == 0
            # graph -> kernel: the softmax node's row links to the kernel that computes it
            row = page.locator("#graph tr", has_text="aten._softmax.default")
            link = row.locator('a[href^="#kernel-"]').first
            kernel = link.inner_text()
            link.click()
            assert page.evaluate("document.querySelector(':target').id") == f"kernel-{kernel}"
            assert page.locator(f"#kernel-{kernel}").is_visible()
            assert "softmax" in kernel
            # kernel -> graph: its first graph node link leads back to that node's row
            back = page.locator(f"#kernel-{kernel} a[href^='#node-']").first
            node = back.inner_text()
            back.click()
            target = page.evaluate("document.querySelector(':target').id")
            assert target.startswith("node-")
            assert page.locator(f"#{target} td").first.inner_text() == node
            # runtime -> kernel
            page.locator("#runtime a[href^='#kernel-']").first.click()
            assert page.evaluate("document.querySelector(':target').id").startswith("kernel-")
            # a kernel's code opens
            page.locator(f"#kernel-{kernel} summary").click()
            code = page.locator(f"#kernel-{kernel} details pre")
            assert code.is_visible() and ("extern \"C\" int " in code.inner_text() or "@ferro_jit" in code.inner_text())
        finally:
            browser.close()
