"""Slim a goalloc trace for the simulator's test set (traces/*-vmm.jsonl.gz).

    python3 bench/slim_trace.py RECORDED.jsonl.gz traces/NAME-vmm.jsonl.gz

Keeps the header and the lines a replay acts on, `alloc` and
`free_completed`; drops `segment_alloc` and `free_requested`, which the
replay only checks and counts. Addresses become small ids (a reused address
keeps its id, as the recording did) and times count from the first event
kept, so the file compresses to about half. The header's `events` becomes
the lines kept and `slimmed` says what was done; the replay ignores header
keys it does not know, and its result is the recording's.
"""

import argparse
import gzip
import json
import sys
from typing import IO, Iterator

KEPT = ("alloc", "free_completed")


def slim_lines(src: IO[str]) -> Iterator[str]:
    """The slimmed trace's lines, header first; ValueError names the line
    of a trace that is not one."""
    header = json.loads(src.readline() or "null")
    if not isinstance(header, dict):
        raise ValueError("line 1: not a trace's header (a JSON object)")
    ids: dict[int, int] = {}
    t0 = None
    events = []
    for n, line in enumerate(src, start=2):
        try:
            ev = json.loads(line)
            kind, addr, t = ev["a"], ev["addr"], ev["t"]
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"line {n}: not a trace event ({type(e).__name__}: {e}): {line[:80].strip()}") from None
        if not isinstance(addr, int) or not isinstance(t, int):
            raise ValueError(f"line {n}: addr and t must be integers: {line[:80].strip()}")
        if kind not in KEPT:
            continue
        if t0 is None:
            t0 = ev["t"]
        if ev["a"] == "alloc" and ev["addr"] not in ids:
            ids[ev["addr"]] = len(ids) + 1
        if ev["addr"] not in ids:
            raise ValueError(f"line {n}: {ev['a']} of address {ev['addr']}, which no alloc before it made")
        ev["addr"] = ids[ev["addr"]]
        ev["t"] -= t0
        events.append(json.dumps(ev, separators=(",", ":")))
    header["events"] = len(events)
    header["slimmed"] = ("only the alloc and free_completed lines the replay acts on; "
                         "addresses renumbered; t from the first event")
    yield json.dumps(header)
    yield from events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a trace goalloc recorded (bench/workloads.py --record-history)")
    p.add_argument("dst", help="the slimmed trace, gzipped")
    args = p.parse_args()
    try:
        # Read it all before writing: a bad trace leaves no partial output.
        with gzip.open(args.src, "rt") as src:
            lines = list(slim_lines(src))
        with gzip.open(args.dst, "wt", compresslevel=9) as dst:
            for line in lines:
                dst.write(line + "\n")
    except (OSError, EOFError, ValueError) as e:
        sys.exit(f"slim_trace: {args.src}: {e}")


if __name__ == "__main__":
    main()
