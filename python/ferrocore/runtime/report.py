"""A compiled module's benchmark (`benchmark`, `benchmark_main`: the module's `__main__`), and
the runtime section of a compile report (`crates/ferrocore/src/report`): where the module's time
goes when its benchmark runs, by kernel and library call (torch.profiler's device times on the
GPU; a clock around each kernel on the CPU), written into the report between its runtime marks.

`python MODULE.py --report REPORT.html` does it.
"""

from __future__ import annotations

import argparse
import ctypes
import html
import os
import statistics
import sys
import tempfile
import time
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


def measure(call, args, module: dict, reps: int) -> list:
    """Runs `call` `reps` times; the time per run by kernel and by library call. On the GPU, the
    device time of each under torch.profiler; on the CPU, `_measure_host`."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    if not cuda:
        return _measure_host(call, args, module, reps)
    names = set(kernel_names(module))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    call(list(args))
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(reps):
            call(list(args))
        torch.cuda.synchronize()
    totals: dict = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = "kernel" if e.name in names else "copy" if e.name.startswith(("Memcpy", "Memset")) else "library"
        _add(totals, e.name, kind, e.time_range.elapsed_us() / 1e3, reps)
    return sorted(totals.values(), key=lambda r: -r.ms)


def _add(totals: dict, name: str, kind: str, ms: float, reps: int) -> None:
    row = totals.setdefault(name, Row(name, kind, 0.0, 0.0))
    row.calls += 1 / reps
    row.ms += ms / reps


def _measure_host(call, args, module: dict, reps: int) -> list:
    """The CPU's time per run: each kernel's by a clock around its call (a profiler range
    costs more than many kernels take, and summed its overhead into the total), each top-level
    library call's and allocation's host time under torch.profiler in separate runs, and what
    neither covers (the wrapper's own Python) as one row, so that the rows add up to the
    median wall time."""
    kernels = [k for k in kernel_names(module) if isinstance(module.get(k), ctypes._CFuncPtr)]
    spent = {k: [0, 0] for k in kernels}  # ns, calls

    def clocked(fn, entry):
        def run(*a):
            t = time.perf_counter_ns()
            try:
                return fn(*a)
            finally:
                entry[0] += time.perf_counter_ns() - t
                entry[1] += 1

        return run

    saved = {k: module[k] for k in kernels}
    module.update({k: clocked(module[k], spent[k]) for k in kernels})  # `call` reads its globals at each call
    walls = []
    try:
        call(list(args))
        for entry in spent.values():
            entry[:] = [0, 0]
        for _ in range(reps):
            t = time.perf_counter_ns()
            call(list(args))
            walls.append((time.perf_counter_ns() - t) / 1e6)
    finally:
        module.update(saved)
    totals: dict = {}
    for k, (ns, count) in spent.items():
        if count:
            totals[k] = Row(k, "kernel", count / reps, ns / 1e6 / reps)
    with _without_profiler_noise():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                call(list(args))
    for e in prof.events():
        if e.cpu_parent is None and e.name.startswith("aten::"):
            kind = "allocation" if e.name in _ALLOCATIONS else "library"
            _add(totals, e.name, kind, e.time_range.elapsed_us() / 1e3, reps)
    walls.sort()
    rest = walls[len(walls) // 2] - sum(r.ms for r in totals.values())
    if rest > 0:
        totals["rest"] = Row("the rest: the wrapper's Python", "other", 1.0, rest)
    return sorted(totals.values(), key=lambda r: -r.ms)


class _without_profiler_noise:
    """Drops what the profiler's C++ side prints to stderr as it starts on a machine without a
    GPU (`gpuGetDeviceCount failed`, its start and stop lines); other lines pass through."""

    NOISE = ("gpuGetDeviceCount", "profiler_start", "profiler_stop")

    def __enter__(self):
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        kept = [line for line in self._file.read().decode(errors="replace").splitlines(True)
                if not any(n in line for n in self.NOISE)]
        self._file.close()
        sys.stderr.write("".join(kept))
        return False


def runtime_html(rows: list, wall_ms: float, device: str) -> str:
    total = sum(r.ms for r in rows) or 1e-9
    if device == "cuda":
        what = (f"the device time of each kernel and library call (torch.profiler), {total:.4f} ms per run in "
                "all; the wall time also counts launches and host work")
    else:
        what = (f"each kernel's call by a clock, each library call's host time (torch.profiler, in other runs), "
                f"and the rest of the wall time as one row: {total:.4f} ms per run in all")
    out = [f"<p>Median wall time per run: {wall_ms:.4f} ms. Measured: {html.escape(what)}.</p>",
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


def benchmark(call, args, reps: int = 100, report: str | None = None, module: dict | None = None) -> float:
    """Prints and returns the median time of `call(list(args))` in ms. With `report` (a compile
    report's path) and `module` (the compiled module's globals), also profiles `reps` runs and
    writes the time by kernel and library call into the report's runtime section."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(min(reps, 10)):
        call(list(args))  # a copy each time: a boxed call may clear its argument list
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call(list(args))
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(times)
    print(f"median {median:.4f} ms over {reps} runs")
    if report is not None:
        rows = measure(call, args, module or {}, reps)
        fill_runtime(report, runtime_html(rows, median, "cuda" if cuda else "cpu"))
        print(f"runtime by kernel written into {report}")
    return median


def benchmark_main(benchmark_compiled_module) -> None:
    """A compiled module's `__main__`: `python MODULE.py [--reps N] [--report REPORT.html]`."""
    parser = argparse.ArgumentParser(description="Times the compiled graph on random inputs.")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--report", help="a compile report of this module: fill in its runtime section")
    a = parser.parse_args()
    benchmark_compiled_module(a.reps, report=a.report)
