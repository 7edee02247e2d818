#!/usr/bin/env bash
# Builds ferrocore (see setup.sh), then checks the Rust code's format and lints, runs the Rust
# tests (the replay corpus among them) and the Python tests, whole files on one worker per core.
# Extra arguments go to pytest.
#   bash scripts/test.sh --quick   the quick subset (QUICK_TESTS below, under 5 minutes with the
#                                  Rust tests): for a change to one thing
set -euo pipefail
# One file per stage that runs in seconds (front and options, errors, input checks, the graph
# exchange, pointwise and view lowering through C++ kernels, input writes, the compiled-graph
# cache; the Triton code generator's golden texts are among the Rust tests): 2.7 minutes of pytest
# on 2 cores with an empty kernel cache.
QUICK_TESTS=(tests/test_front.py tests/test_errors.py tests/test_input_checks.py tests/test_serialize.py
             tests/test_e2e_pointwise.py tests/test_e2e_views.py tests/test_input_writes.py tests/test_graph_cache.py)
TESTS=(tests)
if [ "${1:-}" = "--quick" ]; then
    shift
    TESTS=("${QUICK_TESTS[@]}")
fi
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
# the Rust code is rustfmt-formatted (rustfmt.toml) and clippy-clean, checked before it is tested
cargo fmt --all --check
cargo clippy --workspace --all-targets --release --quiet -- -D warnings
cargo test --workspace --release

# One worker per core (FERROCORE_TEST_WORKERS, default 2: CI's cores), each taking whole files:
# a file's tests run in order in one process, and the kernel cache is shared (safe between
# processes). FERROCORE_TEST_WORKERS=0 runs everything in this process.
WORKERS="${FERROCORE_TEST_WORKERS:-2}"
if [ "$WORKERS" = 0 ]; then
    .venv/bin/python -m pytest "${TESTS[@]}" "$@"
else
    .venv/bin/python -m pytest -n "$WORKERS" --dist loadfile "${TESTS[@]}" "$@"
fi
