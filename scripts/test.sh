#!/usr/bin/env bash
# Builds ferrocore (see setup.sh), then runs the Rust tests and the Python tests.
# Extra arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
cd "$REPO"

# One C++ cache for the whole run, so each kernel is compiled once.
export FERROCORE_CACHE_DIR="${FERROCORE_CACHE_DIR:-$REPO/.ferrocore-cache-test}"
# ferrocore refuses a cache directory others may write into (one made by an older run under
# umask 002, say): the test cache is the checkout's own, so make it private.
mkdir -p "$FERROCORE_CACHE_DIR" && chmod 700 "$FERROCORE_CACHE_DIR"

# The PyO3 crate's test binary links libpython: build against the venv's interpreter and let
# the binary find the shared library at run time.
export PYO3_PYTHON="$REPO/.venv/bin/python"
PY_LIBDIR="$("$PYO3_PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
export LD_LIBRARY_PATH="$PY_LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo test --workspace --release

.venv/bin/python -m pytest -q tests "$@"
