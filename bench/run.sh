#!/usr/bin/env bash
# The goalloc GPU benchmark suite, in one call on the GPU machine, from the
# repository root:
#
#   bash bench/run.sh OUTDIR [bench/suite.py options]    e.g. --quick, --repeats 3, --budget 480
#
# Needs build/libgoalloc.so and build/goalloc, built where Go is (`make lib
# tool`; there is no Go on the GPU machine, so build/ travels with the call),
# python3 with torch, transformers and torchvision, and gcc (for c-floor).
#
# Leaves in OUTDIR, four files (the device tool brings back at most eight):
#   bench.json       everything: environment, options, plan, every run's result
#   BENCHMARKS.md    the rendered tables and goals (bench/render.py)
#   console.log      this script's output
#   results.tar.gz   results/NAME.json, one file per run (raw: keep it under /results-raw/)
#
# What the repository keeps is one pruned file: bench/render.py OUTDIR/bench.json
# --keep bench/results/training.json (bench/README.md, "Keeping the results").
#
# Two at once, one per GPU: give each its own OUTDIR, CUDA_VISIBLE_DEVICES and
# --workloads, then render both: bench/render.py OUT0/bench.json OUT1/bench.json
# (bench/README.md, "Two GPUs at once, or several calls").
#
# The suite keeps to its --budget (default 480 s) by skipping runs that no
# longer fit; BENCH_HARD_LIMIT_S (default 525) stops it outright, and it
# still writes what it finished.
set -uo pipefail
if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: bash bench/run.sh OUTDIR [bench/suite.py options]" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HARD=${BENCH_HARD_LIMIT_S:-525}
LOG=$OUT/console.log
export PYTHONUNBUFFERED=1
: >"$LOG"
for f in build/libgoalloc.so build/goalloc; do
  [[ -e $f ]] || echo "run.sh: $f is missing: its runs will fail (build it with 'make lib tool' where Go is)" | tee -a "$LOG"
done

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
