"""GEMMs with their epilogues at the shapes real models send: eager, Inductor, and ferrocore with
the GEMM as a library call and as its matrix-product template (autotuned on the GPU), side by side
in one run. On the GPU (bfloat16) the full-size models' layers; on the CPU (`--device cpu`,
float32) the tiny models' layers, where the C++ matrix-product kernel takes the place of the
template. A place to find causes (which tile wins where, what the epilogue saves), not a result:
results are the model benchmark's.

    python bench/gemm_templates.py [--reps 50] [--inductor-autotune] [--only NAME,...]
    python bench/gemm_templates.py --device cpu [--threads 1] [--reps 200]

Prints one table: median ms per call (CUDA events, or the CPU's clock, over `--reps` calls, 5
rounds) and each compiled variant's ratio to the library form.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# name -> (M, K, N, what): x [M, K] @ w.T [K, N] + b, then the epilogue; the sizes of the
# model zoo's full-size layers (batch x sequence rows). `what` may start with a prologue:
# "cast_weight," (a float32 weight cast to the GEMM's type in the graph, as a model keeping
# float32 master weights does) or "scale_input," (x * 0.5 first, as a query's scaling)
SHAPES = {
    "gpt2_mlp_up_gelu": (8192, 768, 3072, "gelu_tanh"),
    "gpt2_mlp_down_residual": (8192, 3072, 768, "residual"),
    "gpt2_qkv": (8192, 768, 2304, "none"),
    "gpt2_lm_head": (8192, 768, 50257, "none"),
    "bert_ffn_gelu": (4096, 768, 3072, "gelu"),
    "llama_gate_silu": (4096, 2048, 5632, "silu"),
    "vit_proj_residual": (6304, 768, 768, "residual"),
    "decode_4096": (64, 4096, 4096, "none"),
    "odd_1000": (1000, 1000, 1000, "relu"),
    "gpt2_mlp_up_cast_weight": (8192, 768, 3072, "cast_weight,gelu_tanh"),
    "llama_gate_cast_weight": (4096, 2048, 5632, "cast_weight,silu"),
    "vit_qkv_scale_input": (6304, 768, 2304, "scale_input,none"),
}
# the tiny CPU models' layers (2 x 32 tokens, width 64), one in the middle and one past the C++
# rule's 2^21 multiply-adds (a library call by default)
CPU_SHAPES = {
    "tiny_qkv": (64, 64, 192, "none"),
    "tiny_attn_out_residual": (64, 64, 64, "residual"),
    "tiny_ffn_up_gelu": (64, 64, 256, "gelu"),
    "tiny_ffn_down_residual": (64, 256, 64, "residual"),
    "tiny_lm_head": (64, 64, 503, "none"),
    "mid_relu": (256, 256, 256, "relu"),
    "gpt2_small_rows_gelu": (32, 768, 3072, "gelu_tanh"),
}


def make(m, k, n, what, dtype, device="cuda"):
    prologue, _, epilogue = what.rpartition(",")
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=torch.float32 if prologue == "cast_weight" else dtype) / k**0.5
    b = torch.randn(n, device=device, dtype=dtype)
    r = torch.randn(m, n, device=device, dtype=dtype)

    def fn(x, w, b, r):
        if prologue == "cast_weight":
            w = w.to(dtype)
        if prologue == "scale_input":
            x = x * 0.5
        y = F.linear(x, w, b)
        if epilogue == "gelu_tanh":
            return F.gelu(y, approximate="tanh")
        if epilogue == "gelu":
            return F.gelu(y)
        if epilogue == "silu":
            return F.silu(y)
        if epilogue == "relu":
            return torch.relu(y)
        if epilogue == "residual":
            return y + r
        return y

    return fn, (x, w, b, r)


def cpu_ms(fn, args, reps):
    fn(*args)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        rounds.append((time.perf_counter() - start) * 1e3 / reps)
    return statistics.median(rounds)


def cuda_ms(fn, args, reps):
    fn(*args)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn(*args)
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / reps)
    return statistics.median(rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--only", default="")
    ap.add_argument("--inductor-autotune", action="store_true", help="also Inductor in max-autotune-no-cudagraphs")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--threads", type=int, default=1, help="CPU threads")
    opts = ap.parse_args()
    cpu = opts.device == "cpu"
    if cpu:
        torch.set_num_threads(opts.threads)
    variants = {
        "ferrocore library": dict(backend="ferrocore", options={"gemm_template": "never"}),
        # (max-autotune's kernel tuning; torch.compile takes a mode or options, not both)
        "ferrocore template": dict(backend="ferrocore", options={"gemm_template": "always", "autotune": not cpu}),
        "inductor": dict(backend="inductor"),
    }
    if opts.inductor_autotune:
        variants["inductor max-autotune"] = dict(backend="inductor", mode="max-autotune-no-cudagraphs")
    shapes = CPU_SHAPES if cpu else SHAPES
    timer = cpu_ms if cpu else cuda_ms
    names = [n for n in shapes if not opts.only or n in opts.only.split(",")]
    print("| shape | M x K x N | eager ms | " + " | ".join(f"{v} ms" for v in variants) + " | template / library |")
    print("|---" * (4 + len(variants)) + "|")
    for name in names:
        m, k, n, epilogue = shapes[name]
        fn, args = make(m, k, n, epilogue, torch.float32 if cpu else torch.bfloat16, opts.device)
        expected = fn(*args)
        row = [f"{timer(fn, args, opts.reps):.4f}"]
        times = {}
        for label, kw in variants.items():
            torch._dynamo.reset()
            try:
                compiled = torch.compile(lambda *a, f=fn: f(*a), dynamic=False, **kw)
                got = compiled(*args)
                err = (got.float() - expected.float()).abs().max().item()
                scale = expected.float().abs().max().item()
                times[label] = timer(compiled, args, opts.reps)
                row.append(f"{times[label]:.4f}" + ("" if err <= 0.05 * max(scale, 1) else f" (err {err:.3g})"))
            except Exception as e:  # noqa: BLE001  (a failure is a result)
                row.append(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        lib, tpl = times.get("ferrocore library"), times.get("ferrocore template")
        ratio = f"{tpl / lib:.2f}" if lib and tpl else "n/a"
        print(f"| {name} | {m} x {k} x {n} | " + " | ".join(row) + f" | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
