#!/usr/bin/env bash
# Two builds of the library in training on one GPU, side by side: how long
# goalloc spends in Go per step (the call clock, csrc/goalloc_clock.h) and
# how long its steps take, for build A and build B, with native beside them.
#
#   bash bench/clock_ab.sh [--together] OUTDIR LIB_A LIB_B ROUNDS [bench/suite.py options]
#   e.g. bash bench/clock_ab.sh OUT build/base/libgoalloc.so build/libgoalloc.so 5 \
#            --workloads resnet50 --resnet-plan-shapes --train-configs native,goalloc-vmm
#
# Round i runs one suite per build (bench/run.sh OUTDIR/a-i and OUTDIR/b-i,
# --repeats 1 --first-repeat i --call-clock on), A first on even rounds and
# B first on odd ones, each in fresh processes. Both suites of a round train
# the same shapes (with --resnet-plan-shapes or --llama-plan-shapes, the
# repeat picks them), so their steps compare one to one. Then
# bench/call_clock.py prints each side's figures, bench/step_stats.py each
# side's steps against native, and call_clock.py --ab the rounds' pairs.
# Give each suite a --budget that fits: ROUNDS x 2 suites must fit the call
# (BENCH_HARD_LIMIT_S bounds each suite).
#
# --together runs a round's two suites at the same time instead, each
# pinned to its own half of the CPUs (the halves swapped every round), on
# GPUs 0 and 1 where there are two (swapped too), else both on the one GPU:
# what the host does meanwhile then weighs on both sides of each pair,
# where one after the other it moved a step's time by up to 2x between
# runs. Sharing one GPU slows both sides alike.
set -uo pipefail
together=0
if [[ ${1:-} == --together ]]; then
  together=1
  shift
fi
if [[ $# -lt 4 || $1 == -* ]]; then
  echo "usage: bash bench/clock_ab.sh [--together] OUTDIR LIB_A LIB_B ROUNDS [bench/suite.py options]" >&2
  exit 2
fi
out=$1 liba=$2 libb=$3 rounds=$4
shift 4
for lib in "$liba" "$libb"; do
  [[ -f $lib ]] || { echo "clock_ab.sh: no library at $lib" >&2; exit 2; }
done
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "clock_ab.sh: ROUNDS must be a positive number, not $rounds" >&2; exit 2; }
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
liba=$(cd "$(dirname "$liba")" && pwd)/$(basename "$liba")
libb=$(cd "$(dirname "$libb")" && pwd)/$(basename "$libb")
cd "$(dirname "$0")/.."
status=0
suite() { # side, library, round, then the suite's options
  echo "== round $3, side $1 ($2) $(date +%T)"
  bash bench/run.sh "$out/$1-$3" --goalloc-library "$2" --repeats 1 --first-repeat "$3" --call-clock on "${@:4}" \
    >"$out/$1-$3.log" 2>&1 || status=1
  tail -1 "$out/$1-$3.log"
}
ncpu=$(nproc)
half=$(( ncpu / 2 ))
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
pinned() { # side, library, round, CPUs, GPU, then the suite's options
  echo "== round $3, side $1 ($2; CPUs $4, GPU $5) $(date +%T)"
  CUDA_VISIBLE_DEVICES=$5 taskset -c "$4" bash bench/run.sh "$out/$1-$3" --goalloc-library "$2" --repeats 1 \
    --first-repeat "$3" --call-clock on "${@:6}" >"$out/$1-$3.log" 2>&1
}
for ((i = 0; i < rounds; i++)); do
  if ((together)); then
    if ((half < 1)); then
      echo "clock_ab.sh: --together needs two CPUs" >&2
      exit 2
    fi
    lo="0-$(( half - 1 ))" hi="$half-$(( ncpu - 1 ))" ga=${CUDA_VISIBLE_DEVICES:-0} gb=$ga
    if ((ngpu >= 2)); then ga=0 gb=1; fi
    if ((i % 2 == 1)); then
      t=$lo lo=$hi hi=$t
      t=$ga ga=$gb gb=$t
    fi
    pinned a "$liba" "$i" "$lo" "$ga" "$@" &
    pa=$!
    pinned b "$libb" "$i" "$hi" "$gb" "$@" &
    pb=$!
    wait "$pa" || status=1
    wait "$pb" || status=1
    tail -qn1 "$out/a-$i.log" "$out/b-$i.log"
  elif ((i % 2 == 0)); then
    suite a "$liba" "$i" "$@"
    suite b "$libb" "$i" "$@"
  else
    suite b "$libb" "$i" "$@"
    suite a "$liba" "$i" "$@"
  fi
done
for side in a b; do
  lib=$liba
  [[ $side == b ]] && lib=$libb
  echo "== side $side: $lib"
  python3 bench/call_clock.py "$out/$side"-*/bench.json --slow-ns 1024 || status=1
  python3 bench/step_stats.py "$out/$side"-*/bench.json || status=1
done
python3 bench/call_clock.py --ab "$out" || status=1
exit "$status"
