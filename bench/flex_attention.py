"""FlexAttention on the GPU: ferrocore's compiled `flex_attention` against Inductor's and, for the
plain causal case, against `scaled_dot_product_attention`'s flash kernel, side by side in one
run. Forward, and forward + backward, bf16, the masks and score modifications users write
(causal, sliding window, document packing, ALiBi).

    python bench/flex_attention.py [--seqs 1024,2048,4096,8192] [--cases causal,...] [--reps 20]
                                   [--tasks forward,training]

Each case keeps the tokens per call constant (batch x sequence = --tokens), 16 heads of 64.
Prints one table per task: median ms per call (CUDA events, 5 rounds of --reps calls), the
profiler's kernel time per call, each compiler's check against the other (max abs difference of
the outputs, and of q's gradient in training), and ferrocore's ratio to Inductor and to flash.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ferrocore.runtime.measurement import median_cuda_ms

HEADS, DIM = 16, 64
WINDOW = 256
# (the CPU: a smoke run of the script itself, in float32)
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
DOCUMENTS = 8  # per sequence, of random lengths


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv < WINDOW)


def alibi(score, b, h, q, kv):
    slope = torch.exp2(-((h + 1) * 8.0 / HEADS))
    return score + slope * (kv - q)


def document_mask(seq: int, device):
    """A causal mask within each of DOCUMENTS packed documents of random lengths."""
    g = torch.Generator().manual_seed(seq)
    cuts = torch.randperm(seq - 1, generator=g)[: DOCUMENTS - 1].sort().values + 1
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([seq])]))
    document = torch.repeat_interleave(torch.arange(DOCUMENTS), lengths).to(device)

    def same_document(b, h, q, kv):
        return (document[q] == document[kv]) & (q >= kv)

    return same_document


def case(name: str, seq: int, device):
    """(mask_mod or None, score_mod or None) of a case."""
    if name == "causal":
        return causal, None
    if name == "sliding_window":
        return sliding_window, None
    if name == "document":
        return document_mask(seq, device), None
    if name == "alibi":
        return None, alibi
    if name == "causal_alibi":
        return causal, alibi
    raise SystemExit(f"unknown case {name}")


CASES = ["causal", "sliding_window", "document", "alibi", "causal_alibi"]


def cuda_ms(fn, reps: int) -> float:
    """Median ms per call over 5 rounds of `reps` calls (CUDA events; wall time on the CPU)."""
    if not torch.cuda.is_available():  # (a smoke run on the CPU)
        for _ in range(2):
            fn()
        return statistics.median(_wall_ms(fn) for _ in range(reps))
    return median_cuda_ms(fn, reps=5, calls=reps)


def _wall_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def kernel_ms(fn, reps: int = 5) -> float | None:
    """The profiler's device time per call, summed over every kernel the call runs."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        total_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
        return total_us / reps / 1e3 if total_us > 0 else None
    except Exception:  # noqa: BLE001  (no CUPTI on this machine)
        return None


def step(attend, training: bool, q, k, v, dout):
    """One call: the forward, or the forward and its backward (the gradients' sum of q, k, v)."""
    if not training:
        return lambda: attend(q, k, v)

    def run():
        q.grad = k.grad = v.grad = None
        attend(q, k, v).backward(dout)
        return q.grad

    return run


def measure(name: str, seq: int, tokens: int, training: bool, reps: int, device: str, dtype: torch.dtype) -> dict:
    batch = max(1, tokens // seq)
    mask_mod, score_mod = case(name, seq, device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(batch, HEADS, seq, DIM, device=device, dtype=dtype, generator=g)
                     for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(training)
    block_mask = (create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device)
                  if mask_mod is not None else None)

    def flex(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

    variants = {}
    for backend in ("inductor", "ferrocore"):
        torch._dynamo.reset()
        variants[backend] = torch.compile(flex, backend=backend, dynamic=False)
    if name == "causal" and device == "cuda":
        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        variants["flash"] = flash

    row = {"case": name, "seq": seq, "batch": batch}
    outputs = {}
    for label, attend in variants.items():
        fn = step(attend, training, q, k, v, dout)
        try:
            outputs[label] = fn().detach().float().clone()
            row[f"{label} ms"] = cuda_ms(fn, reps)
            row[f"{label} kernel ms"] = kernel_ms(fn)
        except Exception as e:  # noqa: BLE001  (a failure is a result)
            row[f"{label} ms"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
        torch.cuda.empty_cache()
    if "inductor" in outputs and "ferrocore" in outputs:
        row["max diff"] = (outputs["inductor"] - outputs["ferrocore"]).abs().max().item()
    return row


def fmt(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tasks", default="forward,training")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x sequence per call")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no flash kernel, no profiler)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (the GPU's default), float16 or float32 (the CPU's)")
    opts = ap.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("bench/flex_attention.py measures on a CUDA GPU; none here", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if opts.device == "cuda" else "cpu"
    dtype = getattr(torch, opts.dtype) if opts.dtype else DTYPE[opts.device]
    print(f"device {name}, torch {torch.__version__}; {str(dtype).removeprefix('torch.')}, {HEADS} heads of {DIM}, "
          f"{opts.tokens} tokens per call, window {WINDOW}, {DOCUMENTS} documents per sequence")
    for task in opts.tasks.split(","):
        training = task == "training"
        print(f"\n### {task}\n")
        print("| case | seq | batch | inductor ms | ferrocore ms | flash ms | inductor kernel ms | "
              "ferrocore kernel ms | flash kernel ms | speedup vs inductor (kernel) | ferrocore / flash time (kernel) "
              "| max diff |")
        print("|---" * 12 + "|")
        for case_name in opts.cases.split(","):
            for seq in (int(s) for s in opts.seqs.split(",")):
                r = measure(case_name, seq, opts.tokens, training, opts.reps, opts.device, dtype)
                ik, fk, lk = (r.get(f"{b} kernel ms") for b in ("inductor", "ferrocore", "flash"))
                print(f"| {case_name} | {seq} | {r['batch']} | {fmt(r.get('inductor ms'))} | {fmt(r.get('ferrocore ms'))} | "
                      f"{fmt(r.get('flash ms'))} | {fmt(ik)} | {fmt(fk)} | {fmt(lk)} | "
                      f"{ratio(r.get('inductor ms'), r.get('ferrocore ms'))} ({ratio(ik, fk)}) | "
                      f"{ratio(r.get('ferrocore ms'), r.get('flash ms'))} ({ratio(fk, lk)}) | "
                      f"{fmt(r.get('max diff'))} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
