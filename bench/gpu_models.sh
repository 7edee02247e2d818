#!/usr/bin/env bash
# The model benchmark on a CUDA machine without network or Rust (see bench/gpu.sh for the
# wheel): bench/models.py over groups of models, each group in a process of its own, the groups
# one after another (GPU_MODELS_JOBS=1, for timings) or several at once (compile-bound checks).
# Ends with each group's tables; logs and JSON under $OUT.
#
#   GPU_MODELS_GROUPS="gpt2,bert llama" GPU_MODELS_ARGS="--tasks inference" bash bench/gpu_models.sh
#
# Environment: GPU_MODELS_GROUPS (space-separated comma lists; default: every model, one group),
# GPU_MODELS_JOBS (default 1), GPU_MODELS_ARGS (extra bench/models.py arguments),
# GPU_MODELS_TIMEOUT (seconds per group, default 560), OUT (default /tmp/ferrocore-gpu),
# GPU_MODELS_CACHE (a compile-cache directory shared by the groups and kept: a first run with
# GPU_MODELS_JOBS=4 and "--reps 0" compiles and checks every model in parallel, a second one with
# GPU_MODELS_JOBS=1 times them on warm caches).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/ferrocore-gpu}"
# shellcheck source=bench/gpu_env.sh
source "$REPO/bench/gpu_env.sh" || exit 2
export PYTHONUNBUFFERED=1
read -r -a groups <<< "${GPU_MODELS_GROUPS:-all}"
jobs="${GPU_MODELS_JOBS:-1}"
status=0
pids=()
run_group() {
    local g="$1" i="$2" models=()
    [ "$g" != all ] && models=(--models "$g")
    [ -n "${GPU_MODELS_CACHE:-}" ] && models+=(--cache-dir "$GPU_MODELS_CACHE")
    # shellcheck disable=SC2086
    timeout "${GPU_MODELS_TIMEOUT:-560}" "$PY" bench/models.py --device cuda "${models[@]}" ${GPU_MODELS_ARGS:-} \
        --json "$OUT/models_${GPU_MODELS_TAG:-}$i.json" > "$OUT/models_${GPU_MODELS_TAG:-}$i.log" 2>&1
}
for i in "${!groups[@]}"; do
    run_group "${groups[$i]}" "$i" &
    pids+=($!)
    if [ "${#pids[@]}" -ge "$jobs" ]; then
        wait "${pids[0]}" || status=1
        pids=("${pids[@]:1}")
    fi
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for i in "${!groups[@]}"; do
    log="$OUT/models_${GPU_MODELS_TAG:-}$i.log"
    echo "## group $i: ${groups[$i]}"
    grep -E "FAILED|Error|error:" "$log" | grep -v "^\[" | sort | uniq -c | head -20
    grep -E "^  (inference|training)/" "$log" | cut -c1-300
    sed -n '/^### /,$p' "$log"
done
exit "$status"
