#!/usr/bin/env bash
# Where the VMM backend's time goes on a GPU (run on the GPU machine, build/
# carried): the bundled traces replayed with each backend, and one training
# run of each workload under goalloc-vmm; every result carries the device's
# driver-call profile (count and ns per driver function). Two GPUs: the
# replays on GPU 0, the training runs on GPU 1.
#   OUT=dir bash tests/gpu/profile_vmm.sh [CONF ...]   # extra vmm confs to replay
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python GOALLOC_LIBRARY=$PWD/build/libgoalloc.so PYTHONUNBUFFERED=1
(
  export CUDA_VISIBLE_DEVICES=0
  for t in gpt2 resnet50; do
    i=0
    for conf in backend:async backend:vmm "$@"; do
      timeout 120 build/goalloc replay traces/$t-train.jsonl.gz --device cuda --conf "$conf" --json \
        > "$OUT/replay-$t-$i.json" || echo "replay $t $conf failed"
      i=$((i + 1))
    done
  done
) > "$OUT/replays.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=${PROFILE_TRAIN_GPU:-1}
  for w in llama gpt2 resnet50; do
    timeout 150 python3 bench/workloads.py --workload $w --config goalloc-vmm --repeat 2 --steps 27 --warmup 3 \
      --out "$OUT/train-$w-vmm.json" || echo "train $w failed"
  done
) > "$OUT/train.log" 2>&1 &
wait
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
for name in sorted(os.listdir(out)):
    if not name.endswith(".json"):
        continue
    d = json.load(open(os.path.join(out, name)))
    if name.startswith("replay"):
        calls, what = d.get("driver_calls") or [], f"{d.get('conf')} ratio {d.get('ratio', 0):.4f} {d.get('ns_per_op', 0):.0f} ns/event"
    else:
        st = (d.get("result") or {}).get("allocator", {}).get("stats", {})
        calls = [{"name": k.split(".")[2], "count": v, "ns": st.get(k[:-6] + ".ns", 0)}
                 for k, v in st.items() if k.startswith("goalloc.driver.") and k.endswith(".count")]
        r = d.get("result") or {}
        what = f"timed {r.get('timed_seconds', 0):.2f}s misses {st.get('goalloc.cache_misses')}"
    total = sum(c["ns"] for c in calls) / 1e6
    print(f"{name}: {what}; driver {total:.1f} ms:",
          ", ".join(f"{c['name']} {c['count']}x {c['ns'] / 1e6:.1f}ms" for c in sorted(calls, key=lambda c: -c["ns"])))
PY
