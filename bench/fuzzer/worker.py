"""A worker process: reads one JSON request per line on stdin ({"programs": [...]}), runs them
as one compiled graph (check.run_programs) and writes one JSON line of results. Anything else
the process prints goes to stderr, so a crash in a kernel never corrupts the protocol.

    python -m fuzzer.worker --backend cpp --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings


def _setup(backend: str, device: str, threads: int) -> None:
    """Settings that must precede importing torch and triton."""
    if backend == "triton" and device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if backend != "auto":
        os.environ["FERROCORE_BACKEND"] = backend
    os.environ["RUST_BACKTRACE"] = "0"  # an internal error's message, not pages of frames
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cpp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    # torch's pipeline alone (AOT autograd, ferrocore's decompositions, no ferrocore code): does
    # a program that crashed the process crash it without ferrocore?
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    _setup(args.backend, args.device, args.threads)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # prints of torch, g++ or a kernel go to stderr
    sys.stdout = sys.stderr
    warnings.simplefilter("ignore")

    import torch

    from .check import _torch_reference, run_programs
    from .program import Program

    if args.threads:
        torch.set_num_threads(args.threads)
    # `.item()` values and data-dependent shapes go into the graph (op_item, boolean masks)
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    for line in sys.stdin:
        request = json.loads(line)
        programs = [Program.from_dict(p) for p in request["programs"]]
        start = time.perf_counter()
        try:
            results = run_programs(programs, args.backend, args.device,
                                   compiler=_torch_reference() if args.reference else None)
        except Exception as e:  # noqa: BLE001 - a bug of the fuzzer itself, reported as such
            import traceback

            detail = "".join(traceback.format_exception(e))[-3000:]
            results = [{"class": "harness_error", "detail": detail}] * len(programs)
        reply = {"results": results, "seconds": time.perf_counter() - start}
        broken = _device_broken(args.device)
        if broken:
            # a kernel that faulted (an illegal address) leaves the CUDA context unusable: this
            # batch crashed, and the runner starts a fresh worker for the next
            reply = {"results": [{"class": "crash", "detail": broken}] * len(programs), "seconds": reply["seconds"],
                     "restart": True}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
        if broken:
            return


def _device_broken(device: str) -> str:
    """Why the device can run nothing more (a sticky CUDA error), or ""."""
    if device != "cuda":
        return ""
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception as e:  # noqa: BLE001 - any error here means the context is gone
        return f"the CUDA context broke: {type(e).__name__}: {str(e)[:500]}"
    return ""


if __name__ == "__main__":
    main()
