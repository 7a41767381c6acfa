#!/usr/bin/env python3
"""Step by step: what the suite's training runs say beyond their totals.

    python3 bench/step_stats.py BENCH.json [BENCH.json ...] [--workload llama]

For each training workload of the suites' bench.json files (merged as
render.py merges them), prints:

  first sight   per configuration, the median of how much longer a shape's
                first step took than a later step of the same shape (with
                --plan-shapes the first step is the untimed planning step),
                over every shape seen twice in a run, and how many there were;
  runs          per run, its median and shortest timed step (ms);
  against native per repeat, how much longer a configuration's timed steps took
                than native's on the same shapes (ms), the steps that took
                over 2 ms longer and how long native took for them;
  host          per configuration, medians over its timed steps of what a step
                cost the host (bench/hostcount.py: wall ms, CPU ms of the
                training thread and of the process, context switches, and
                cycles, instructions and cache misses where the kernel let
                the run count them); then per repeat, the median of each over
                native's on the same step
  threads       per configuration, the CPU ms a timed step that each thread
                spent (bench/hostcount.py, read before and after the timed
                steps), threads of one name together, the training thread
                apart: medians over the runs
  driver        per goalloc run, goalloc's driver calls over the whole run
                (goalloc.driver.* in its memory_stats): the handles the VMM
                backend moved (cuMemUnmap calls) and created, all calls' ms,
                and the moves' cost at the run's own average prices (an
                unmap, plus a map and a set-access per handle mapped).

With --simultaneous A.json B.json (two suites run at the same time, one per
GPU, with the same repeats and the configurations in opposite orders: see
bench/README.md), it pairs the two suites' runs in the order they ran, so
that each pair trained the same shapes at the same time under two
configurations, and prints per pair the first configuration's throughput
over the second's and the median difference of their timed steps, then
the median over the pairs: what the host was doing meanwhile weighs on
both sides of each ratio.

Standard library only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render  # noqa: E402  (the merge rule is render's)


def first_sight(runs: list[dict[str, Any]]) -> tuple[Optional[float], int]:
    """Median extra seconds of a shape's first step over its later steps."""
    extra = []
    for r in runs:
        first: dict[tuple[int, ...], float] = {}
        for e in (r.get("result") or {}).get("step_log") or []:
            k = tuple(e.get("shape") or ())
            if k in first:
                if e.get("timed"):
                    extra.append(first[k] - e["seconds"])
            else:
                first[k] = e["seconds"]
    return (statistics.median(extra) if extra else None), len(extra)


def timed(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in (r.get("result") or {}).get("step_log") or [] if e.get("timed")]


def driver(r: dict[str, Any]) -> Optional[dict[str, float]]:
    """A goalloc run's driver profile over the whole run, or None."""
    st = dict(((r.get("result") or {}).get("allocator") or {}).get("stats") or {})

    def get(fn: str, k: str) -> float:
        return float(st.get(f"goalloc.driver.{fn}.{k}", 0))

    total_ns = sum(float(v) for k, v in st.items() if k.startswith("goalloc.driver.") and k.endswith(".ns"))
    if total_ns == 0:
        return None
    unmaps, maps, creates = get("cuMemUnmap", "count"), get("cuMemMap", "count"), get("cuMemCreate", "count")
    per_handle = (get("cuMemMap", "ns") + get("cuMemSetAccess", "ns")) / maps if maps else 0.0
    move_ns = get("cuMemUnmap", "ns") + unmaps * per_handle
    return {"unmaps": unmaps, "creates": creates, "driver_ms": total_ns / 1e6, "moves_ms": move_ns / 1e6,
            "move_us": move_ns / unmaps / 1e3 if unmaps else 0.0}


# The host counters step_stats prints, in order, and how: (key, column, scale).
HOST_COLUMNS = (("wall_ms", "wall ms", 1.0), ("main_cpu_ms", "main cpu ms", 1.0), ("cpu_ms", "cpu ms", 1.0),
                ("vol_switches", "vol sw", 1.0), ("invol_switches", "invol sw", 1.0),
                ("cycles", "Mcycles", 1e-6), ("instructions", "Minstr", 1e-6), ("ipc", "IPC", 1.0),
                ("llc_misses", "k LLC miss", 1e-3), ("l1i_misses", "k L1I miss", 1e-3))


def host_steps(r: dict[str, Any]) -> list[dict[str, float]]:
    """A run's timed steps' host counters, with the step's wall ms and IPC."""
    out = []
    for e in timed(r):
        h = e.get("host")
        if h is None:
            continue
        h = dict(h, wall_ms=e["seconds"] * 1e3)
        if h.get("cycles") and "instructions" in h:
            h["ipc"] = h["instructions"] / h["cycles"]
        out.append(h)
    return out


def host_report(runs: list[dict[str, Any]], configs: list[str]) -> list[str]:
    """Per configuration the median step's host counters, then per repeat the
    median difference from native's on the same steps."""
    keys = [k for k, _, _ in HOST_COLUMNS if any(k in h for r in runs for h in host_steps(r))]
    if "main_cpu_ms" not in keys:
        return []
    cols = [(k, c, s) for k, c, s in HOST_COLUMNS if k in keys]
    head = "  " + f"{'':<14}" + "".join(f"{c:>12}" for _, c, _ in cols)
    out = ["host, per timed step (medians over the steps of every run):", head]
    for c in configs:
        steps = [h for r in runs if r["config"] == c for h in host_steps(r)]
        if steps:
            out.append(f"  {c:<14}" + "".join(
                f"{statistics.median(h[k] for h in steps if k in h) * s:>12.3f}" if any(k in h for h in steps)
                else f"{'-':>12}" for k, _, s in cols))
    diff_cols = [(k, c, s) for k, c, s in cols if k != "ipc"]
    out += ["host, minus native's on the same step (medians over the steps of a repeat):",
            "  " + f"{'':<18}" + "".join(f"{c:>12}" for _, c, _ in diff_cols)]
    for rep in sorted({r["repeat"] for r in runs}):
        base = next((r for r in runs if r["config"] == "native" and r["repeat"] == rep), None)
        if base is None:
            continue
        for r in sorted((r for r in runs if r["repeat"] == rep and r is not base), key=lambda r: r["config"]):
            pairs = list(zip(host_steps(base), host_steps(r)))
            if not pairs:
                continue
            cells = []
            for k, _, s in diff_cols:
                d = [(b[k] - a[k]) * s for a, b in pairs if k in a and k in b]
                cells.append(f"{statistics.median(d):>+12.3f}" if d else f"{'-':>12}")
            out.append(f"  r{rep:<3}{r['config']:<14}" + "".join(cells))
    return out


def thread_groups(r: dict[str, Any]) -> dict[str, float]:
    """A run's CPU ms per timed step by thread: the training thread as
    "(training)", the others summed by name."""
    res = r.get("result") or {}
    steps = len(timed(r))
    if not res.get("threads") or not steps:
        return {}
    out: dict[str, float] = {}
    for t in res["threads"]:
        k = "(training)" if t.get("main") else str(t.get("name"))
        out[k] = out.get(k, 0.0) + float(t["cpu_ms"]) / steps
    return out


def threads_report(runs: list[dict[str, Any]], configs: list[str], least_ms: float = 0.05) -> list[str]:
    """Per configuration, the median over its runs of each thread group's CPU
    ms a timed step; groups under least_ms in every configuration left out."""
    per = {c: [g for r in runs if r["config"] == c and (g := thread_groups(r))] for c in configs}
    per = {c: gs for c, gs in per.items() if gs}
    if not per:
        return []
    med = {c: {k: statistics.median(g.get(k, 0.0) for g in gs) for k in {k for g in gs for k in g}}
           for c, gs in per.items()}
    names = sorted({k for m in med.values() for k, v in m.items() if v >= least_ms},
                   key=lambda k: (k != "(training)", -max(m.get(k, 0.0) for m in med.values()), k))
    out = ["threads, CPU ms a timed step (medians over the runs):",
           "  " + f"{'':<22}" + "".join(f"{c:>14}" for c in med)]
    for k in names:
        out.append(f"  {k[:22]:<22}" + "".join(f"{m.get(k, 0.0):>14.3f}" for m in med.values()))
    out.append(f"  {'all':<22}" + "".join(f"{sum(m.values()):>14.3f}" for m in med.values()))
    return out


def report(doc: dict[str, Any], workload: str) -> list[str]:
    runs = [r for r in doc.get("runs", []) if r.get("workload") == workload and r.get("status") == "ok"]
    if not runs:
        return []
    configs = sorted({r["config"] for r in runs}, key=lambda c: (c != "native", c))
    out = [f"== {workload}", "first sight (extra ms of a shape's first step over its later steps):"]
    for c in configs:
        m, n = first_sight([r for r in runs if r["config"] == c])
        out.append(f"  {c:<12} {'-' if m is None else f'{m * 1e3:.1f}'} (n={n})")
    out.append("runs (median / shortest timed step, ms):")
    for r in sorted(runs, key=lambda r: r.get("id", 0)):
        s = [e["seconds"] * 1e3 for e in timed(r)]
        if s:
            out.append(f"  {r.get('id', 0):>3} {r['config']:<12} r{r['repeat']}  {statistics.median(s):7.1f} {min(s):7.1f}")
    out.append("against native, same shapes (ms longer in all; steps over 2 ms longer: +ms/native ms):")
    for rep in sorted({r["repeat"] for r in runs}):
        base = next((r for r in runs if r["config"] == "native" and r["repeat"] == rep), None)
        if base is None:
            continue
        for r in runs:
            if r["repeat"] != rep or r is base:
                continue
            pairs = list(zip(timed(base), timed(r)))
            diff = sum(b["seconds"] - a["seconds"] for a, b in pairs) * 1e3
            slow = [f"+{(b['seconds'] - a['seconds']) * 1e3:.0f}/{a['seconds'] * 1e3:.0f}" for a, b in pairs
                    if b["seconds"] - a["seconds"] > 0.002]
            out.append(f"  r{rep} {r['config']:<12} {diff:+8.1f}  {' '.join(slow)}")
    out += host_report(runs, configs)
    out += threads_report(runs, configs)
    lines = []
    for r in sorted(runs, key=lambda r: (r["config"], r["repeat"])):
        d = driver(r)
        if d:
            lines.append(f"  {r['config']:<12} r{r['repeat']}  moved {d['unmaps']:.0f}, created {d['creates']:.0f}, "
                         f"driver {d['driver_ms']:.1f} ms, moves {d['moves_ms']:.1f} ms ({d['move_us']:.0f} us each)")
    if lines:
        out += ["driver (whole run):"] + lines
    return out


def simultaneous(a: dict[str, Any], b: dict[str, Any], workload: str, first: str,
                 second: str) -> list[str]:
    """Two suites' runs of workload paired in the order they ran (see the
    module's doc): first's throughput over second's, pair by pair."""
    def ran(doc: dict[str, Any]) -> list[dict[str, Any]]:
        return [r for r in doc.get("runs", []) if r.get("workload") == workload]
    lines, ratios = [], []
    for x, y in zip(ran(a), ran(b)):
        if x.get("repeat") != y.get("repeat") or {x.get("config"), y.get("config")} != {first, second}:
            lines.append(f"  {x.get('name')} and {y.get('name')}: not a pair of {first} and {second} "
                         f"on one repeat; the suites did not run in step")
            continue
        if x.get("status") != "ok" or y.get("status") != "ok":
            continue
        f, s = (x, y) if x["config"] == first else (y, x)
        uf, us = f["result"].get("units_per_s"), s["result"].get("units_per_s")
        if not uf or not us:
            continue
        steps = [p["seconds"] - q["seconds"] for p, q in zip(timed(f), timed(s))]
        ratios.append(uf / us)
        lines.append(f"  r{f.get('repeat')}  {first} {uf:,.0f}  {second} {us:,.0f}  ratio {uf / us:.3f}  "
                     f"median step {1e3 * statistics.median(steps):+.2f} ms")
    if ratios:
        lines.append(f"  {len(ratios)} pairs: {first} over {second}, median {statistics.median(ratios):.3f} "
                     f"(min {min(ratios):.3f}, max {max(ratios):.3f}); below 1 in {sum(r < 1 for r in ratios)}")
    return [f"== {workload}, simultaneous pairs"] + lines if lines else []


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", nargs="+", help="bench.json files of the suite")
    p.add_argument("--workload", choices=("gpt2", "llama", "resnet50"), help="one workload (default: all)")
    p.add_argument("--simultaneous", nargs=2, metavar=("CONFIG", "BASE"),
                   help="pair the runs of two suites run at the same time (exactly two files): CONFIG over BASE")
    args = p.parse_args(argv)
    docs = []
    for f in args.bench:
        try:
            docs.append(json.loads(Path(f).read_text()))
        except (OSError, ValueError) as e:
            p.error(f"{f}: {e}")
    if args.simultaneous:
        if len(docs) != 2:
            p.error("--simultaneous pairs exactly two bench.json files")
        for w in [args.workload] if args.workload else ["gpt2", "llama", "resnet50"]:
            for line in simultaneous(docs[0], docs[1], w, *args.simultaneous):
                print(line)
        return 0
    doc = render.merge(docs, args.bench, warn=lambda s: None)
    for w in [args.workload] if args.workload else ["gpt2", "llama", "resnet50"]:
        for line in report(doc, w):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
