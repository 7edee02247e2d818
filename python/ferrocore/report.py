"""The runtime section of a compile report (`crates/ferrocore/src/report`): where a compiled
module's time goes when its benchmark runs, by kernel and library call, measured with
torch.profiler and written into the report between its runtime marks.

`python MODULE.py --report REPORT.html` (the module's `__main__`) does it.
"""

from __future__ import annotations

import ctypes
import html
import os
import tempfile
from dataclasses import dataclass

import torch

# as the Rust renderer writes them (report::RUNTIME_START / RUNTIME_END)
RUNTIME_START = "<!-- ferrocore:runtime -->"
RUNTIME_END = "<!-- /ferrocore:runtime -->"


@dataclass
class Row:
    name: str
    kind: str  # "kernel", "library", "allocation" (the module's own buffers), "copy" or "other"
    calls: float  # per run of the module
    ms: float  # per run of the module


_ALLOCATIONS = ("aten::empty_strided", "aten::empty")


def kernel_names(module: dict) -> list:
    """The module's kernels: C++ entry points (ctypes functions) and Triton kernels (each has a
    `launch_<name>`)."""
    cpp = [k for k, v in module.items() if isinstance(v, ctypes._CFuncPtr)]
    triton = [k[len("launch_"):] for k in module if k.startswith("launch_")]
    return cpp + triton


def _ranged(fn, name: str):
    def call(*args):
        with torch.profiler.record_function(name):
            return fn(*args)

    return call


def measure(call, args, module: dict, reps: int) -> list:
    """Runs `call` `reps` times under torch.profiler; the time per run by kernel (GPU: device
    time; CPU: the kernel's host call) and by library call (top-level ATen ops)."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    names = set(kernel_names(module))
    host = [k for k in names if isinstance(module.get(k), ctypes._CFuncPtr)]
    saved = {k: module[k] for k in host}
    module.update({k: _ranged(module[k], k) for k in host})  # `call` reads its globals at each call
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    try:
        call(list(args))
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(reps):
                call(list(args))
            if cuda:
                torch.cuda.synchronize()
    finally:
        module.update(saved)
    totals: dict = {}
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            kind = "kernel" if e.name in names else "copy" if e.name.startswith(("Memcpy", "Memset")) else "library"
        elif not cuda and e.name in names:
            kind = "kernel"
        elif not cuda and e.cpu_parent is None:
            # what `call` runs itself: library calls, its allocations, the rest
            kind = "allocation" if e.name in _ALLOCATIONS else "library" if e.name.startswith("aten::") else "other"
        else:
            continue
        row = totals.setdefault(e.name, Row(e.name, kind, 0.0, 0.0))
        row.calls += 1 / reps
        row.ms += e.time_range.elapsed_us() / 1e3 / reps
    return sorted(totals.values(), key=lambda r: -r.ms)


def runtime_html(rows: list, wall_ms: float, device: str) -> str:
    total = sum(r.ms for r in rows) or 1e-9
    what = "device time of each kernel" if device == "cuda" else "host time of each call"
    out = [f"<p>Median wall time per run: {wall_ms:.4f} ms. Measured: {html.escape(what)} "
           f"(torch.profiler), {total:.4f} ms per run in all.</p>",
           "<table><tr><th>name</th><th>kind</th><th>calls per run</th><th>ms per run</th><th>share</th></tr>"]
    for r in rows:
        name = html.escape(r.name)
        cell = f'<a href="#kernel-{name}">{name}</a>' if r.kind == "kernel" else name
        share = r.ms / total * 100
        out.append(f'<tr><td><code>{cell}</code></td><td>{r.kind}</td><td class="num">{r.calls:g}</td>'
                   f'<td class="num">{r.ms:.4f}</td><td><div class="bar" style="width:{share:.1f}%"></div> '
                   f'{share:.1f}%</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def fill_runtime(report_path: str, body: str) -> None:
    """Puts `body` between the report's runtime marks (written atomically: a reader never sees
    half a page)."""
    with open(report_path, encoding="utf-8") as f:
        page = f.read()
    start, end = page.find(RUNTIME_START), page.find(RUNTIME_END)
    if start < 0 or end < start:
        raise ValueError(f"{report_path} is not a ferrocore compile report (no runtime section)")
    page = page[:start + len(RUNTIME_START)] + "\n" + body + "\n" + page[end:]
    folder = os.path.dirname(os.path.abspath(report_path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".report-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, report_path)
    except BaseException:
        os.unlink(tmp)
        raise
