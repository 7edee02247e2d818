#!/usr/bin/env python
"""Captures the replay corpus: every graph the model benchmark sends the compiler, as the
exchange-format JSON the Rust side receives (`graph.json` of each stage dump).

    python bench/replay_capture.py                          # CPU, tiny, float32 -> cpu/
    python bench/replay_capture.py --device cuda            # on a GPU: full size, bfloat16 -> cuda/

The Rust test `crates/ferrocore/tests/replay.rs` compiles each stored graph again (no GPU, no
torch) and compares the generated kernels and host plan with the approved text beside it; see
`docs/replay.md`. Re-capture only when the front changes what it sends: a new capture replaces
the folder's graphs, and the approved outputs are regenerated from them (`UPDATE_EXPECT=1`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))
CORPUS = REPO_ROOT / "crates" / "ferrocore" / "tests" / "replay"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--models", default="", help="comma list (default: all of model_zoo.MODELS)")
    ap.add_argument("--tasks", default="inference,training")
    ap.add_argument("--out", default=None, help="default: the corpus folder of the device type")
    args = ap.parse_args()
    dev_type = args.device.split(":")[0]
    size = args.size or ("full" if dev_type == "cuda" else "tiny")
    out = Path(args.out) if args.out else CORPUS / dev_type / "graphs"
    dumps = Path(tempfile.mkdtemp(prefix="ferrocore-replay-"))
    # the options are read at each compile: every graph is dumped, none comes from the graph cache
    os.environ["FERROCORE_DEBUG_DIR"] = str(dumps)

    import torch
    import torch._dynamo

    import ferrocore  # noqa: F401  (registers the backend)
    import model_zoo

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev_type == "cuda" else torch.float32)
    names = [m for m in args.models.split(",") if m] or list(model_zoo.MODELS)
    if out.exists() and not args.models:
        shutil.rmtree(out)  # a full capture replaces the folder; a partial one adds to it
    out.mkdir(parents=True, exist_ok=True)
    captured = 0
    failed = []
    for name in names:
        for task in args.tasks.split(","):
            torch._dynamo.reset()
            shutil.rmtree(dumps, ignore_errors=True)
            dumps.mkdir()
            try:
                _run(model_zoo, name, task, size, args.device, dtype)
            except model_zoo.MissingDependency as e:
                print(f"{name} {task}: skipped ({e})", file=sys.stderr)
                continue
            except Exception as e:  # noqa: BLE001 - one model's failure must not lose the others
                failed.append(name)
                print(f"{name} {task}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
                continue
            # in compile order (a dump folder's creation), each named by the model, the task and
            # its part (inference, fw, bw), numbered when a graph break makes several
            graphs = sorted(dumps.glob("*/graph.json"), key=lambda g: g.parent.stat().st_mtime_ns)
            parts: dict[str, int] = {}
            for g in graphs:
                data = g.read_bytes()
                part = _part(json.loads(data)["name"])
                parts[part] = parts.get(part, 0) + 1
                suffix = "" if parts[part] == 1 else f"{parts[part]}"
                (out / f"{name}-{task}-{part}{suffix}.json.gz").write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
                captured += 1
            print(f"{name} {task}: {len(graphs)} graphs", file=sys.stderr)
    shutil.rmtree(dumps, ignore_errors=True)
    print(f"{captured} graphs in {out}")
    return 1 if failed else 0


def _part(graph_name: str) -> str:
    """inference, fw or bw: the word the front ends a graph's name with (before any counter)."""
    words = graph_name.split("_")
    return next((w for w in reversed(words) if w in ("inference", "fw", "bw")), "graph")


def _run(model_zoo, name: str, task: str, size: str, device: str, dtype) -> None:
    import torch

    case = model_zoo.build(name, size, device, dtype)
    if task == "inference":
        fn = torch.compile(case.model, backend="ferrocore")
        with torch.no_grad():
            fn(*case.make_inputs())
        return
    fn = torch.compile(case.train, backend="ferrocore")
    fn(*case.make_train_inputs()).backward()


if __name__ == "__main__":
    sys.exit(main())
