#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call:
#   device run: bash tests/gpu/run_gpu.sh [probe] [core] [graphs] [torture] [sanitizer] [python] [package] [stats] [replay] [snapshot] [bench]
#               [ddp] [multigpu] [mgbench] [coldab] [lockstep] [stress] [vmm] [sleep] [ipc] (these need naming; multigpu and mgbench need two GPUs)
# (no argument: all of them). The library and the replay tool are built
# here (no Go there) and travel in build/ (carry it). Results land in $OUT
# (the device tool brings them back) or ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export GOALLOC_LIBRARY=$PWD/build/libgoalloc.so GOALLOC_GPU_OUT=$OUT PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
what=" ${*:-probe core graphs torture sanitizer python package stats replay snapshot bench} "
want() { [[ $what == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
status=0
step() { echo "== $1 ($(date +%T))"; }
# goalloc.install() builds goalloc's C++ allocator class once per torch
# version and keeps it here: outside build/, which a call that carries build/
# replaces, so that the build lasts as long as the machine.
export GOALLOC_CXX_CACHE=${GOALLOC_CXX_CACHE:-$HOME/.cache/goalloc}
if want probe; then
  step probe
  timeout 300 python3 tests/gpu/probe_pool.py > "$OUT/pool.json" || status=1
fi
if want core; then
  step core
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_core_torch.py 2>&1 | tail -15 || status=1
fi
if want graphs; then
  step graphs
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_graphs.py 2>&1 | tail -15 || status=1
fi
# cxx, cxxcompile, cxxbench: goalloc's C++ allocator class (named only:
# bash tests/gpu/run_gpu.sh cxx cxxcompile cxxbench; each within 10 minutes).
if want cxx; then
  step cxx
  # Build the class first, so that a compiler error shows here in full.
  timeout 400 python3 -m goalloc._cxx --verbose > "$OUT/cxx-build.txt" 2>&1
  rc=$?
  tail -40 "$OUT/cxx-build.txt"
  echo "cxx build exit $rc"
  if [[ $rc -ne 0 ]]; then
    status=1
  else
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cxx_gpu.py -k "not compile" 2>&1 | tail -40 || status=1
  fi
  # The class alone against torch's headers and c10 (tests/c/cxx_class_test.cpp);
  # -o lib: the library came built in build/ (no Go here).
  timeout 300 make -o lib cxxtest TORCH="$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')" 2>&1 | tail -15
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if want cxxcompile; then
  step cxxcompile
  # torch.compile(mode="reduce-overhead") on the class (after cxx built it).
  timeout 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cxx_gpu.py -k compile 2>&1 | tail -40 || status=1
fi
if want cxxbench; then
  step cxxbench
  # native vs goalloc-cxx vs goalloc-pluggable, best of 3 (after cxx built it).
  timeout 500 python3 tests/gpu/bench_cxx.py --rounds 3 || status=1
fi
if want torture; then
  step torture
  timeout 900 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_torture.py 2>&1 | tail -15 || status=1
fi
if want sanitizer; then
  step sanitizer
  # memcheck on a short torture run; says so if the tool cannot run here.
  timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/torture_check.py --ops 2000 --max-log2 22 \
    > "$OUT/sanitizer.txt" 2>&1; echo "compute-sanitizer exit $?" | tee -a "$OUT/sanitizer.txt"
  tail -5 "$OUT/sanitizer.txt"
fi
if want python; then
  step python
  timeout 600 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_python_gpu.py 2>&1 | tail -15 || status=1
fi
if want package; then
  step package
  # Warnings from the autograd thread; the wheel from dist/ (python -m build
  # where Go is, carry dist/), skipped without one.
  timeout 600 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_package_gpu.py 2>&1 | tail -15 || status=1
fi
if want stats; then
  step stats
  # torch.cuda.memory_allocated() and family after install(): goalloc's figures, at most 2 us a call.
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_stats_gpu.py 2>&1 | grep -E "RESULT|passed|failed|Error" | tail -15 || status=1
fi
if want replay; then
  step replay
  # REPLAY_CONFS: extra GOALLOC_CONF strings to compare, separated by spaces.
  for t in gpt2 resnet50; do
    timeout 300 build/goalloc replay traces/$t-train.jsonl.gz --device cuda --policy passthrough --json \
      > "$OUT/replay-$t-passthrough.json" || status=1
    i=0
    for conf in "" ${REPLAY_CONFS:-}; do
      timeout 300 build/goalloc replay traces/$t-train.jsonl.gz --device cuda --policy goalloc --conf "$conf" --json \
        > "$OUT/replay-$t-goalloc-$i.json" || status=1
      i=$((i + 1))
    done
  done
fi
if want snapshot; then
  step snapshot
  # torch's _record_memory_history + _dump_snapshot of a small training run,
  # native and with goalloc, replayed by build/goalloc; the native pickle
  # stays in $OUT (native-snapshot.pickle, under 2 MB) to become a fixture.
  timeout 700 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_snapshot.py 2>&1 | tail -15 || status=1
  rm -f "$OUT/goalloc-snapshot.pickle"
fi
if want ddp; then
  step ddp
  # One GPU here: torchrun with one rank, goalloc and native at the same seed,
  # and FSDP with goalloc. NCCL multicast stays off (the device tool's rule).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for a in goalloc native; do
    timeout 200 torchrun --nproc_per_node=1 examples/ddp_train.py --allocator $a --json "$OUT/ddp.json" 2>&1 | tail -3 || status=1
  done
  timeout 200 torchrun --nproc_per_node=1 examples/ddp_train.py --allocator goalloc --fsdp --json "$OUT/ddp.json" 2>&1 | tail -3 || status=1
fi
if want multigpu; then
  step multigpu
  # Two GPUs: the arena's CUDA tests (build/arena.test, made by `make
  # gpubuild`: the two-device ones skip on one GPU), then peer access,
  # per-device behaviour and model parallelism.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [[ -x build/arena.test ]]; then
    (cd arena && timeout 300 ../build/arena.test -test.v -test.run 'CUDA' 2>&1 | grep -E '^(=== RUN|--- |PASS|FAIL|ok|\s+cuda_test)' | tail -40) || status=1
  else
    echo "build/arena.test missing: make gpubuild"; status=1
  fi
  timeout 600 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_multigpu.py 2>&1 | tail -15 || status=1
fi
if want mgbench; then
  step mgbench
  # MGBENCH_ROUNDS="FIRST LAST": which rounds of bench/multigpu.sh to run.
  timeout 580 bash bench/multigpu.sh "$OUT" ${MGBENCH_ROUNDS:-0 2} || status=1
fi
if want vmm; then
  step vmm
  # Named only (bash tests/gpu/run_gpu.sh vmm): the VMM backend (backend:vmm): arena's CUDA tests of the VMM device
  # (build/arena.test from `make gpubuild`; the peer test needs two GPUs),
  # then training, the cap and reserved-vs-device figures inside PyTorch,
  # against backend:async, and the bundled traces replayed with each
  # backend. About two minutes.
  if [[ -x build/arena.test ]]; then
    (cd arena && timeout 120 ../build/arena.test -test.v -test.run 'VMMCUDA|CUDAPoolCapped' 2>&1 | grep -E '^(=== RUN|--- |PASS|FAIL|ok|\s+(vmm_)?cuda_test)' | tail -30) || status=1
  else
    echo "build/arena.test missing: make gpubuild"; status=1
  fi
  timeout 300 python3 tests/gpu/vmm_check.py > "$OUT/vmm.json" || status=1
  tail -c 3000 "$OUT/vmm.json"
  # Replays: the ratio (peak reserved: for
  # vmm the physical memory held) and the time per event (driver calls).
  for t in gpt2 resnet50; do
    for b in async vmm; do
      timeout 120 build/goalloc replay traces/$t-train.jsonl.gz --device cuda --conf backend:$b --json \
        > "$OUT/replay-$t-backend-$b.json" || status=1
    done
  done
fi
if want sleep; then
  step sleep
  # Named only: memory tags, sleep and wake through the C++ class (with
  # torch.compile's reduce-overhead) and the pluggable path, then their
  # speed against a plain pinned copy (16 GiB offloaded, 32 GiB discarded).
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sleep_gpu.py 2>&1 | tail -30 || status=1
  timeout 160 python3 tests/gpu/bench_sleep.py --weights-gib 16 --kv-gib 32 --rounds 3 > "$OUT/bench_sleep.json" || status=1
  python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["summary"], indent=1))' "$OUT/bench_sleep.json"
  # The same with the host area pinned ahead (goalloc.prepare_sleep).
  timeout 120 python3 tests/gpu/bench_sleep.py --weights-gib 16 --kv-gib 32 --rounds 3 --prepare > "$OUT/bench_sleep_prepared.json" || status=1
  python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["summary"]["first"], indent=1))' "$OUT/bench_sleep_prepared.json"
fi
if want ipc; then
  step ipc
  # Named only: CUDA IPC through the C++ class (issue 35): spawned children
  # with goalloc and with PyTorch's allocator, both directions, 3 GiB, many
  # small tensors, a free while a receiver holds, the RL weight sync.
  # A crash's native stack goes to the scenario's stderr (segv_trace.c).
  gcc -shared -fPIC -O1 -o build/segv_trace.so tests/gpu/segv_trace.c && export SEGV_TRACE=$PWD/build/segv_trace.so
  cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null | sed 's/^/ptrace_scope /'
  if [[ -x build/arena.test ]]; then
    (cd arena && timeout 120 ../build/arena.test -test.v -test.run 'VMMCUDAIPC' 2>&1 | grep -E '^(=== RUN|--- |PASS|FAIL|ok|\s+vmm_cuda_ipc_test)' | tail -20) || status=1
  else
    echo "build/arena.test missing: make gpubuild"; status=1
  fi
  timeout 600 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ipc_gpu.py 2>&1 | tail -40 || status=1
  # Where a receiver crashes opening a handle of a sender that exited
  # (SIGSEGV on the H200, cause not found): the native stack, where gdb is.
  if command -v gdb > /dev/null; then
    GOALLOC_CXX=1 timeout 120 gdb -q -batch -ex 'handle SIGURG SIGPIPE SIGPROF nostop noprint pass' -ex run -ex bt \
      --args python3 tests/gpu/ipc_check.py exited 2>&1 | grep -E '^#[0-9]+ ' | head -30
  else
    echo "no gdb here: no native stack of the exited scenario"
  fi
fi
if want bench; then
  step bench
  [[ -x bench/run.sh ]] && { timeout 600 bash bench/run.sh "$OUT" || status=1; }
fi
if want lockstep; then
  step lockstep
  # Named only: native and goalloc-vmm training ResNet-50 in turns on this GPU,
  # step by step (bench/lockstep.py); LOCKSTEP_PAIR, LOCKSTEP_REPEATS,
  # LOCKSTEP_FIRST (the first repeat) and LOCKSTEP_BUDGET (seconds) change
  # it; LOCKSTEP_CPUS=N (3 or more) confines both processes to the first CPU
  # of N physical cores (not core 0) and pins their threads alike there: the
  # training thread to the first, torch's autograd thread to the second,
  # the others to the rest (--pin-threads). The class is built first, so that
  # no pair's first step waits for it.
  timeout 300 python3 -m goalloc._cxx > "$OUT/cxx-build.txt" 2>&1 || tail -20 "$OUT/cxx-build.txt"
  budget=${LOCKSTEP_BUDGET:-300}
  pin=() roles=()
  if [[ -n ${LOCKSTEP_CPUS:-} ]]; then
    lscpu -e > "$OUT/lscpu.txt" 2>&1
    cpus=$(lscpu -p=CPU,CORE | grep -v '^#' | awk -F, '$2 > 0 && !seen[$2]++ {print $1}' | head -"$LOCKSTEP_CPUS" | paste -sd,)
    echo "lockstep: pinned to CPUs $cpus"
    pin=(taskset -c "$cpus")
    roles=(--pin-threads "$cpus")
  fi
  timeout $(( budget + 120 )) "${pin[@]}" python3 bench/lockstep.py "$OUT/lockstep" --workload resnet50 --resnet-plan-shapes \
    --resnet-steps 100 --pair "${LOCKSTEP_PAIR:-native,goalloc-vmm}" --repeats "${LOCKSTEP_REPEATS:-3}" \
    --first-repeat "${LOCKSTEP_FIRST:-0}" --budget "$budget" "${roles[@]}" || status=1
  tar czf "$OUT/lockstep.tgz" -C "$OUT" lockstep && rm -rf "$OUT/lockstep"
fi
if want coldab; then
  step coldab
  # Named only: a cold call into goalloc (the ResNet-50 replay with 256 KiB and
  # 1 MiB walked between events) timed on this machine's CPU for two commits,
  # build/cold-base.test and build/cold-head.test (tests/gpu/cold_ab.py --build
  # BASE, where Go is), alternating; under a minute.
  timeout 300 python3 tests/gpu/cold_ab.py --run --rounds 9 --json "$OUT/cold_ab.json" 2>&1 | tee "$OUT/cold_ab.txt"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if want stress; then
  step stress
  # Named only: the Go tests that `make test` samples under -short (the
  # packages of STRESS_PKGS in the Makefile), in full under -race, from the
  # test binaries `make stressbuild` leaves in build/stress (no Go here); all
  # at once, each from its package's folder, its output in $OUT/stress.txt.
  if compgen -G "build/stress/*.test" > /dev/null; then
    out=$(cd "$OUT" && pwd)
    for t in build/stress/*.test; do
      p=$(basename "$t" .test)
      (cd "$p" && timeout 900 "../$t" -test.count=1 > "$out/stress-$p.log" 2>&1; echo "stress $p: exit $?" >> "$out/stress-$p.log") &
    done
    wait
    for f in "$out"/stress-*.log; do tail -3 "$f"; grep -q ': exit 0$' "$f" || status=1; done
    cat "$out"/stress-*.log > "$out/stress.txt" && rm -f "$out"/stress-*.log
  else
    echo "build/stress missing: make stressbuild"; status=1
  fi
fi
step done
# The device tool brings back at most 8 files: pack the small JSON results
# into one, results.json, keyed by file name.
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
packed = {}
for name in sorted(os.listdir(out)):
    path = os.path.join(out, name)
    if name.endswith(".json") and name not in ("pool.json", "results.json", "bench.json"):
        try:
            packed[name] = json.load(open(path))
        except ValueError:
            packed[name] = open(path).read()
        os.remove(path)
json.dump(packed, open(os.path.join(out, "results.json"), "w"), indent=1)
print("packed", len(packed), "results into results.json")
PY
exit $status
