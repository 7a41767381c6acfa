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
python3 bench/steady.py --summary "$out"
