#!/usr/bin/env python3
"""How many times a process's threads go to sleep when two threads take turns
calling into goalloc, as torch's training and autograd threads do.

A thread that called into Go and went back to C keeps Go's processor as if
it were in a system call. After 10 ms of that, Go's monitor thread (sysmon)
takes the processor back, and then polls every 20 us for a while before it
backs off: each poll is a sleep, a voluntary context switch. This script
makes "steps": one thread makes --calls calls, hands over to a second
thread that makes as many, then both pause --gap-ms. It prints the
process's voluntary context switches and CPU time a step, for a call into
goalloc (goalloc_device_count, which touches no device) and for a call of
the same shape into the C library (getpid), whose difference is Go's:

    GOALLOC_DEVICE=sim python3 bench/go_switches.py build/libgoalloc.so --gap-ms 12 --work 300
    python3 bench/go_switches.py build/libgoalloc.so --gap-ms 12 --work 300 --against libc

Standard library only (ctypes).
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import sys
import threading
import time
from typing import Callable


def steps(call: Callable[[], int], calls: int, gap_s: float, n: int, work: int = 0) -> tuple[float, float]:
    """Voluntary switches and CPU ms a step, over n steps; work: a loop of
    that many rounds of Python between two calls, as torch computes
    between two allocations."""
    go, done = threading.Event(), threading.Event()

    def burst() -> None:
        for _ in range(calls):
            call()
            if work:
                sum(range(work))

    def other() -> None:
        while True:
            go.wait()
            go.clear()
            burst()
            done.set()

    threading.Thread(target=other, daemon=True).start()
    call()

    def now() -> tuple[int, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_nvcsw, r.ru_utime + r.ru_stime

    sw0, cpu0 = now()
    for _ in range(n):
        burst()
        go.set()
        done.wait()
        done.clear()
        time.sleep(gap_s)
    sw1, cpu1 = now()
    return (sw1 - sw0) / n, (cpu1 - cpu0) / n * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("library", help="libgoalloc.so")
    p.add_argument("--gap-ms", type=float, default=12.0, help="pause between steps (default 12)")
    p.add_argument("--calls", type=int, default=500, help="calls per thread and step (default 500)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--work", type=int, default=0, help="rounds of a Python loop between two calls (default 0)")
    p.add_argument("--against", choices=("goalloc", "libc"), default="goalloc",
                   help="which library's call to make (one process each: Go's threads outlive a run)")
    args = p.parse_args(argv)
    if args.gap_ms < 0 or args.calls < 1 or args.steps < 1 or args.work < 0:
        p.error("--gap-ms and --work must be at least 0, --calls and --steps at least 1")
    if args.against == "goalloc":
        try:
            lib = ctypes.CDLL(args.library)
        except OSError as e:
            p.error(f"{args.library}: {e}")
        call = lib.goalloc_device_count
    else:
        call = ctypes.CDLL(None).getpid
    call.restype, call.argtypes = ctypes.c_int, []
    sw, cpu = steps(call, args.calls, args.gap_ms / 1e3, args.steps, args.work)
    print(f"{args.against}: {sw:.1f} voluntary switches and {cpu:.2f} CPU ms a step "
          f"({args.steps} steps, 2 x {args.calls} calls, work {args.work}, {args.gap_ms:g} ms pauses)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
