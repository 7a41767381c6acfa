#!/usr/bin/env bash
# Two-GPU benchmark: DDP, FSDP and the model-parallel example under goalloc,
# native and expandable_segments, a fresh process (or torchrun job) per run,
# the order rotated by round. Appends a JSON line per rank (or model-parallel
# run) to OUT/multigpu.jsonl; bench/multigpu_render.py takes medians over rounds.
#
#   bash bench/multigpu.sh OUT FIRST_ROUND LAST_ROUND [STEPS]
#
# Needs two GPUs, build/libgoalloc.so, and the NCCL multicast switches below.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; first=${2:-0}; last=${3:-2}; steps=${4:-100}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GOALLOC_LIBRARY=${GOALLOC_LIBRARY:-$PWD/build/libgoalloc.so} PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
allocs=(goalloc native expandable)
status=0
for ((r = first; r <= last; r++)); do
  for w in ddp fsdp mp; do
    for ((i = 0; i < 3; i++)); do
      a=${allocs[(i + r) % 3]}
      tmp=$(mktemp)
      case $w in
        ddp)  timeout 300 torchrun --nproc_per_node=2 examples/ddp_train.py --allocator "$a" --steps "$steps" --json "$tmp" > /dev/null 2> "$tmp.err" ;;
        fsdp) timeout 300 torchrun --nproc_per_node=2 examples/ddp_train.py --allocator "$a" --fsdp --steps "$steps" --json "$tmp" > /dev/null 2> "$tmp.err" ;;
        mp)   timeout 300 python3 examples/model_parallel.py --allocator "$a" --steps "$steps" --json "$tmp" > /dev/null 2> "$tmp.err" ;;
      esac
      rc=$?
      if [[ $rc -ne 0 ]]; then
        echo "round $r $w $a failed ($rc):"; tail -5 "$tmp.err"; status=1
      fi
      python3 - "$tmp" "$r" "$w" >> "$out/multigpu.jsonl" <<'PY'
import json, sys
path, rnd, workload = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for line in open(path):
    d = json.loads(line)
    d.pop("losses", None)
    d.update(round=rnd, workload=workload)
    print(json.dumps(d))
PY
      echo "round $r $w $a done ($(date +%T))"
      rm -f "$tmp" "$tmp.err"
    done
  done
done
exit $status
