#!/usr/bin/env bash
# Idempotent setup: a .venv with torch, numpy, pytest, expecttest, maturin and tlparse, the model
# benchmark's development dependencies (transformers, torchvision: bench/model_zoo.py builds its
# models from their configs), and ferrocore built in release mode and installed into it
# (editable: python/ changes apply without rebuilding).
# The network is needed only for what is missing: PyPI packages and crates.io.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
export VIRTUAL_ENV="$REPO/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"

# pip honours PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, e.g. for CPU-only torch wheels.
if ! python -c "import torch, numpy, pytest, expecttest, transformers, torchvision" 2>/dev/null \
        || [ ! -x .venv/bin/maturin ] || [ ! -x .venv/bin/tlparse ]; then
    # expecttest: torch's OpInfo db; torchvision is resolved together with torch (matching builds);
    # tlparse: reads TORCH_TRACE logs (a test checks ferrocore's entries in them)
    python -m pip install torch torchvision numpy pytest maturin expecttest transformers tlparse
fi

# cargo's incremental build makes a rerun cheap.
maturin develop --release
