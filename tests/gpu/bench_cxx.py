"""The alloc+free pair through torch.empty, four ways: PyTorch's native
caching allocator, goalloc through its C++ allocator class (goalloc-cxx),
the same with the class's front turned off (goalloc-cxx-nofront,
GOALLOC_CONF=front:false: every request and free calls into Go), and
goalloc through torch's CUDAPluggableAllocator (goalloc-pluggable).

Cases: 4 KiB, 1 MiB and 64 MiB tensors made and dropped in a Python loop,
and a burst of 64 tensors of mixed sizes made, then dropped. Each round runs
every allocator in a fresh process (the allocator is chosen before CUDA
starts); three rounds, interleaved, and the best of the three is kept. From
the repository root, on the GPU machine:

    python3 tests/gpu/bench_cxx.py [--rounds 3] [--json OUT.json]

Prints a table in microseconds per pair, and whether goalloc-cxx is at or
below native in every case (the goal; exit status 0 either way).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("native", "goalloc-cxx", "goalloc-cxx-nofront", "goalloc-pluggable")
KiB, MiB = 1 << 10, 1 << 20
# (case, size or None for the burst, pairs per measurement)
CASES = (("4KiB", 4 * KiB, 20000), ("1MiB", MiB, 20000), ("64MiB", 64 * MiB, 5000), ("burst64", None, 400))
BURST = [512, 4 * KiB, 64 * KiB, MiB, 3 * MiB, 16 * MiB, 100 * KiB, 8 * KiB] * 8  # 64 mixed sizes


def child(mode: str) -> dict:
    """Runs in the measuring process: one measurement per case."""
    sys.path.insert(0, str(ROOT / "python"))
    import torch

    info = {"mode": mode}
    if mode != "native":
        import goalloc
        from goalloc import _cxx

        goalloc.install()
        info["cxx"] = _cxx.installed()
        if mode.startswith("goalloc-cxx") != info["cxx"]:
            raise SystemExit(f"{mode}: the C++ class is {'' if info['cxx'] else 'not '}installed "
                             f"({_cxx.failure()})")
    torch.cuda.init()
    empty, u8 = torch.empty, torch.uint8
    out = {}
    for case, size, pairs in CASES:
        if size is not None:
            for _ in range(1000):  # warm the cache
                t = empty(size, dtype=u8, device="cuda")
                del t
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(pairs):
                t = empty(size, dtype=u8, device="cuda")
                del t
            torch.cuda.synchronize()
            out[case] = (time.perf_counter_ns() - t0) / pairs / 1000
        else:
            for _ in range(20):
                ts = [empty(n, dtype=u8, device="cuda") for n in BURST]
                del ts
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(pairs):
                ts = [empty(n, dtype=u8, device="cuda") for n in BURST]
                del ts
            torch.cuda.synchronize()
            out[case] = (time.perf_counter_ns() - t0) / (pairs * len(BURST)) / 1000
    info["us_per_pair"] = out
    info["allocated_after"] = torch.cuda.memory_allocated()
    if mode != "native":
        st = goalloc.memory_stats(0)
        info["goalloc_counts"] = {k: st.get(k) for k in (
            "goalloc.cache_hits", "goalloc.cache_misses", "goalloc.front.frees", "goalloc.front.recycled")}
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0

    best: dict[str, dict[str, float]] = {m: {} for m in MODES}
    runs = []
    for r in range(args.rounds):
        for mode in MODES:
            env = dict(os.environ)
            env.setdefault("GOALLOC_LIBRARY", str(ROOT / "build" / "libgoalloc.so"))
            env["GOALLOC_CXX"] = "1" if mode.startswith("goalloc-cxx") else "0"
            env.pop("GOALLOC_CONF", None)
            if mode == "goalloc-cxx-nofront":
                env["GOALLOC_CONF"] = "front:false"
            proc = subprocess.run([sys.executable, __file__, "--child", mode], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                print(f"round {r + 1} {mode}: FAILED\n{proc.stderr[-3000:]}", file=sys.stderr)
                runs.append({"round": r + 1, "mode": mode, "error": proc.stderr[-3000:]})
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            res["round"] = r + 1
            runs.append(res)
            for case, us in res["us_per_pair"].items():
                best[mode][case] = min(us, best[mode].get(case, float("inf")))

    cases = [c for c, _, _ in CASES]
    print(f"alloc+free pair through torch.empty, us, best of {args.rounds} (lower is better)")
    print(f"{'case':<10}" + "".join(f"{m:>20}" for m in MODES) + f"{'cxx/native':>12}")
    verdict = {}
    for case in cases:
        row = [best[m].get(case) for m in MODES]
        ratio = row[1] / row[0] if row[0] and row[1] else None
        verdict[case] = ratio is not None and ratio <= 1.0
        print(f"{case:<10}" + "".join(f"{v:>20.3f}" if v is not None else f"{'-':>20}" for v in row)
              + (f"{ratio:>12.3f}" if ratio is not None else f"{'-':>12}"))
    ok = all(verdict.values())
    print("goalloc-cxx at or below native in every case:", "yes" if ok else
          "no (" + ", ".join(c for c, v in verdict.items() if not v) + ")")
    doc = {"best_us_per_pair": best, "rounds": args.rounds, "cxx_at_or_below_native": verdict, "runs": runs}
    out = args.json or (os.path.join(os.environ["GOALLOC_GPU_OUT"], "cxx-bench.json")
                        if os.environ.get("GOALLOC_GPU_OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
