#!/usr/bin/env python3
"""Where a training step's time goes under one allocator: a diagnostic, not a suite.

The suite (bench/suite.py) draws a new shape every step, so its ResNet-50
figure mixes cuDNN's per-shape planning (100-200 ms a new shape) with the
steady steps that repeat a shape. This script trains one fixed shape, after a
warm-up that has planned it, and splits the step:

  wall_ms       device synchronisation to device synchronisation
  enqueue_ms    until the host has launched the whole step (before the sync):
                when it is close to wall_ms, the step is bound by the host, and
                every microsecond the allocator adds shows
  allocs        allocations in the step (torch's allocation.all.allocated)

then profiles a few steps with torch.profiler: the kernels' device time per
step, and the host operators' self time, where an allocator's cost lands (in
the operator that allocated). One configuration per process (the allocator
swap lasts for the process); bench/steady.sh interleaves the configurations
over fresh processes.

    python3 bench/steady.py --workload resnet50 --config goalloc --shape 48 192 --out R.json
    python3 bench/steady.py --summary DIR    # steady.sh's runs in DIR, a line per configuration
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402  (bench/workloads.py: the configurations and models)


def step_fn(torch: Any, model: Any, opt: Any, forward: Any, shape: tuple[int, int], dev: Any) -> Any:
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss, _ = forward(shape)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def allocs_so_far(torch: Any) -> int:
    """torch's count of allocations so far; -1 where the allocator keeps none
    (torch's pluggable class refuses memory_stats)."""
    try:
        return int(torch.cuda.memory_stats(0).get("allocation.all.allocated", -1))
    except RuntimeError:
        return -1


def profile_steps(torch: Any, run_step: Any, n: int) -> dict[str, Any]:
    """Kernel device time per step and the host operators' self time, over n steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run_step()
        torch.cuda.synchronize()
    kernel_us = 0.0
    kernels = 0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and getattr(e, "device_time", 0) > 0:
            kernel_us += e.device_time
            kernels += 1
    ops = []
    for a in prof.key_averages():
        ops.append({"name": a.key, "count": a.count, "self_cpu_us": a.self_cpu_time_total})
    ops.sort(key=lambda o: -o["self_cpu_us"])
    return {"steps": n, "kernel_ms_per_step": kernel_us / 1000 / n, "kernels_per_step": kernels / n,
            "self_cpu_ms_per_step": sum(o["self_cpu_us"] for o in ops) / 1000 / n, "top_ops": ops[:30]}


def run_new_shapes(torch: Any, args: argparse.Namespace, model: Any, opt: Any, forward: Any, dev: Any,
                   trained: tuple[int, ...]) -> dict[str, Any]:
    """Steps of shapes not seen yet: where cuDNN plans each new shape (the
    suite's ResNet-50 steps are mostly these). Each is timed; the last three
    are profiled together."""
    limits = workloads.train_limits(workloads.parse_args(["--workload", args.workload, "--out", "-"]),
                                    args.workload)
    seen = {trained}
    todo = []
    for sh in workloads.train_shapes(args.workload, 0, 200, limits):
        if sh not in seen:
            seen.add(sh)
            todo.append(sh)
        if len(todo) == args.new_shapes:
            break
    steps = []
    plain = todo[:-3] if len(todo) > 3 else todo
    for sh in plain:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn(torch, model, opt, forward, sh, dev)
        torch.cuda.synchronize()
        steps.append({"shape": list(sh), "wall_ms": (time.perf_counter() - t0) * 1e3})
    out: dict[str, Any] = {"steps": steps, "median_wall_ms": statistics.median(s["wall_ms"] for s in steps)}
    rest = todo[len(plain):]
    if rest:
        it = iter(rest)
        out["profile"] = profile_steps(torch, lambda: step_fn(torch, model, opt, forward, next(it), dev), len(rest))
    return out


def summary(outdir: str) -> list[str]:
    """One line per configuration of the runs in outdir (steady.sh's files):
    medians over the runs of their median steady step, host launch time,
    kernel time, and new-shape step; throughput against native's."""
    import collections
    import glob

    by: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for f in sorted(glob.glob(os.path.join(outdir, "*-r*.json"))):
        with open(f) as fh:
            d = json.load(fh)
        by[d["config"] + ("+" + d["goalloc_conf"] if d.get("goalloc_conf") else "")].append(d)
    med = statistics.median
    base = med(d["median_wall_ms"] for d in by["native"]) if by.get("native") else None
    lines = []
    for c, ds in sorted(by.items()):
        w = med(d["median_wall_ms"] for d in ds)
        k = [d["profile"]["kernel_ms_per_step"] for d in ds if "profile" in d]
        line = (f"{c:28s} n={len(ds)} step {w:6.2f} ms ({base / w if base else 0:.3f}x native's throughput)  "
                f"host {med(d['median_enqueue_ms'] for d in ds):6.2f} ms  kernels {med(k) if k else 0:5.2f} ms  "
                f"allocations {'uncounted' if not ds[0]['median_allocs'] else format(ds[0]['median_allocs'], '.0f')}")
        ns = [d["new_shapes"]["median_wall_ms"] for d in ds if "new_shapes" in d]
        if ns:
            line += f"  new-shape step {med(ns):7.2f} ms"
        lines.append(line)
    return lines


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--summary":
        print("\n".join(summary(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="resnet50", choices=("resnet50", "gpt2", "llama"))
    p.add_argument("--config", default="native", choices=workloads.CONFIGS)
    p.add_argument("--shape", type=int, nargs=2, default=(48, 192), metavar=("BATCH", "RES_OR_SEQ"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=4, help="0: no profile")
    p.add_argument("--new-shapes", type=int, default=0,
                   help="then this many steps of shapes not trained yet (the suite's first repeat's, "
                        "as bench/workloads.py draws them), each timed, the last 3 profiled")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    alloc = workloads.Allocator(torch, args.config)
    alloc.setup()
    torch.cuda.init()
    alloc.start()
    dev = torch.device("cuda", 0)
    torch.manual_seed(1)
    with alloc.scope():
        build = workloads.BUILDERS.get(args.workload, workloads.build_resnet50)
        model, opt, forward = build(torch, dev)
        shape = tuple(args.shape)

        def run_step() -> Any:
            return step_fn(torch, model, opt, forward, shape, dev)

        for _ in range(args.warmup):
            run_step()
        torch.cuda.synchronize()
        steps = []
        for _ in range(args.steps):
            a0 = allocs_so_far(torch)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            steps.append({"wall_ms": (t2 - t0) * 1e3, "enqueue_ms": (t1 - t0) * 1e3,
                          "allocs": allocs_so_far(torch) - a0 if a0 >= 0 else None})
        out: dict[str, Any] = {
            "workload": args.workload, "config": args.config, "shape": list(shape), "pid": os.getpid(),
            "goalloc_conf": os.environ.get("GOALLOC_CONF", ""),
            "median_wall_ms": statistics.median(s["wall_ms"] for s in steps),
            "median_enqueue_ms": statistics.median(s["enqueue_ms"] for s in steps),
            "median_allocs": (statistics.median(s["allocs"] for s in steps)
                              if steps[0]["allocs"] is not None else None),
            "steps": steps,
        }
        if args.profile_steps > 0:
            out["profile"] = profile_steps(torch, run_step, args.profile_steps)
        if args.new_shapes > 0:
            out["new_shapes"] = run_new_shapes(torch, args, model, opt, forward, dev, shape)
        if alloc.goalloc is not None:
            from goalloc import _cxx

            out["cxx_class"] = _cxx.installed()  # else torch's pluggable class
            st = alloc.goalloc.memory_stats(0)
            out["goalloc_stats"] = {k: v for k, v in st.items() if k.startswith("goalloc.") or k.startswith("num_")}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{args.config:12s} step {out['median_wall_ms']:.2f} ms  host {out['median_enqueue_ms']:.2f} ms  "
          f"allocations {out['median_allocs']}" + (f"  kernels {out['profile']['kernel_ms_per_step']:.2f} ms"
                                               if "profile" in out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
