#!/usr/bin/env bash
# Correctness on a GPU in one command (a CUDA machine with torch and Triton, no network, no Rust):
# installs the wheel built elsewhere (`maturin build --release -o .wheels`, see gpu_env.sh), runs
# the given test files on CUDA tensors, the accuracy of long reductions and scans against float64
# (bench/accuracy.py), and the differential fuzzer (backend auto: Triton kernels for the GPU graphs,
# C++ for a segment left on the CPU); prints the tables last.
#
#   bash bench/gpu_correctness.sh
#   FUZZ_COUNT=2000 FUZZ_START=0 GPU_TESTS="tests/test_models.py" bash bench/gpu_correctness.sh
#
# Environment: GPU_TESTS (pytest targets; empty: none), GPU_TEST_TIMEOUT (s, default 400),
# ACCURACY_SIZES (default 1e5,1e6,1e7,1e8; empty: skipped), FUZZ_COUNT (default 1000; 0: skipped),
# FUZZ_SEED, FUZZ_START, FUZZ_JOBS (default 8), FUZZ_BUDGET (s after which no new batch starts;
# default none), FUZZ_MAX_CHECKS (minimizer runs per failure, default 150), FUZZ_TIMEOUT (s,
# default 480), OUT (default /tmp/ferrocore-gpu).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/ferrocore-gpu}"
# shellcheck source=bench/gpu_env.sh
source "$REPO/bench/gpu_env.sh" || exit 2
export FERROCORE_CACHE_DIR=/tmp/ferrocore-cache-gpu-correctness
status=0

tests="${GPU_TESTS-tests/test_accumulation.py tests/test_e2e_edge_cases.py tests/test_e2e_reductions.py tests/test_input_aliasing.py}"
if [ -n "$tests" ]; then
    # shellcheck disable=SC2086
    FERROCORE_TEST_DEVICE=cuda timeout "${GPU_TEST_TIMEOUT:-400}" "$PY" -m pytest -q -p no:cacheprovider -p no:logging \
        $tests > "$OUT/tests.log" 2>&1 || status=1
fi
if [ -n "${ACCURACY_SIZES-1e5,1e6,1e7,1e8}" ]; then
    timeout 600 "$PY" bench/accuracy.py --device cuda --sizes "${ACCURACY_SIZES-1e5,1e6,1e7,1e8}" --seeds 2 \
        > "$OUT/accuracy.md" 2> "$OUT/accuracy.log" || status=1
fi
if [ "${FUZZ_COUNT:-1000}" -gt 0 ]; then
    # each fuzz worker compiles its own kernels: two compile processes apiece on 16 CPUs
    FERROCORE_COMPILE_WORKERS="${FERROCORE_COMPILE_WORKERS:-2}" timeout "${FUZZ_TIMEOUT:-480}" "$PY" bench/fuzz.py --backend auto --device cuda --seed "${FUZZ_SEED:-0}" \
        --start "${FUZZ_START:-0}" --count "${FUZZ_COUNT:-1000}" --jobs "${FUZZ_JOBS:-8}" --minimize-per-class 1 \
        --max-checks "${FUZZ_MAX_CHECKS:-150}" ${FUZZ_BUDGET:+--budget "$FUZZ_BUDGET"} \
        --report "$OUT/fuzz_cuda.md" > "$OUT/fuzz.log" 2>&1 || status=1
fi

if [ -n "$tests" ]; then
    echo "## CUDA tests"
    grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-240
    tail -n 1 "$OUT/tests.log"
fi
[ -s "$OUT/accuracy.md" ] && { echo "## Accuracy (CUDA)"; cat "$OUT/accuracy.md"; }
if [ -s "$OUT/fuzz_cuda.md" ]; then
    echo "## Fuzz (Triton, CUDA)"
    sed -n '1,/^## Documented/p' "$OUT/fuzz_cuda.md" | head -40
    grep -E "^### " "$OUT/fuzz_cuda.md" | head -30
elif [ "${FUZZ_COUNT:-1000}" -gt 0 ]; then
    echo "## Fuzz (Triton, CUDA): no report"; tail -n 20 "$OUT/fuzz.log"
fi
exit "$status"
