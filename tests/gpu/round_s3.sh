#!/usr/bin/env bash
# One device call of two GPUs (this round's last): the ResNet-50 benchmark
# suite on GPU 0 while GPU 1 runs the VMM, core, stats and graphs checks;
# then the two-GPU checks, then the driver-call profile. Everything lands in
# $OUT/s3.tgz (the device tool brings back at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/s3
mkdir -p "$R"
pack() { (cd "$OUT" && tar czf s3.tgz s3 && rm -rf s3); }
trap pack EXIT
CUDA_VISIBLE_DEVICES=0 timeout 300 bash bench/run.sh "$R/resnet50" --workloads resnet50 --budget 280 > "$R/resnet50.log" 2>&1 &
bench=$!
CUDA_VISIBLE_DEVICES=1 OUT=$R/checks timeout 300 bash tests/gpu/run_gpu.sh vmm core stats graphs > "$R/checks.log" 2>&1 &
checks=$!
wait $bench; echo "resnet50 suite exit $?"
wait $checks; echo "checks exit $?"
grep -E '^== |passed|failed|FAIL|--- ' "$R/checks.log" | tail -30
grep -E '^\| (native|expandable|async|goalloc)|throughput|peak memory' "$R/resnet50/BENCHMARKS.md" | head -20
OUT=$R/two timeout 150 bash tests/gpu/run_gpu.sh multigpu > "$R/two.log" 2>&1; echo "multigpu exit $?"
grep -E '^== |passed|failed|FAIL' "$R/two.log" | tail -8
OUT=$R/profile timeout 100 bash tests/gpu/profile_vmm.sh backend:vmm,vmm_handle:2M
