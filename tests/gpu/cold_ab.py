#!/usr/bin/env python3
"""What a cold call into goalloc costs on a given machine's CPU, for two commits.

    python3 tests/gpu/cold_ab.py --build BASE     where Go is: builds build/cold-base.test
                                                   (BASE) and build/cold-head.test (the
                                                   working tree)
    python3 tests/gpu/cold_ab.py --run [--rounds 7] [--walks 256,1024] [--json OUT]
                                                   anywhere, e.g. the GPU machine (run_gpu.sh coldab)

Both binaries are the replay package's tests, with the working tree's
replay/bench_test.go on both sides so that only the library differs; --run
runs BenchmarkReplayVMMCold (the bundled ResNet-50 trace on the simulated VMM
device with WALK KiB walked between events, as PyTorch's own work does between
two calls in training) once per round and walk with each binary, the two in
alternating order, and prints the medians of the hit, miss and free ns per
side and head over base. tests/misspath_compare.sh counts the same calls'
instructions and simulated cache misses; this times them on real caches, on
the machine whose training is in question. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build"
SIDES = ("base", "head")
METRICS = ("ns/hit", "ns/miss", "ns/free", "ns/walk")


def build(base: str) -> None:
    # tests/compare_lib.sh puts BASE's tree beside the working tree and builds
    # both, as tests/misspath_compare.sh does; the binaries are stripped, as
    # they travel to the GPU machine with the call.
    BUILD.mkdir(exist_ok=True)
    script = """. tests/compare_lib.sh "$1"
cp replay/bench_test.go "$tmp/base/replay/bench_test.go"
build() { go test -c -ldflags="-s -w" -o "$2/cold-$side.test" ./replay; }
each_side build
compare_header "$1"
"""
    subprocess.run(["sh", "-c", script, "cold_ab", base, str(BUILD)], cwd=REPO, check=True)
    for side in SIDES:
        print(BUILD / f"cold-{side}.test")


def parse(text: str) -> dict[str, dict[str, float]]:
    """Per walk (KiB), the metrics of the benchmark's output lines."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r"BenchmarkReplayVMMCold/walk=(\d+)KiB/calls=true\S*\s+\d+\s+(.*)", line)
        if not m:
            continue
        fields = m.group(2).split()
        vals = {fields[i + 1]: float(fields[i]) for i in range(0, len(fields) - 1, 2)}
        out[m.group(1)] = {k: vals[k] for k in METRICS if k in vals}
    return out


def run(rounds: int, walks: list[int]) -> dict[str, dict[str, dict[str, list[float]]]]:
    pattern = "ReplayVMMCold/walk=(" + "|".join(str(w) for w in walks) + ")KiB/calls=true$"
    got: dict[str, dict[str, dict[str, list[float]]]] = {s: {} for s in SIDES}
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            exe = BUILD / f"cold-{side}.test"
            p = subprocess.run([str(exe), "-test.run", "^$", "-test.bench", pattern, "-test.benchtime", "1x",
                                "-test.cpu", "1"], cwd=REPO / "replay", capture_output=True, text=True,
                               env=dict(os.environ, GOMAXPROCS="1"))
            if p.returncode != 0:
                sys.exit(f"{exe}: exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
            for walk, vals in parse(p.stdout).items():
                for k, v in vals.items():
                    got[side].setdefault(walk, {}).setdefault(k, []).append(v)
    return got


def report(got: dict[str, dict[str, dict[str, list[float]]]]) -> list[str]:
    lines = ["walk KiB  metric    base (median)  head (median)  head/base  runs"]
    for walk in sorted(got["base"], key=int):
        for k in METRICS:
            b, h = got["base"].get(walk, {}).get(k), got["head"].get(walk, {}).get(k)
            if not b or not h:
                continue
            mb, mh = statistics.median(b), statistics.median(h)
            lines.append(f"{walk:>8}  {k:<8} {mb:14.1f} {mh:14.1f}  {mh / mb:9.3f}  {len(b)}/{len(h)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--build", metavar="BASE", help="build the two binaries, BASE against the working tree")
    mode.add_argument("--run", action="store_true", help="time the two binaries")
    p.add_argument("--rounds", type=int, default=7, help="runs of each binary per walk (default 7)")
    p.add_argument("--walks", default="256,1024", help="KiB walked between events, comma-separated")
    p.add_argument("--json", help="also write every run's figures here")
    args = p.parse_args(argv)
    if args.build:
        build(args.build)
        return 0
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        walks = [int(w) for w in args.walks.split(",")]
    except ValueError:
        p.error(f"--walks takes KiB counts separated by commas, not {args.walks!r}")
    for side in SIDES:
        if not (BUILD / f"cold-{side}.test").is_file():
            p.error(f"build/cold-{side}.test is missing: build it where Go is with --build BASE")
    got = run(args.rounds, walks)
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    print("\n".join(report(got)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
