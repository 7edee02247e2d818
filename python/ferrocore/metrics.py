"""Per-graph and running compile statistics: `ferrocore.metrics`.

`metrics.last` describes the last graph handed to the backend (forward and backward graphs are
separate graphs); `metrics.total` sums every graph since the last `reset()`.
"""

from __future__ import annotations

_COUNTS = ("kernels", "externs", "fallbacks")


class Metrics:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.last: dict = {}
        self.total: dict = {
            "graphs": 0,
            "kernels": 0,
            "externs": 0,
            "fallbacks": 0,
            "graph_fallbacks": 0,
            "fallback_ops": {},
            "extern_ops": {},
            "timings_ms": {},
        }

    def record(self, entry: dict) -> None:
        """Adds one compiled (or eagerly run) graph; `entry` becomes `last`."""
        self.last = entry
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

    def count(self, key: str, n: int = 1) -> None:
        """A runtime event, summed in `total` from its first occurrence: under
        mode="reduce-overhead", `cudagraph_recordings`, `cudagraph_replays` (a recording run again),
        `cudagraph_plain_calls` (warm-up calls, and calls whose recordings' outputs are all still
        held) and `cudagraph_capture_failures`."""
        self.total[key] = self.total.get(key, 0) + n

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
            stages = ", ".join(f"{k} {v:.1f}" for k, v in t["timings_ms"].items())
            lines.append(f"  time (ms): {stages}")
        if self.last:
            last = {k: v for k, v in self.last.items() if k != "timings_ms"}
            lines.append(f"  last: {last}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


metrics = Metrics()


def __getattr__(name: str):
    # `ferrocore.metrics` is the Metrics instance, but code that does `import ferrocore.metrics`
    # and then reads this module sees the same data.
    if name in ("last", "total", "reset", "record", "summary", "count"):
        return getattr(metrics, name)
    raise AttributeError(name)
