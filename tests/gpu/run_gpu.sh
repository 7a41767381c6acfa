#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call:
#   device run: bash tests/gpu/run_gpu.sh [probe|core|python|bench|all]
# The library is built here (no Go there) and travels in build/ (carry it).
# Results land in $OUT (the device tool brings them back) or ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export GOALLOC_LIBRARY=$PWD/build/libgoalloc.so GOALLOC_GPU_OUT=$OUT PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
status=0
if [[ $what == probe || $what == all ]]; then
  timeout 300 python3 tests/gpu/probe_pool.py > "$OUT/pool.json" || status=1
  python3 -c "import json;d=json.load(open('$OUT/pool.json'));print({k:(v['ratio'] if 'ratio' in v else '') for k,v in d.items() if k.startswith('replay')})"
fi
if [[ $what == core || $what == all ]]; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_core_torch.py 2>&1 | tail -15 || status=1
fi
exit $status
