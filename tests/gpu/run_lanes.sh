#!/usr/bin/env bash
# Several run_gpu.sh step lists at once, one per GPU, so that one call of the
# device tool covers more (each lane sees only its own GPU):
#   bash tests/gpu/run_lanes.sh "core graphs" "torture stats"   # lane 0 on GPU 0, lane 1 on GPU 1
# A lane's console goes to $OUT/laneN.log and its results to $OUT/laneN/;
# the exit status is 1 if any lane failed. Lanes that need two GPUs
# (multigpu) must run alone, with run_gpu.sh itself.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
ngpu=$(nvidia-smi -L | wc -l)
if (( $# > ngpu )); then
  echo "run_lanes: $# lanes but $ngpu GPUs" >&2
  exit 2
fi
pids=()
i=0
for steps in "$@"; do
  # shellcheck disable=SC2086  # a lane's steps are words
  CUDA_VISIBLE_DEVICES=$i OUT="$OUT/lane$i" bash tests/gpu/run_gpu.sh $steps > "$OUT/lane$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
status=0
i=0
for pid in "${pids[@]}"; do
  if wait "$pid"; then rc=0; else rc=$?; fi
  echo "== lane $i exit $rc"
  grep -E '^== |passed|failed|error|Error|FAIL' "$OUT/lane$i.log" | tail -40
  [[ $rc -eq 0 ]] || status=1
  i=$((i + 1))
done
exit $status
