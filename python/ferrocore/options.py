"""The options JSON handed to Rust, built from the environment at each compile.

Env is read per call, not at import, so a test or notebook can change `FERROCORE_LOGS` between
compiles. `torch.compile(..., options={...})` overrides individual keys; unknown keys are ignored.
"""

from __future__ import annotations

import json
import os
import warnings

LOG_CHANNELS = (
    "graph",
    "ir_pre_fusion",
    "ir_post_fusion",
    "fusion",
    "output_code",
    "fallback",
)
_KEYS = ("cache_dir", "logs", "debug_dir", "cxx", "backend", "cudagraphs", "autotune")
# Kernel backends: "auto" picks by the graph's device (CUDA -> Triton, CPU -> C++); "triton" on
# CPU tensors runs the Triton kernels under Triton's interpreter (set TRITON_INTERPRET=1).
BACKENDS = ("auto", "cpp", "triton")


def build_options(overrides: dict | None = None) -> dict:
    debug_dir = os.environ.get("FERROCORE_DEBUG_DIR") or None
    opts = {
        "cache_dir": _abspath(os.environ.get("FERROCORE_CACHE_DIR") or "~/.cache/ferrocore"),
        "logs": parse_logs(os.environ.get("FERROCORE_LOGS", "")),
        "debug_dir": _abspath(debug_dir) if debug_dir else None,
        "cxx": os.environ.get("CXX") or "g++",
        "backend": (os.environ.get("FERROCORE_BACKEND") or "auto").strip().lower(),
        # CUDA graphs for GPU inference graphs (mode="reduce-overhead"); read by the front only
        "cudagraphs": _flag(os.environ.get("FERROCORE_CUDAGRAPHS", "")),
        # time each Triton kernel's candidate configurations (mode="max-autotune"); front only
        "autotune": _flag(os.environ.get("FERROCORE_AUTOTUNE", "")),
    }
    for key, value in (overrides or {}).items():
        if key in _KEYS:
            opts[key] = parse_logs(value) if key == "logs" and isinstance(value, str) else value
    if opts["backend"] not in BACKENDS:
        raise ValueError(f"ferrocore backend {opts['backend']!r}: expected one of {BACKENDS}")
    return opts


def options_json(overrides: dict | None = None) -> str:
    return json.dumps(build_options(overrides))


def parse_logs(spec: str) -> list:
    """`"graph, output_code"` -> `["graph", "output_code"]`; `all` names every channel."""
    logs = []
    for name in spec.split(","):
        name = name.strip().lower().lstrip("+")  # TORCH_LOGS habit: "+name" means verbose
        if not name:
            continue
        if name == "all":
            return list(LOG_CHANNELS)
        if name not in LOG_CHANNELS:
            warnings.warn(f"FERROCORE_LOGS: unknown channel {name!r}; known: {LOG_CHANNELS}")
            continue
        if name not in logs:
            logs.append(name)
    return logs


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _abspath(path: str) -> str:
    # Rust may run the compiler from another cwd; hand it absolute paths.
    return os.path.abspath(os.path.expanduser(path))
