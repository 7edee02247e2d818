"""Per-graph and running compile statistics: `ferrocore.metrics`.

`metrics.last` describes the last graph handed to the backend (forward and backward graphs are
separate graphs); `metrics.total` sums every graph since the last `reset()`.
"""

from __future__ import annotations

import itertools
import sys
import threading

# (GPU kernels: binaries loaded from the cache, and compiled by worker processes)
_COUNTS = ("kernels", "externs", "fallbacks", "kernel_binary_hits", "compiled_in_workers")

# Compile-time parts (`Metrics.compile_time`), each a set of the timings graphs record.
_FRONT = ("serialize", "padding", "conv_layout", "specialize")  # the Python front's passes
STAGES = ("import", "lowering", "scheduling", "codegen", "wrapper")  # Rust's stages


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.last: dict = {}
        self._tickets = itertools.count()
        self._last_ticket = -1
        self.total: dict = {
            "graphs": 0,
            "kernels": 0,
            "externs": 0,
            "fallbacks": 0,
            "kernel_binary_hits": 0,
            "compiled_in_workers": 0,
            "graph_fallbacks": 0,
            "fallback_ops": {},
            "extern_ops": {},
            "timings_ms": {},
            "graph_cache": {},
        }
        self._dynamo_base = _dynamo_seconds()

    def ticket(self) -> int:
        """A graph's place in compile order, taken before its kernels compile: a training graph's
        forward may record from the thread its kernels compiled on after its backward recorded,
        and `last` stays the backward."""
        with self._lock:
            return next(self._tickets)

    def record(self, entry: dict, ticket: int | None = None) -> None:
        """Adds one compiled (or eagerly run) graph; `entry` becomes `last` unless a graph later
        in compile order (`ticket`) recorded already."""
        with self._lock:
            ticket = next(self._tickets) if ticket is None else ticket
            if ticket >= self._last_ticket:
                self.last, self._last_ticket = entry, ticket
            self._add(entry)

    def _add(self, entry: dict) -> None:
        t = self.total
        t["graphs"] += 1
        for key in _COUNTS:
            t[key] += entry.get(key, 0)
        t["graph_fallbacks"] += int(entry.get("graph_fallback", False))
        for op in entry.get("fallback_ops", ()):
            t["fallback_ops"][op] = t["fallback_ops"].get(op, 0) + 1
        for op in entry.get("extern_ops", ()):
            t["extern_ops"][op] = t["extern_ops"].get(op, 0) + 1
        for stage, ms in entry.get("timings_ms", {}).items():
            t["timings_ms"][stage] = t["timings_ms"].get(stage, 0.0) + ms
        if "graph_cache" in entry:
            t["graph_cache"][entry["graph_cache"]] = t["graph_cache"].get(entry["graph_cache"], 0) + 1

    def count(self, key: str, n: int = 1) -> None:
        """A runtime event, summed in `total` from its first occurrence: under
        mode="reduce-overhead", `cudagraph_recordings`, `cudagraph_replays` (a recording run again),
        `cudagraph_plain_calls` (warm-up calls, and calls whose recordings' outputs are all still
        held) and `cudagraph_capture_failures`; `direct_trace_failures` (inference graphs the
        direct trace failed on, for a reason it does not know, and AOT autograd traced);
        `recompiles` (compiles of a dynamic-shape graph for an input signature after its first,
        each logged on the `recompiles` channel)."""
        self.total[key] = self.total.get(key, 0) + n

    def compile_time(self) -> dict:
        """Seconds spent compiling since `reset()`, by part: `dynamo` (Dynamo's own, less the
        backend call), `aot` (AOT autograd before each graph reaches ferrocore), `trace` (the
        direct trace of inference graphs that skip AOT autograd), `front` (the
        Python passes), each Rust stage, `cpp_compile`, `triton_compile` (or `autotune`),
        `load` (running wrapper modules), `graph_cache` (looking up compiled-graph entries);
        `stages` sums the Rust stages, `backend` every part but Dynamo's."""
        ms = self.total["timings_ms"]
        parts = {"dynamo": max(_dynamo_seconds() - self._dynamo_base, 0.0), "aot": ms.get("aot", 0.0) / 1e3,
                 "trace": ms.get("trace", 0.0) / 1e3, "front": sum(ms.get(k, 0.0) for k in _FRONT) / 1e3}
        parts.update({k: ms.get(k, 0.0) / 1e3 for k in STAGES})
        parts["stages"] = sum(parts[k] for k in STAGES)
        parts["cpp_compile"] = ms.get("cpp_compile", 0.0) / 1e3
        parts["triton_compile"] = (ms.get("triton_compile", 0.0) + ms.get("autotune", 0.0)) / 1e3
        parts["load"] = ms.get("load", 0.0) / 1e3
        parts["graph_cache"] = ms.get("graph_cache", 0.0) / 1e3
        parts["backend"] = sum(v for k, v in parts.items() if k not in ("dynamo", "stages"))
        return parts

    def summary(self) -> str:
        t = self.total
        lines = [
            f"ferrocore: {t['graphs']} graphs, {t['kernels']} kernels, {t['externs']} externs, "
            f"{t['fallbacks']} node fallbacks, {t['graph_fallbacks']} graphs run eagerly"
        ]
        events = {k: v for k, v in t.items() if k.startswith("cudagraph_")}
        if events:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in events.items()))
        if t["timings_ms"]:
            parts = self.compile_time()
            lines.append("  compile (s): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if v and k not in STAGES))
            lines.append("  stages (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in t["timings_ms"].items()))
        if t["graph_cache"]:
            lines.append("  compiled-graph cache: " + ", ".join(f"{k} {v}" for k, v in t["graph_cache"].items()))
        if self.last:
            last = {k: v for k, v in self.last.items() if k != "timings_ms"}
            lines.append(f"  last: {last}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


def _dynamo_seconds() -> float:
    """Dynamo's compile time in this process so far, less the time its backends took (torch's
    `compilation_time_metrics`); 0 before torch is imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    times = getattr(utils, "compilation_time_metrics", {})
    return sum(times.get("_compile.compile_inner", ())) - sum(times.get("OutputGraph.call_user_compiler", ()))


metrics = Metrics()


def __getattr__(name: str):
    # `ferrocore.metrics` is the Metrics instance, but code that does `import ferrocore.metrics`
    # and then reads this module sees the same data.
    if name in ("last", "total", "reset", "record", "summary", "count", "compile_time"):
        return getattr(metrics, name)
    raise AttributeError(name)
