#!/usr/bin/env python3
"""What one operation costs the host under each allocator: a diagnostic, not a suite.

ResNet-50 training is bound by the host (bench/steady.py: a step lasts as long
as launching it), and every allocator that maps memory with CUDA's virtual
memory calls trained it slower than native in the suite: expandable_segments
0.942x, cudaMallocAsync 0.808x, goalloc-vmm 0.934x (BENCHMARKS.md, "Training on one GPU").
This script separates what an allocator's own calls cost from what the
operations on its memory cost: in one process per configuration, on tensors
too small for the GPU to be the limit, it times loops of

  empty     torch.empty + free: the allocator's pair alone
  add       x + 1: a pair and one elementwise kernel
  conv      a 3x3 convolution (cuDNN, bf16, channels_last): a pair, a workspace, cuDNN's call
  mm        a small bf16 matrix product (cuBLAS): a pair and cuBLAS's call

as microseconds per iteration (the median of --rounds rounds of --iters
iterations, a device synchronisation around each round), so that
conv - add, against native, says what cuDNN's call costs on this
allocator's memory.

    python3 bench/hostcost.py --config goalloc-vmm --out R.json     # one configuration, this process
    python3 bench/hostcost.py --run OUTDIR --configs native,expandable,goalloc-vmm --processes 3
    python3 bench/hostcost.py --summary OUTDIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402  (bench/workloads.py: the configurations)

CASES = ("empty", "add", "conv", "mm")
CONFIGS = ("native", "expandable", "async", "goalloc", "goalloc-vmm")


def measure(torch: Any, iters: int, rounds: int) -> dict[str, Any]:
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    x = torch.randn(2, 64, 8, 8, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False).to(dev, torch.bfloat16,
                                                                    memory_format=torch.channels_last)
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)

    def empty() -> None:
        torch.empty(4096, device=dev)

    def add() -> None:
        x + 1

    def conv_() -> None:
        conv(x)

    def mm() -> None:
        a @ a

    bodies: dict[str, Callable[[], None]] = {"empty": empty, "add": add, "conv": conv_, "mm": mm}
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, body in bodies.items():  # warm: cuDNN plans, cuBLAS handles, the caches
            for _ in range(200):
                body()
        torch.cuda.synchronize()
        per: dict[str, list[float]] = {n: [] for n in bodies}
        for _ in range(rounds):
            for name, body in bodies.items():  # the cases interleaved, round by round
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    body()
                torch.cuda.synchronize()
                per[name].append((time.perf_counter() - t0) / iters * 1e6)
    for name, us in per.items():
        out[name] = {"median_us": statistics.median(us), "min_us": min(us), "rounds_us": us}
    return out


def run_config(args: argparse.Namespace) -> int:
    import torch

    alloc = workloads.Allocator(torch, args.config)
    alloc.setup()
    torch.cuda.init()
    alloc.start()
    result = {"config": args.config, "pid": os.getpid(), "iters": args.iters, "rounds": args.rounds,
              "cases": measure(torch, args.iters, args.rounds)}
    if alloc.goalloc is not None:
        from goalloc import _cxx

        result["cxx_class"] = _cxx.installed()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(args.config, " ".join(f"{k} {v['median_us']:.2f}" for k, v in result["cases"].items()))
    return 0


def run_many(args: argparse.Namespace) -> int:
    out = Path(args.run)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            print(f"hostcost: unknown configuration {c!r}", file=sys.stderr)
            return 2
    status = 0
    for p in range(args.processes):
        order = configs[p % len(configs):] + configs[:p % len(configs)]  # rotated, as the suite does
        for c in order:
            env = workloads_env(c)
            cmd = [sys.executable, __file__, "--config", c, "--out", str(out / f"{c}-p{p}.json"),
                   "--iters", str(args.iters), "--rounds", str(args.rounds)]
            r = subprocess.run(cmd, env=env, timeout=300)
            status |= r.returncode != 0
    return int(status)


def workloads_env(config: str) -> dict[str, str]:
    """The process environment of a configuration, as bench/suite.py makes it."""
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GOALLOC_CONF"):
        env.pop(k, None)
    if config == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif config == "async":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    return env


def summary(folder: str) -> int:
    rows: dict[str, dict[str, list[float]]] = {}
    for f in sorted(Path(folder).glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except ValueError:
            continue
        if "cases" not in d:
            continue
        for case, v in d["cases"].items():
            rows.setdefault(d["config"], {}).setdefault(case, []).append(v["median_us"])
    if not rows:
        print(f"hostcost: no results in {folder}", file=sys.stderr)
        return 1
    cases = list(next(iter(rows.values())).keys())
    base = rows.get("native")
    print("config        " + "".join(f"{c:>16}" for c in cases) + "   (us per iteration, median over processes;"
          " x native)")
    for config, per in rows.items():
        cells = []
        for c in cases:
            m = statistics.median(per[c])
            rel = f" {m / statistics.median(base[c]):.2f}x" if base and c in base else ""
            cells.append(f"{m:9.2f}{rel:>7}")
        print(f"{config:<14}" + "".join(cells) + f"   n={len(per[cases[0]])}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=CONFIGS, help="measure this configuration in this process")
    p.add_argument("--out", help="with --config: the JSON result")
    p.add_argument("--run", metavar="OUTDIR", help="run --configs in fresh processes, interleaved")
    p.add_argument("--configs", default="native,expandable,goalloc-vmm")
    p.add_argument("--processes", type=int, default=3, help="with --run: processes per configuration")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--summary", metavar="OUTDIR", help="print the table of a --run's results")
    args = p.parse_args(argv)
    if args.iters < 1 or args.rounds < 1 or args.processes < 1:
        p.error("--iters, --rounds and --processes must be positive")
    if args.summary:
        return summary(args.summary)
    if args.run:
        return run_many(args)
    if not args.config or not args.out:
        p.error("give --config and --out, --run OUTDIR, or --summary OUTDIR")
    return run_config(args)


if __name__ == "__main__":
    sys.exit(main())
