"""Training-step peak memory of one model under Inductor and ferrocore, in one fresh process.

    python bench/training_peak.py bert [--size full] [--device cuda] [--blocks]

After three warm-up steps, one step is measured twice: its peak above everything allocated before
it (the previous step's gradients included, as `bench/models.py` measures), and above what
remains once those gradients are dropped; then the bytes the gradients' storages hold and the
allocator's absolute peak. Each as allocated (the cached blocks handed out) and as requested
(what the program asked for; `bench/models.py` reports this one). Two backends whose peaks differ by a few MB in `bench/models.py`
(which runs eager and both compilers in one process, one model after another) are compared here
without that history. `--blocks` then lists the blocks live at each backend's peak (allocated
during the step) by size where the two backends' counts differ, with where each was allocated
and the allocation that set the peak.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_zoo  # noqa: E402
import models  # noqa: E402

import ferrocore  # noqa: E402,F401  (registers the backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--size", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", action="store_true", help="compare the blocks live at the two peaks")
    opts = ap.parse_args()
    torch.manual_seed(0)
    case = model_zoo.build(opts.model, opts.size, opts.device, torch.bfloat16)
    case.train.train(True)
    params = list(case.model.parameters())
    inputs = case.make_train_inputs()

    def grad_mb() -> float:
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in params if p.grad is not None}
        return sum(storages.values()) / 2**20

    at_peak = {}
    for backend in ("inductor", "ferrocore"):
        torch._dynamo.reset()
        compiled = torch.compile(case.train, backend=backend)

        def step():
            for p in params:
                p.grad = None
            compiled(*inputs).backward()

        for _ in range(3):
            step()
        peaks = []
        for drop_gradients in (False, True):
            if drop_gradients:
                for p in params:
                    p.grad = None
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated(), torch.cuda.memory_stats()["requested_bytes.all.current"]
            step()
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            peaks.append(((stats["allocated_bytes.all.peak"] - base[0]) / 2**20, (stats["requested_bytes.all.peak"] - base[1]) / 2**20))
        print(f"{opts.model} {backend}: peak above all {peaks[0][0]:.2f} MB allocated, {peaks[0][1]:.2f} requested; "
              f"above what outlives the old gradients {peaks[1][0]:.2f} / {peaks[1][1]:.2f}; gradient storages "
              f"{grad_mb():.1f} MB; absolute peak {stats['allocated_bytes.all.peak'] / 2**20:.2f} allocated, "
              f"{stats['requested_bytes.all.peak'] / 2**20:.2f} requested", flush=True)
        if opts.blocks:
            _, blocks, peak_ev = models.live_at_peak(step)
            at_peak[backend] = ([(e["size"], models.allocated_at(e)) for e in blocks],
                                models.allocated_at(peak_ev) if peak_ev else "?")
    if opts.blocks:
        compare_blocks(at_peak)


def compare_blocks(at_peak: dict) -> None:
    counts = {b: collections.Counter(size for size, _ in blocks) for b, (blocks, _) in at_peak.items()}
    for b, (blocks, peak_where) in at_peak.items():
        print(f"{b}: {len(blocks)} blocks live at the peak, {sum(s for s, _ in blocks) / 2**20:.2f} MB; "
              f"the peak reached at {peak_where}")
    ind, fc = counts["inductor"], counts["ferrocore"]
    print("size (bytes) | inductor blocks | ferrocore blocks | allocated at (ferrocore, else inductor)")
    for size in sorted(set(ind) | set(fc), reverse=True):
        if ind[size] != fc[size]:
            src = at_peak["ferrocore" if fc[size] > ind[size] else "inductor"][0]
            places = collections.Counter(w for s, w in src if s == size).most_common(3)
            print(f"{size} | {ind[size]} | {fc[size]} | {places}")


if __name__ == "__main__":
    main()
