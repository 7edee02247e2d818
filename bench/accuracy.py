"""Accuracy of long reductions and scans: eager, ferrocore (and optionally Inductor) against a
float64 run of the same float32 inputs, at 1e5 to 1e8 elements.

    python bench/accuracy.py                       # CPU, 1e5..1e8, 3 seeds
    python bench/accuracy.py --device cuda         # Triton kernels on a GPU
    python bench/accuracy.py --sizes 1e5,1e6 --seeds 1 --inductor

Each case's error is max|out - ref| / max|ref| over the output, the largest over the seeds. The
ratio column is ferrocore's error over eager's; the bar (issue 44) is a ratio of at most 2.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import ferrocore  # noqa: F401  (registers the backend)


def cases(n: int, gen: torch.Generator, device: str) -> dict:
    """name -> (function, float32 inputs[, the float64 reference's function])."""

    def u(*size):
        return torch.rand(*size, generator=gen).to(device)

    def g(*size):
        return torch.randn(*size, generator=gen).to(device)

    return {
        "sum": (lambda x: x.sum(), (u(n),)),
        "mean": (lambda x: x.mean(), (u(n),)),
        "var": (lambda x: x.var(), (g(n) + 1000,)),
        "norm": (lambda x: torch.linalg.vector_norm(x), (g(n),)),
        "layer_norm": (lambda x: F.layer_norm(x, (n,)), (g(1, n) + 1000,)),
        "mse_loss": (lambda a, b: F.mse_loss(a, b), (u(n), u(n))),
        "cumsum": (lambda x: x.cumsum(0), (u(n),)),
        "logsumexp": (lambda x: x.logsumexp(0), (g(n),)),
        "sum bf16->f32": (lambda x: x.sum(dtype=torch.float32), (u(n).bfloat16(),), lambda x: x.sum()),
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="1e5,1e6,1e7,1e8")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--inductor", action="store_true", help="also compile with Inductor")
    opts = ap.parse_args(argv)
    sizes = [int(float(s)) for s in opts.sizes.split(",")]
    only = set(filter(None, opts.only.split(",")))
    compilers = ["ferrocore"] + (["inductor"] if opts.inductor else [])
    rows = []
    for n in sizes:
        errs: dict[str, dict[str, float]] = {}
        for seed in range(opts.seeds):
            gen = torch.Generator().manual_seed(seed)
            for name, (fn, args, *ref_fn) in cases(n, gen, opts.device).items():
                if only and name not in only:
                    continue
                # the float64 run reads the float32 inputs' values (bf16 ones too)
                ref = (ref_fn[0] if ref_fn else fn)(*(a.double() for a in args))
                e = errs.setdefault(name, {})
                e["eager"] = max(e.get("eager", 0.0), rel_err(fn(*args), ref))
                for c in compilers:
                    torch._dynamo.reset()
                    out = torch.compile(fn, backend=c)(*args)
                    e[c] = max(e.get(c, 0.0), rel_err(out, ref))
                del args, ref
            print(f"n={n:.0e} seed {seed} done", file=sys.stderr, flush=True)
        for name, e in errs.items():
            rows.append((name, n, e))
    head = "| case | elements | eager | " + " | ".join(compilers) + " | ferrocore / eager |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    worst = 0.0
    for name, n, e in rows:
        ratio = e["ferrocore"] / e["eager"] if e["eager"] > 0 else (0.0 if e["ferrocore"] == 0 else float("inf"))
        worst = max(worst, ratio)
        cols = " | ".join(f"{e[c]:.2e}" for c in compilers)
        print(f"| {name} | {n:.0e} | {e['eager']:.2e} | {cols} | {ratio:.2f} |")
    print(f"\nlargest ferrocore / eager error ratio: {worst:.2f} (bar: 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
