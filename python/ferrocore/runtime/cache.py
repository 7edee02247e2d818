"""The on-disk cache from Python: where it is and how to keep it small.

Everything ferrocore caches (kernel libraries and their sources, wrapper modules, autotuning
winners, GEMM-padding timings) lives under one directory per user, `directory()`. Rust owns the
trust rules (`runtime/cache.rs`: private modes, ownership checks, HMAC manifests); this module
names the directory, reads and writes JSON entries through Rust, and exposes eviction.
"""

from __future__ import annotations

import json
import sys

from ..extension import extension
from ..options import build_options


def directory(overrides: dict | None = None) -> str:
    """The cache directory compiles use now (`FERROCORE_CACHE_DIR`, `options={"cache_dir": ...}`,
    else the per-user default)."""
    return build_options(overrides)["cache_dir"]


def read_cached_json(cache_dir, rel: str):
    """The JSON value of cache entry `rel` (a relative path under `cache_dir`), or None when it
    is missing, truncated, edited or not signed by this user's cache (then it is rebuilt)."""
    data = extension().cache_read(str(cache_dir), rel)
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


def write_cached_json(cache_dir, rel: str, data) -> None:
    """Writes cache entry `rel` whole, then its manifest (0600, atomically)."""
    extension().cache_write(str(cache_dir), rel, json.dumps(data).encode())


def evict(max_bytes: int, cache_dir: str | None = None, stale_after_s: float = 3600.0) -> dict:
    """Removes least recently used entries until the cache holds at most `max_bytes`; entries no
    manifest vouches for (an older ferrocore's) go first. Safe while other processes compile and
    load from the same cache: a loader maps the file it verified, so removing it changes nothing
    for them, and temporary files younger than `stale_after_s` (a compile in flight) stay.
    Returns {"total_bytes", "removed_entries", "removed_bytes"}."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return json.loads(extension().evict_cache(cache_dir or directory(), int(max_bytes), float(stale_after_s)))


class Trimmer:
    """Keeps a cache under its size limit from the compiles of one process: trims at the first
    compile and after every `every` compiles that wrote new entries (a walk of the directory
    each time, so not after every one). A failed trim is reported and compiling goes on."""

    def __init__(self, every: int = 32):
        self.every = every
        self.writes = 0
        self.trimmed: set = set()

    def after_compile(self, cache_dir: str, max_bytes: int | None, wrote: bool) -> None:
        if max_bytes is None:
            return
        self.writes += bool(wrote)
        if cache_dir in self.trimmed and not (wrote and self.writes % self.every == 0):
            return
        self.trimmed.add(cache_dir)
        try:
            evict(max_bytes, cache_dir)
        except Exception as e:  # noqa: BLE001 - a cache that cannot be trimmed still works
            print(f"[ferrocore:cache] could not trim {cache_dir} to {max_bytes} bytes: {e}", file=sys.stderr)
