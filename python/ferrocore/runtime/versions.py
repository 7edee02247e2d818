"""The versions of what compiled a cached artifact: part of the key of every cache entry that
holds compiled code (`graph_cache`, `kernel_binaries`), so that an upgrade is a miss."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess

import torch

from ..options import compiler_default
from . import triton_support


@functools.lru_cache(None)
def versions() -> tuple:
    """ferrocore (a hash of its package files and extension), torch, Triton, and the C++
    compiler's version line."""
    h = hashlib.sha256()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ferrocore, not the runtime
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".so", ".h")):
                with open(os.path.join(root, name), "rb") as f:
                    h.update(name.encode())
                    h.update(f.read())
    return h.hexdigest(), torch.__version__, triton_support.version(), _compiler_version()


def _compiler_version() -> str:
    cxx = os.environ.get("CXX") or compiler_default("cxx")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else f"{cxx}: no version"
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: {e}"
