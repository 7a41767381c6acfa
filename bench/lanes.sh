#!/usr/bin/env bash
# Suites on several GPUs of one host at once:
#
#   bash bench/lanes.sh OUTDIR 'SUITE ARGS [| SUITE ARGS ...]' ['SUITE ARGS [| ...]' ...]
#
# Lane i runs on GPU i, pinned (taskset) to the i-th equal slice of the CPUs:
# the steps are bound by the host, and suites sharing CPUs disturb each other.
# A lane's suites (between '|') run one after another with bench/run.sh into
# OUTDIR/laneI-J; the host's CPU and GPU layout goes to OUTDIR/topology.txt.
set -uo pipefail
[[ $# -ge 2 && $1 != -* ]] || { echo "usage: bash bench/lanes.sh OUTDIR 'SUITE ARGS [| SUITE ARGS ...]' ..." >&2; exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd) || exit 2
shift
cd "$(dirname "$0")/.."
ngpu=$(nvidia-smi -L | wc -l)
if (( $# > ngpu )); then
  echo "lanes.sh: $# lanes but $ngpu GPUs" >&2
  exit 2
fi
ncpu=$(nproc)
slice=$(( ncpu / $# ))
if (( slice < 1 )); then
  echo "lanes.sh: $# lanes but $ncpu CPUs" >&2
  exit 2
fi
{ lscpu; echo; nvidia-smi topo -m; } >"$OUT/topology.txt" 2>&1

run_lane() { # lane index, its suites separated by '|'
  local lane=$1 first=$(( $1 * slice )) j=0 spec
  local cpus="$first-$(( first + slice - 1 ))"
  IFS='|' read -ra specs <<<"$2"
  for spec in "${specs[@]}"; do
    echo "== lane $lane (GPU $lane, CPUs $cpus) suite $j:$spec"
    # shellcheck disable=SC2086  # a suite's arguments are words
    CUDA_VISIBLE_DEVICES=$lane taskset -c "$cpus" bash bench/run.sh "$OUT/lane$lane-$j" $spec
    echo "== lane $lane suite $j exit $?"
    j=$(( j + 1 ))
  done
}

pids=()
i=0
for lane in "$@"; do
  run_lane "$i" "$lane" >"$OUT/lane$i.log" 2>&1 &
  pids+=($!)
  i=$(( i + 1 ))
done
status=0
i=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
  grep -E '^== ' "$OUT/lane$i.log"
  i=$(( i + 1 ))
done
grep -h -E '^== lane .* exit [^0]' "$OUT"/lane*.log >/dev/null && status=1
exit $status
