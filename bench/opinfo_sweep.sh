#!/usr/bin/env bash
# The full OpInfo conformance sweep (tests/test_opinfo.py::test_opinfo_full_sweep): every
# core-relevant OpInfo x {float32, float16, bfloat16, int64, bool} it supports on CPU x every
# sample; writes REPORT.json / REPORT.md and prints the totals. Report only: the exit status is
# non-zero only if the pass rate is below OPINFO_MIN_PASS or the sweep could not run.
#
#   bash bench/opinfo_sweep.sh                       # everything (~51k samples: hours on 2 cores)
#   OPINFO_MAX_SAMPLES=3 bash bench/opinfo_sweep.sh  # the first 3 samples per op and dtype
#   OPINFO_OPS='nn.functional.*,sum' bash bench/opinfo_sweep.sh
#
# Environment: OPINFO_REPORT (path without suffix, default ./opinfo_report), OPINFO_MAX_SAMPLES,
# OPINFO_OPS (comma list; a trailing * matches a prefix), OPINFO_RANGE (A:B, pairs A..B-1 of the
# sweep's order: run ranges in parallel, then concatenate their REPORT.progress.jsonl files into
# one and run again with --opinfo-resume to write the merged report), OPINFO_MIN_PASS (fraction, default 0),
# FERROCORE_CACHE_DIR (default .ferrocore-cache-test, shared with scripts/test.sh).
# A sweep that dies (a crashing kernel) is resumed from REPORT.progress.jsonl: the pair it died
# in is recorded as errored ("crashed") and the sweep goes on, up to 20 times.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export FERROCORE_CACHE_DIR="${FERROCORE_CACHE_DIR:-$REPO/.ferrocore-cache-test}"
REPORT="${OPINFO_REPORT:-$PWD/opinfo_report}"
ARGS=(--opinfo-full --opinfo-report "$REPORT" --opinfo-min-pass "${OPINFO_MIN_PASS:-0}")
[ -n "${OPINFO_MAX_SAMPLES:-}" ] && ARGS+=(--opinfo-max-samples "$OPINFO_MAX_SAMPLES")
[ -n "${OPINFO_OPS:-}" ] && ARGS+=(--opinfo-ops "$OPINFO_OPS")
[ -n "${OPINFO_RANGE:-}" ] && ARGS+=(--opinfo-range "$OPINFO_RANGE")

rc=1
resume=()
for attempt in $(seq 1 20); do
    .venv/bin/python -m pytest -q -s -p no:logging \
        tests/test_opinfo.py::test_opinfo_full_sweep "${ARGS[@]}" "${resume[@]}" \
        2> >(grep -v '^\[ferrocore' >&2) | grep -E '^\[opinfo\] (totals|report)|passed|failed|error'
    rc=${PIPESTATUS[0]}
    # pytest exits 0/1 (pass rate met or not) after writing the report; anything else (a signal,
    # a crash) means the process died mid-sweep.
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 1 ]; then
        break
    fi
    echo "sweep died (exit $rc); resuming" >&2
    resume=(--opinfo-resume)
done
[ -f "$REPORT.md" ] && sed -n '1,12p' "$REPORT.md"
exit "$rc"
