"""Timings measured on the device once and then read from the cache: what the compile layer's
choices that depend on the machine (GEMM padding, `padding`; CPU convolution layouts,
`conv_layout`) are made from."""

from __future__ import annotations

import hashlib
import json
import statistics

import torch

from torch._subclasses.fake_tensor import unset_fake_temporarily

from .cache import read_cached_json, write_cached_json


def cached_measurement(cache_dir, family: str, key: list, measure, errors=(RuntimeError,)) -> list | None:
    """The timings `measure()` returns (a list of ms) for `key`, measured once and then read from
    cache entry `family/..` (the key's JSON text is stored beside them and must match); None when
    measuring raised one of `errors`, or when nothing is cached and `measure` is None (a lookup).
    Runs outside any fake-tensor mode (real tensors)."""
    key_text = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(key_text.encode()).hexdigest()
    entry = f"{family}/{digest[:2]}/{digest}.json"
    cached = read_cached_json(cache_dir, entry) if cache_dir else None
    if isinstance(cached, dict) and cached.get("key") == key_text and isinstance(cached.get("ms"), list):
        return cached["ms"]
    if measure is None:
        return None
    try:
        with unset_fake_temporarily():
            ms = list(measure())
    except errors:
        return None
    if cache_dir:
        write_cached_json(cache_dir, entry, {"key": key_text, "ms": ms})
    return ms


def median_cuda_ms(fn, reps: int = 7, calls: int = 1) -> float:
    """Median over `reps` rounds of CUDA-event time per call of `calls` calls of `fn`, after two
    warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)
