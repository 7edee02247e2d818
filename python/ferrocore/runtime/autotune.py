"""Autotuning: a Triton kernel's candidate configurations timed on scratch buffers, the fastest
kept on disk (`mode="max-autotune"`)."""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from pathlib import Path

import torch

from . import triton_support
from .cache import read_cached_json, write_cached_json
from .triton_launch import _TRITON_POINTEE, TritonLaunch, _warmup


class Autotuner:
    """Times a kernel's candidate configurations with CUDA events on scratch buffers (zeros: any
    index a kernel computes from them is in range) and keeps the fastest, on disk."""

    def __init__(self, device, cache: Path | None, reps: int = 5, calls: int = 10, timer=None,
                 device_name: str | None = None):
        self.device, self.cache, self.reps, self.calls = device, cache, reps, calls
        self.timer = timer or self._cuda_time
        if device_name is None:
            device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        self.device_name = device_name

    def key(self, fn, signature: dict, launch: dict) -> str:
        text = json.dumps([launch.get("text") or getattr(fn, "__name__", ""), signature, launch.get("arg_numel"),
                           [list(c) for c in launch["candidates"]], self.device_name, triton_support.triton.__version__])
        return hashlib.sha256(text.encode()).hexdigest()

    def lookup(self, entry) -> tuple:
        """(the entry's cache key, the configuration cached for it or None)."""
        fn, signature, _, launch = entry
        key = self.key(fn, signature, launch)
        return key, self._cached(key, [tuple(c) for c in launch["candidates"]])

    def tune(self, entry, launcher, key: str | None = None, best=None) -> bool | None:
        """Binds the best configuration to `launcher`; True when it came from the cache, None
        when nothing could be timed (the heuristic configuration stays). `key` and `best` are
        what `lookup` gave, when the caller looked already."""
        fn, signature, constexprs, launch = entry
        candidates = [tuple(c) for c in launch["candidates"]]
        if key is None:
            key, best = self.lookup(entry)
        hit = best is not None
        compiled = {}
        if best is None:
            try:
                args = [torch.zeros(max(int(n), 1), dtype=_TRITON_POINTEE[t], device=self.device)
                        for t, n in zip(signature.values(), launch["arg_numel"])]
            except (KeyError, RuntimeError):
                return None
            timings = {}
            for c in candidates:
                trial = self._bound(fn, signature, c)
                if trial is None:
                    continue
                compiled[c] = trial
                try:
                    timings[c] = self.timer(lambda t=trial[0]: t(*args))
                except Exception as e:  # noqa: BLE001  (out of resources at this block size)
                    print(f"[ferrocore:autotune] {getattr(fn, '__name__', fn)} {c} does not run: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", file=sys.stderr)
                    continue
            if not timings:
                return None
            best = min(timings, key=timings.get)
            self._store(key, best, timings)
        trial = compiled.get(best) or self._bound(fn, signature, best)
        if trial is None:
            return None
        grid, blocks, warps, stages = best
        launcher.grid, launcher.constexprs = grid, dict(blocks)
        launcher.num_warps, launcher.num_stages = warps, stages
        launcher._fast = launcher._direct = None
        launcher.bind(trial[1], self._index())
        return hit

    def _index(self) -> int:
        if self.device.type != "cuda":
            return 0
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def warm(self, fn, signature: dict, config) -> None:
        """Compiles one candidate ahead of its timing (failures are reported when it is bound)."""
        try:
            _warmup(fn, signature, self.device, config)
        except Exception:  # noqa: BLE001
            pass

    def _bound(self, fn, signature: dict, config):
        """(a launch of `fn` in `config`, its compiled binary), or None where it does not compile."""
        try:
            compiled = _warmup(fn, signature, self.device, config)
        except Exception as e:  # noqa: BLE001  (e.g. out of shared memory at this block size)
            print(f"[ferrocore:autotune] {getattr(fn, '__name__', fn)} {config} does not compile: "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", file=sys.stderr)
            return None
        if compiled is None:
            return None
        grid, blocks, warps, stages = config
        launch = TritonLaunch(fn, grid, dict(blocks), warps, stages)
        launch.bind(compiled, self._index())
        return launch, compiled

    def _cuda_time(self, run) -> float:
        """Median ms per launch over `reps` rounds of `calls` launches, after a warm-up."""
        run()
        torch.cuda.synchronize(self.device)
        samples = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.calls):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / self.calls)
        return statistics.median(samples)

    def _entry(self, key: str) -> str:
        """The cache entry name of `key`, relative to the cache directory (`self.cache`'s parent)."""
        return f"{self.cache.name}/{key[:2]}/{key}.json"

    def _cached(self, key: str, candidates: list):
        if self.cache is None:
            return None
        data = read_cached_json(self.cache.parent, self._entry(key))
        if data is None:
            return None
        try:
            grid, blocks, warps, stages = data["best"]
            best = (grid, tuple((name, value) for name, value in blocks), warps, stages)
            if data.get("key") == key and best in candidates:
                return best
        except (KeyError, TypeError, ValueError):
            pass
        print(f"[ferrocore:autotune] cache entry {self._entry(key)} is unusable; tuning again", file=sys.stderr)
        return None

    def _store(self, key: str, best, timings: dict) -> None:
        if self.cache is None:
            return
        data = {"key": key, "best": list(best),
                "timings_ms": [[list(c), round(t, 6)] for c, t in sorted(timings.items(), key=lambda kv: kv[1])]}
        write_cached_json(self.cache.parent, self._entry(key), data)
