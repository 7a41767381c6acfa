#!/usr/bin/env bash
# The goalloc GPU benchmark suite, in one call on the GPU machine, from the
# repository root:
#
#   bash bench/run.sh OUTDIR [bench/suite.py options]    e.g. --quick, --repeats 3, --budget 480
#
# Needs build/libgoalloc.so (`make lib` where Go is; build/ travels with the
# call), python3 with torch, transformers and torchvision. Leaves four files in OUTDIR: bench.json (everything),
# BENCHMARKS.md (bench/render.py's tables and goals), console.log, and
# results.tar.gz (one JSON file per run). The suite keeps to its --budget
# (default 480 s); BENCH_HARD_LIMIT_S (default 525) stops it outright, and it
# still writes what it finished.
set -uo pipefail
[[ $# -ge 1 && $1 != -* ]] || { echo "usage: bash bench/run.sh OUTDIR [bench/suite.py options]" >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd) || exit 2
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HARD=${BENCH_HARD_LIMIT_S:-525}
LOG=$OUT/console.log
export PYTHONUNBUFFERED=1
: >"$LOG"
[[ -e build/libgoalloc.so ]] || echo "run.sh: build/libgoalloc.so is missing: goalloc's runs will fail ('make lib' where Go is)" | tee -a "$LOG"

timeout --signal=TERM --kill-after=15 "$HARD" \
  "$PY" bench/suite.py "$OUT" --command "bash bench/run.sh OUTDIR${*:+ $*}" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}

# One file instead of one per run, then the tables.
if [[ -d $OUT/results ]]; then
  tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
fi
if [[ -f $OUT/bench.json ]]; then
  "$PY" bench/render.py "$OUT/bench.json" --output "$OUT/BENCHMARKS.md" 2>&1 | tee -a "$LOG"
  cat "$OUT/BENCHMARKS.md"
fi
echo "run.sh: suite exit status $status" | tee -a "$LOG"
exit "$status"
