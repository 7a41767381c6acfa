"""How much of a training trace the C++ class's front could serve.

The front (python/goalloc/csrc/goalloc_front.h, caching/front.go) hands a
freed block out again to a request of the same stream and size, but only
while Go has not seen the free: every request the front cannot serve goes to
Go, which first applies every free in the log. So a request is served only
if a free of its stream and size came after the last request that went to
Go. This replays a recorded trace (traces/*.jsonl.gz, torch's events) under
that rule, with a log of 64 entries drained when full, and counts:

    python3 bench/front_coverage.py traces/gpt2-train.jsonl.gz traces/resnet50-train.jsonl.gz

The traces record block sizes (rounded to 512 bytes), not the sizes asked
for, which the front matches: the figure is an upper bound.

--keep N estimates a front that goalloc does not have: one that keeps up to
N freed blocks across Go's requests (Go counting them as freed when it next
drains, the front handing them out later), so that a request is served by
any kept block of its stream and size, the oldest dropped past N.
"""
from __future__ import annotations

import gzip
import json
import sys
from typing import Iterable

LOG_CAPACITY = 64  # goalloc_front::kLogCap, caching.FrontCap


def coverage(events: Iterable[dict]) -> dict:
    """Counts for a stream of trace events ("a": alloc / free_requested)."""
    log: list[list] = []  # [stream, size, recycled]
    live: dict[int, tuple[int, int]] = {}
    allocs = served = full_drains = frees = 0
    for e in events:
        action = e.get("a")
        if action == "alloc":
            allocs += 1
            key = (e["stream"], e["size"])
            for entry in reversed(log):
                if not entry[2] and (entry[0], entry[1]) == key:
                    entry[2] = True
                    served += 1
                    break
            else:
                log.clear()  # the request goes to Go, which drains the log first
            live[e["addr"]] = key
        elif action == "free_requested":
            key = live.pop(e["addr"], None)
            if key is None:
                continue  # allocated before the trace began
            frees += 1
            if len(log) >= LOG_CAPACITY:
                log.clear()
                full_drains += 1
            log.append([key[0], key[1], False])
    return {"allocations": allocs, "served_by_front": served, "into_go": allocs - served,
            "frees": frees, "full_log_drains": full_drains,
            "served_share": served / allocs if allocs else 0.0}


def coverage_kept(events: Iterable[dict], keep: int) -> dict:
    """Counts for a front that keeps up to `keep` freed blocks across requests."""
    kept: dict[int, tuple[int, int]] = {}  # address -> (stream, size), oldest first
    live: dict[int, tuple[int, int]] = {}
    allocs = served = 0
    for e in events:
        action = e.get("a")
        if action == "alloc":
            allocs += 1
            key = (e["stream"], e["size"])
            for addr in reversed(list(kept)):
                if kept[addr] == key:
                    del kept[addr]
                    served += 1
                    break
            live[e["addr"]] = key
        elif action == "free_requested":
            key = live.pop(e["addr"], None)
            if key is None:
                continue
            kept[e["addr"]] = key
            if len(kept) > keep:
                del kept[next(iter(kept))]
    return {"allocations": allocs, "served_by_front": served, "into_go": allocs - served,
            "served_share": served / allocs if allocs else 0.0}


def read(path: str) -> Iterable[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def main(argv: list[str]) -> int:
    keep = None
    if len(argv) >= 2 and argv[0] == "--keep":
        try:
            keep = int(argv[1])
        except ValueError:
            keep = -1
        if keep < 1:
            print(f"front_coverage: --keep takes a number of blocks >= 1, not {argv[1]!r}", file=sys.stderr)
            return 2
        argv = argv[2:]
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python3 bench/front_coverage.py [--keep N] TRACE.jsonl[.gz] ...", file=sys.stderr)
        return 2
    for path in argv:
        if keep is not None:
            c = coverage_kept(read(path), keep)
            print(f"{path}: {c['allocations']:,} allocations, {c['served_by_front']:,} served by a front keeping "
                  f"{keep} freed blocks ({c['served_share']:.1%}), {c['into_go']:,} into Go")
            continue
        c = coverage(read(path))
        print(f"{path}: {c['allocations']:,} allocations, {c['served_by_front']:,} served by the front "
              f"({c['served_share']:.1%}), {c['into_go']:,} into Go; {c['frees']:,} frees, "
              f"{c['full_log_drains']:,} drains of a full log")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
