#!/usr/bin/env bash
# Idempotent setup: a .venv with torch, numpy, pytest, expecttest, maturin, tlparse and playwright
# (with Debian's Chromium, when run as root, announced; FERROCORE_SKIP_APT=1 skips it), the model
# benchmark's development dependencies (transformers, torchvision, timm: bench/model_zoo.py builds its
# models from their configs), and ferrocore built in release mode and installed into it
# (editable: python/ changes apply without rebuilding).
# The network is needed only for what is missing: PyPI, crates.io and Debian packages.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
export VIRTUAL_ENV="$REPO/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"

# torch comes from PyPI unless FERROCORE_TORCH_INDEX names another index: PyPI's Linux torch
# is the CUDA build (about 3 GB of nvidia-* wheels beside it, needed for the GPU tests and
# benchmarks); on a machine without a GPU, FERROCORE_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# installs PyTorch's CPU-only wheels of torch and torchvision (about 0.2 GB). The rest comes from PyPI.
if ! python -c "import torch, torchvision" 2>/dev/null && [ -n "${FERROCORE_TORCH_INDEX:-}" ]; then
    echo "setup: torch and torchvision from $FERROCORE_TORCH_INDEX"
    python -m pip install --index-url "$FERROCORE_TORCH_INDEX" torch torchvision
fi
if ! python -c "import torch, numpy, pytest, xdist, expecttest, transformers, torchvision, timm, playwright" 2>/dev/null \
        || [ ! -x .venv/bin/maturin ] || [ ! -x .venv/bin/tlparse ]; then
    # pytest-xdist: the test command runs test files on one worker per core; expecttest: torch's OpInfo db; torchvision is resolved together with torch (matching builds);
    # tlparse: reads TORCH_TRACE logs (a test checks ferrocore's entries in them); playwright
    # drives Chromium in the compile report's browser test (its own browser download is not used)
    python -m pip install torch torchvision numpy pytest pytest-xdist maturin expecttest transformers timm tlparse playwright
fi

# Debian's Chromium, for the compile report's browser test (tests/test_report.py): installed
# with apt-get where this runs as root, announced first; FERROCORE_SKIP_APT=1 skips it, and
# without it that test says it is skipped and why.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    if [ "${FERROCORE_SKIP_APT:-0}" = 1 ]; then
        echo "setup: FERROCORE_SKIP_APT=1: not installing Debian's chromium (the compile report's browser test will skip)"
    else
        echo "setup: installing Debian's chromium with apt-get for the compile report's browser test" \
             "(FERROCORE_SKIP_APT=1 skips it)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }
    fi
fi

# cargo's incremental build makes a rerun cheap.
maturin develop --release
