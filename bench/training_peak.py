"""Training-step peak memory of one model under Inductor and ferrocore, in one fresh process.

    python bench/training_peak.py bert [--size full] [--device cuda]

After three warm-up steps, one step is measured twice: its peak above everything allocated before
it (the previous step's gradients included, as `bench/models.py` measures), and above what
remains once those gradients are dropped; then the bytes the gradients' storages hold and the
allocator's absolute peak. Two backends whose peaks differ by a few MB in `bench/models.py`
(which runs eager and both compilers in one process, one model after another) are compared here
without that history.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_zoo  # noqa: E402

import ferrocore  # noqa: E402,F401  (registers the backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--size", default="full")
    ap.add_argument("--device", default="cuda")
    opts = ap.parse_args()
    torch.manual_seed(0)
    case = model_zoo.build(opts.model, opts.size, opts.device, torch.bfloat16)
    case.train.train(True)
    params = list(case.model.parameters())
    inputs = case.make_train_inputs()

    def grad_mb() -> float:
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in params if p.grad is not None}
        return sum(storages.values()) / 2**20

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
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        print(f"{opts.model} {backend}: peak above all {peaks[0]:.1f} MB, above what outlives the old gradients "
              f"{peaks[1]:.1f} MB, gradient storages {grad_mb():.1f} MB, absolute peak "
              f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
