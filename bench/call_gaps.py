#!/usr/bin/env python3
"""How long the host stays away from the allocator between two requests.

    python3 bench/call_gaps.py traces/resnet50-train.jsonl.gz [--at 5,20,60,200,1000]

Under goalloc's C++ class every request the front does not serve is a call
into Go, and what such a call costs depends on how long the calling thread
was out in C before it (BENCHMARKS.md, "A call into Go after a stretch in
C"). A bundled trace (goalloc's format, recorded under PyTorch's native
allocator, history on) gives each event's host time: this prints, for the
gaps between consecutive requests ("alloc" events), how many were at least
each of the thresholds, and the requests per second over the trace.

Standard library only.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Iterable, Optional


def request_times(lines: Iterable[str]) -> list[int]:
    """The host times (us) of the trace's requests, in order; the header and
    other events are skipped."""
    times = []
    for line in lines:
        e = json.loads(line)
        if e.get("a") == "alloc" and "t" in e:
            times.append(int(e["t"]))
    return times


def report(times: list[int], thresholds: list[int]) -> list[str]:
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return ["fewer than two requests with a time"]
    out = [f"{len(times):,} requests over {(times[-1] - times[0]) / 1e6:.2f} s "
           f"({len(times) / max(1e-9, (times[-1] - times[0]) / 1e6):,.0f} a second)"]
    for th in thresholds:
        n = sum(g >= th for g in gaps)
        out.append(f"gap >= {th:>6,} us: {n:>8,} ({100 * n / len(gaps):.1f}% of {len(gaps):,})")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a trace in goalloc's format (.jsonl or .jsonl.gz)")
    p.add_argument("--at", default="5,20,60,200,1000", help="thresholds in microseconds, comma-separated")
    args = p.parse_args(argv)
    try:
        thresholds = [int(x) for x in args.at.split(",") if x.strip()]
    except ValueError:
        p.error(f"--at {args.at!r}: want comma-separated whole microseconds")
    path = Path(args.trace)
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
            times = request_times(f)
    except (OSError, ValueError) as e:
        p.error(f"{path}: {e}")
    for line in report(times, thresholds):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
