#!/usr/bin/env bash
# Steady-state steps under each configuration (bench/steady.py), each in a
# fresh process, the configurations interleaved, REPEATS rounds:
#   bash bench/steady.sh OUTDIR [REPEATS] [WORKLOAD] [BATCH RES_OR_SEQ] [CONFIGS...]
# A configuration may carry a GOALLOC_CONF after a plus: goalloc-vmm+large_cache:4G.
# NEW_SHAPES=N adds N steps of new shapes to each run (steady.py --new-shapes).
# GOALLOC_LIBRARY names the library to test (build/libgoalloc.so by default).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?outdir}; reps=${2:-3}; workload=${3:-resnet50}; b=${4:-48}; r=${5:-192}
shift $(( $# < 5 ? $# : 5 ))
configs=${*:-native goalloc goalloc-vmm async expandable c-floor}
mkdir -p "$out" build
export GOALLOC_LIBRARY=${GOALLOC_LIBRARY:-$PWD/build/libgoalloc.so} PYTHONPATH=$PWD/python
export GOALLOC_CXX_CACHE=${GOALLOC_CXX_CACHE:-$HOME/.cache/goalloc}
gcc -O2 -shared -fPIC -o build/libcfloor.so bench/cfloor.c -ldl -lpthread && export BENCH_CFLOOR_LIB=$PWD/build/libcfloor.so
for rep in $(seq 0 $((reps - 1))); do
  for cc in $configs; do
    c=${cc%%+*}
    env_extra=()
    [[ $cc == *+* ]] && env_extra=(GOALLOC_CONF=${cc#*+})
    case $c in
      expandable) env_extra=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
      async) env_extra=(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) ;;
    esac
    f=$out/$workload-${cc//[:+]/_}-r$rep
    env "${env_extra[@]}" timeout 300 python3 bench/steady.py --workload "$workload" --config "$c" \
      --shape "$b" "$r" --new-shapes "${NEW_SHAPES:-0}" --out "$f.json" 2>"$f.err" || tail -5 "$f.err"
  done
done
python3 - "$out" "$workload" <<'PY'
import json, glob, statistics, sys, collections
out, wl = sys.argv[1], sys.argv[2]
by = collections.defaultdict(list)
for f in sorted(glob.glob(f"{out}/{wl}-*-r*.json")):
    d = json.load(open(f)); by[d["config"] + ("+" + d["goalloc_conf"] if d["goalloc_conf"] else "")].append(d)
base = statistics.median(d["median_wall_ms"] for d in by.get("native", [])) if by.get("native") else None
for c, ds in by.items():
    w = statistics.median(d["median_wall_ms"] for d in ds)
    e = statistics.median(d["median_enqueue_ms"] for d in ds)
    k = [d["profile"]["kernel_ms_per_step"] for d in ds if "profile" in d]
    print(f"{c:12s} n={len(ds)} wall {w:6.2f} ms ({(base / w if base else 0):.3f}x native thr)  enqueue {e:6.2f} ms  "
          f"allocs {ds[0]['median_allocs']}  kernels {statistics.median(k) if k else 0:.2f} ms")
    ns = [d["new_shapes"]["median_wall_ms"] for d in ds if "new_shapes" in d]
    if ns:
        print(f"{'':12s} new shapes: median step {statistics.median(ns):7.2f} ms")
PY
