#!/usr/bin/env bash
# The GPU check in one command, for a CUDA machine that has torch and Triton but no network and
# no Rust toolchain: installs the ferrocore wheel built elsewhere (`maturin build --release -o
# .wheels`) and any carried test wheels (.whl: pytest, expecttest) into a private directory, runs
# the test suite on CUDA tensors (FERROCORE_TEST_DEVICE=cuda: ferrocore's Triton backend), then
# the GPU benchmark, and ends with the benchmark's table.
#
#   bash bench/gpu.sh                     # tests, then the full benchmark
#   GPU_TESTS="tests/test_e2e_models.py" GPU_BENCH_ARGS="--quick" bash bench/gpu.sh
#
# Environment: WHEELS (default .wheels), TEST_WHEELS (default .whl), GPU_TESTS (pytest targets;
# default: the whole suite), GPU_TEST_JOBS (pytest processes over the test files, default 4),
# GPU_TEST_TIMEOUT (seconds, default 420), GPU_BENCH_ARGS, GPU_BENCH_MODES (default "default
# reduce-overhead"; empty: no benchmark; GPU_TESTS="" runs no tests), OUT (logs; default
# /tmp/ferrocore-gpu). bench/gpu_models.sh runs the model benchmark the same way.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/ferrocore-gpu}"
# shellcheck source=bench/gpu_env.sh
source "$REPO/bench/gpu_env.sh" || exit 2
export FERROCORE_CACHE_DIR=/tmp/ferrocore-cache-gpu-tests

# Tests: the files spread over GPU_TEST_JOBS pytest processes (one GPU is plenty for them).
if [ "${GPU_TESTS-unset}" = "unset" ]; then
    mapfile -t files < <(ls tests/test_*.py)
else
    read -r -a files <<< "$GPU_TESTS"
fi
jobs="${GPU_TEST_JOBS:-4}"
status=0
pids=()
# the Triton interpreter cases take as long as all the rest: a process of their own
slow=()
rest=()
for f in "${files[@]}"; do
    if [[ "$f" == *test_triton_backend.py ]]; then slow+=("$f"); else rest+=("$f"); fi
done
if [ "${#slow[@]}" -gt 0 ] && [ "$jobs" -gt 1 ]; then
    FERROCORE_TEST_DEVICE=cuda timeout "${GPU_TEST_TIMEOUT:-420}" "$PY" -m pytest -q -p no:cacheprovider \
        -p no:logging "${slow[@]}" > "$OUT/tests_slow.log" 2>&1 &
    pids+=($!)
    files=("${rest[@]}")
    jobs=$((jobs - 1))
fi
if [ "${#files[@]}" -gt 0 ]; then
    for ((j = 0; j < jobs; j++)); do
        part=()
        for ((i = j; i < ${#files[@]}; i += jobs)); do part+=("${files[$i]}"); done
        [ "${#part[@]}" -eq 0 ] && continue
        FERROCORE_TEST_DEVICE=cuda timeout "${GPU_TEST_TIMEOUT:-420}" "$PY" -m pytest -q -p no:cacheprovider \
            -p no:logging "${part[@]}" > "$OUT/tests_$j.log" 2>&1 &
        pids+=($!)
    done
fi
if [ "${#pids[@]}" -gt 0 ]; then
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    echo "## CUDA tests"
    for f in "$OUT"/tests_*.log; do
        grep -E "^(FAILED|ERROR) " "$f" | cut -c1-220
        tail -n 1 "$f"
    done
fi

# The benchmark once per torch.compile mode (both compilers in the same mode); GPU_BENCH_MODES
# is a space-separated list, "default" meaning no mode argument.
for mode in ${GPU_BENCH_MODES-default reduce-overhead}; do
    margs=()
    [ "$mode" != default ] && margs=(--mode "$mode")
    echo "## GPU benchmark (mode: $mode)"
    # shellcheck disable=SC2086
    "$PY" bench/gpu_benchmark.py "${margs[@]}" ${GPU_BENCH_ARGS:-} 2>&1 | grep -v '^\[ferrocore' \
        | tee "$OUT/bench_$mode.log" | tail -n 40
done
exit "$status"
