#!/usr/bin/env python3
"""What goalloc's calls into Go cost inside a training step: the call clock's figures.

    python3 bench/call_clock.py BENCH.json [BENCH.json ...] [--workload resnet50]

A suite run with `--call-clock on` (or `probe`) has goalloc's C++ class time
every call it makes into Go over the timed steps (csrc/goalloc_clock.h), by
kind: requests the class's front did not serve (malloc), frees it did not
take (free), its log of frees handed over (drain) and, with probe, an empty
call into Go made before each of those (probe: the crossing alone). For each
such run this prints, per kind: calls per timed step, the mean, the median
and the 99th percentile (the upper edge of the histogram's power-of-two
bucket that holds it), how many calls per step took --slow-ns or more
(4,096 ns unless given) and at least how long they took (each at its
bucket's lower edge), and the milliseconds per step the calls took; then
the run's median timed step. Medians per configuration follow each file's
runs and, given several files (bench/clock_ab.sh's suites), all of theirs.

    python3 bench/call_clock.py --ab OUTDIR

pairs bench/clock_ab.sh's rounds instead: per round and configuration, side
B's median step and time in Go over side A's (the same shapes; with
--together, at the same time), then the medians of those ratios.

Set beside the step time native and goalloc trained the same shapes in
(bench/step_stats.py --simultaneous), this says how much of the difference
is the time spent inside the calls. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

KINDS = ("malloc", "free", "drain", "probe")
SLOW_NS = 4096  # "slow" by default: bucket 12 and up, calls of 4,096 ns or more


def quantile_ns(hist: list[int], q: float) -> Optional[int]:
    """The upper edge (ns) of the bucket that holds quantile q; None if empty."""
    n = sum(hist)
    if n == 0:
        return None
    want, seen = q * n, 0
    for b, c in enumerate(hist):
        seen += c
        if seen >= want and c > 0:
            return 2 ** (b + 1)
    return 2 ** len(hist)


def slow_calls(hist: list[int], slow_ns: int = SLOW_NS) -> int:
    """Calls in the buckets of slow_ns (a power of two) and up."""
    first = slow_ns.bit_length() - 1
    return sum(hist[first:])


def slow_ms_floor(hist: list[int], slow_ns: int = SLOW_NS) -> float:
    """At least how many ms the calls of slow_ns and up took: each counted at
    its bucket's lower edge."""
    first = slow_ns.bit_length() - 1
    return sum(c * 2 ** b for b, c in enumerate(hist) if b >= first) / 1e6


def kind_figures(k: dict[str, Any], steps: int, slow_ns: int = SLOW_NS) -> Optional[dict[str, float]]:
    calls, ns, hist = int(k.get("calls", 0)), int(k.get("ns", 0)), list(k.get("hist") or [])
    if calls == 0 or steps <= 0:
        return None
    return {
        "calls_per_step": calls / steps,
        "mean_ns": ns / calls,
        "p50_ns": float(quantile_ns(hist, 0.5) or 0),
        "p99_ns": float(quantile_ns(hist, 0.99) or 0),
        "slow_per_step": slow_calls(hist, slow_ns) / steps,
        "slow_ms_floor_per_step": slow_ms_floor(hist, slow_ns) / steps,
        "ms_per_step": ns / steps / 1e6,
    }


def run_lines(r: dict[str, Any], slow_ns: int = SLOW_NS) -> tuple[list[str], dict[str, dict[str, float]]]:
    res = r.get("result") or {}
    clock = res.get("call_clock") or {}
    steps = int(clock.get("steps") or 0)
    figures: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        f = kind_figures((clock.get("kinds") or {}).get(kind) or {}, steps, slow_ns)
        if f is not None:
            figures[kind] = f
    med = res.get("median_step_s")
    head = (f"  {r.get('id', 0):>3} {r.get('config')} r{r.get('repeat')} ({clock.get('mode')}, {steps} steps"
            + (f", median step {med * 1e3:.2f} ms)" if med else ")"))
    lines = [head]
    for kind, f in figures.items():
        lines.append(f"      {kind:<6} {f['calls_per_step']:8.1f}/step  mean {f['mean_ns'] / 1e3:6.2f} us  "
                     f"p50 <{f['p50_ns'] / 1e3:6.2f} us  p99 <{f['p99_ns'] / 1e3:7.2f} us  "
                     f">={slow_ns}ns {f['slow_per_step']:6.1f}/step (>={f['slow_ms_floor_per_step']:.3f} ms)  "
                     f"{f['ms_per_step']:6.3f} ms/step")
    return lines, figures


Medians = dict[str, dict[str, list[float]]]  # configuration -> kind (and "total") -> ms per step, per run


def medians_lines(per_config: Medians) -> list[str]:
    out = []
    for config, agg in per_config.items():
        parts = [f"{k} {statistics.median(v):.3f}" for k, v in agg.items() if k != "total"]
        out.append(f"  {config:<12} all {statistics.median(agg['total']):.3f}  ({', '.join(parts)}; "
                   f"{len(agg['total'])} runs)")
    return out


def report(doc: dict[str, Any], workload: str, slow_ns: int = SLOW_NS,
           every: Optional[dict[str, Medians]] = None) -> list[str]:
    """The lines for doc's runs of workload; every, when given, gathers their
    figures across several files."""
    runs = [r for r in doc.get("runs", []) if r.get("workload") == workload and r.get("status") == "ok"
            and (r.get("result") or {}).get("call_clock")]
    if not runs:
        return []
    out = [f"== {workload}: goalloc's calls into Go, timed where the class makes them"]
    per_config: Medians = {}
    for r in sorted(runs, key=lambda r: r.get("id", 0)):
        lines, figures = run_lines(r, slow_ns)
        out += lines
        total = sum(f["ms_per_step"] for k, f in figures.items())
        for into in [per_config] + ([every.setdefault(workload, {})] if every is not None else []):
            agg = into.setdefault(r["config"], {})
            agg.setdefault("total", []).append(total)
            for kind, f in figures.items():
                agg.setdefault(kind, []).append(f["ms_per_step"])
    out.append("medians over runs (ms per step in the calls):")
    return out + medians_lines(per_config)


def go_ms(r: dict[str, Any]) -> Optional[float]:
    """A run's milliseconds per step in its calls into Go, all kinds; None without the clock."""
    clock = (r.get("result") or {}).get("call_clock") or {}
    steps = int(clock.get("steps") or 0)
    if steps <= 0:
        return None
    return sum(int(k.get("ns", 0)) for k in (clock.get("kinds") or {}).values()) / steps / 1e6


def ab_lines(outdir: Path) -> list[str]:
    """bench/clock_ab.sh's rounds paired: per round and configuration, B's median
    step and time in Go over A's, then the medians of those ratios. native is
    the same on both sides, so its B/A is the host's drift over the round;
    each configuration's ratios are also given over native's of its round."""
    rounds = sorted(int(d.name[2:]) for d in outdir.glob("a-*") if d.name[2:].isdigit()
                    and (outdir / f"b-{d.name[2:]}" / "bench.json").is_file()
                    and (d / "bench.json").is_file())
    out = ["round  workload  configuration  step ms A / B (B/A)       Go ms a step A / B (B/A)"]
    ratios: dict[tuple[str, str], dict[str, list[float]]] = {}
    for i in rounds:
        runs = {}
        for side in "ab":
            doc = json.loads((outdir / f"{side}-{i}" / "bench.json").read_text())
            for r in doc.get("runs", []):
                res = r.get("result") or {}
                if r.get("status") == "ok" and res.get("median_step_s"):
                    runs[(side, r.get("workload"), r.get("config"))] = r
        def step_ratio(w: str, c: str) -> Optional[float]:
            ra, rb = runs.get(("a", w, c)), runs.get(("b", w, c))
            if ra is None or rb is None:
                return None
            return rb["result"]["median_step_s"] / ra["result"]["median_step_s"]

        for (side, w, c), ra in sorted(runs.items()):
            rb = runs.get(("b", w, c))
            if side != "a" or rb is None:
                continue
            sa, sb = ra["result"]["median_step_s"] * 1e3, rb["result"]["median_step_s"] * 1e3
            agg = ratios.setdefault((w, c), {})
            agg.setdefault("step", []).append(sb / sa)
            drift = step_ratio(w, "native") if c != "native" else None
            if drift:
                agg.setdefault("step/native", []).append(sb / sa / drift)
            line = f"{i:>5}  {w:<8}  {c:<13}  {sa:7.2f} / {sb:7.2f} ({sb / sa:5.3f})"
            ga, gb = go_ms(ra), go_ms(rb)
            if ga and gb:
                agg.setdefault("go", []).append(gb / ga)
                if drift:
                    agg.setdefault("go/native", []).append(gb / ga / drift)
                line += f"   {ga:6.3f} / {gb:6.3f} ({gb / ga:5.3f})"
            out.append(line)
    if not ratios:
        return []
    out.append("medians of B/A over the rounds (rounds where B was lower):")
    for (w, c), agg in ratios.items():
        parts = [f"{k} {statistics.median(v):.3f} ({sum(x < 1 for x in v)} of {len(v)})" for k, v in agg.items()]
        out.append(f"  {w:<8}  {c:<13}  " + ", ".join(parts))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", nargs="*", help="bench.json files of suites run with --call-clock")
    p.add_argument("--ab", metavar="OUTDIR",
                   help="instead, pair bench/clock_ab.sh's rounds in OUTDIR (a-I and b-I): B over A")
    p.add_argument("--workload", choices=("gpt2", "llama", "resnet50"), help="one workload (default: all)")
    p.add_argument("--slow-ns", type=int, default=SLOW_NS,
                   help=f"count the calls of this many ns or more, a power of two (default {SLOW_NS})")
    args = p.parse_args(argv)
    if args.ab:
        lines = ab_lines(Path(args.ab))
        if not lines:
            print(f"{args.ab}: no round with both sides' runs (a-I/bench.json and b-I/bench.json)", file=sys.stderr)
            return 1
        print("\n".join(lines))
        return 0
    if not args.bench:
        p.error("give bench.json files, or --ab OUTDIR")
    if args.slow_ns < 2 or args.slow_ns & (args.slow_ns - 1):
        p.error("--slow-ns must be a power of two (the histogram's buckets are)")
    printed = False
    every: dict[str, Medians] = {}
    for f in args.bench:
        try:
            doc = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            p.error(f"{f}: {e}")
        for w in [args.workload] if args.workload else ["gpt2", "llama", "resnet50"]:
            for line in report(doc, w, args.slow_ns, every):
                print(line)
                printed = True
    if len(args.bench) > 1:
        for w, per_config in every.items():
            print(f"== {w}: medians over the runs of all {len(args.bench)} files (ms per step in the calls):")
            for line in medians_lines(per_config):
                print(line)
    if not printed:
        print("no run with the call clock's figures (run the suite with --call-clock on)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
