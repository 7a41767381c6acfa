#!/usr/bin/env python3
"""The benchmark suite's bench.json as markdown tables and goals (BENCHMARKS.md quotes them).

    python3 bench/render.py OUTDIR/bench.json [--output F.md]
    python3 bench/render.py A/bench.json B/bench.json     # several suites, merged
    python3 bench/render.py A/bench.json --lockstep L/lockstep.json --keep bench/results/training.json

Every figure is computed here from the runs: medians over repeats, ratios of
medians, goals met or missed and by how much. Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
# bench/workloads.py: the configurations (goalloc installed in GOALLOC_CONFIGS: the goals take the better).
from workloads import CONFIGS, GOALLOC_CONFIGS, SHAPE_RANGES, base_config, is_goalloc  # noqa: E402

DEFAULT_GOALLOC = "goalloc-vmm"  # backend:vmm, goalloc's default backend
TRAIN = (("gpt2", "GPT-2 124M", "tokens/s"), ("llama", "LLaMA 672M (GQA)", "tokens/s"),
         ("resnet50", "ResNet-50", "images/s"), ("rollout", "RL-style rollout, LLaMA 582M", "tokens/s"),
         ("checkpoint", "FSDP, LLaMA 672M", "tokens/s"), ("serving", "Serving, LLaMA 672M (bf16)", "tokens/s"),
         ("moe", "Mixture of experts 1.1B", "tokens/s"))
# The goals: peak device memory over peak live per workload (1.03 where not
# named); throughput against native.
GOAL_MEMORY_OVER_LIVE = {"resnet50": 1.05}
GOAL_THROUGHPUT_VS_NATIVE = 0.98
GiB, MiB, KiB = float(1 << 30), float(1 << 20), float(1 << 10)


# --- aggregation ---------------------------------------------------------------


def dig(d: Any, *path: str) -> Any:
    """d[path[0]][path[1]]..., or None where any step is missing."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def number(v: Any) -> Optional[float]:
    """v as a float if it is a finite number, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


@dataclass
class Agg:
    """The values of one metric over the repeats: their count, median, lowest and highest."""

    values: list[float]

    def __post_init__(self) -> None:
        v = self.values
        self.n = len(v)
        self.median, self.lo, self.hi = (float(statistics.median(v)), min(v), max(v)) if v else (None, None, None)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def runs_of(doc: dict[str, Any], workload: str, config: Optional[str] = None) -> list[dict[str, Any]]:
    """The runs of a workload (and configuration) that left a result."""
    return [r for r in doc.get("runs", []) if r.get("workload") == workload and isinstance(r.get("result"), dict)
            and config in (None, r.get("config"))]


def collect(runs: Iterable[dict[str, Any]], get: Callable[[dict[str, Any]], Any], scale: float = 1.0) -> Agg:
    """Agg of get(run["result"]) * scale over the runs where it is a number
    (a run that failed part way counts for the sections it finished)."""
    return Agg([v * scale for v in (number(get(r["result"])) for r in runs) if v is not None])


def by_repeat(doc: dict[str, Any], workload: str, config: str,
              get: Callable[[str, dict[str, Any]], Any]) -> dict[Any, float]:
    """get(config, result) by repeat, where it is a number."""
    out = {}
    for r in runs_of(doc, workload, config):
        v = number(get(config, r["result"]))
        if v is not None:
            out[r.get("repeat")] = v
    return out


def suites_differ(doc: dict[str, Any], workload: str, config: str, base: str = "native") -> bool:
    """Whether a repeat of config and the same repeat of base come from
    different suites (a merged document's "suite" of a run): such runs were
    not interleaved, hours may lie between them, and their speeds compare
    two states of the machine, not two allocators. Memory compares all the
    same: a repeat's shapes are the same in every suite."""
    a = {r.get("repeat"): r.get("suite", 0) for r in runs_of(doc, workload, config)}
    b = {r.get("repeat"): r.get("suite", 0) for r in runs_of(doc, workload, base)}
    return any(a[k] != b[k] for k in a if k in b)


def paired_speed_ratios(doc: dict[str, Any], workload: str, config: str, base: str = "native") -> list[float]:
    """config's throughput over base's repeat by repeat (the same shapes), in
    repeat order; repeats missing either, or run in different suites, are
    left out."""
    a = by_repeat(doc, workload, config, lambda _, r: r.get("units_per_s"))
    b = by_repeat(doc, workload, base, lambda _, r: r.get("units_per_s"))
    suite = {(r.get("config"), r.get("repeat")): r.get("suite", 0) for r in runs_of(doc, workload)}
    both = sorted((k for k in a if k in b and b[k] and suite[(config, k)] == suite[(base, k)]),
                  key=lambda k: k if isinstance(k, int) else -1)
    return [a[k] / b[k] for k in both]


def memory_of_record(config: str, result: dict[str, Any]) -> Any:
    """A training run's peak device memory: for goalloc the high-water mark
    of its memory source (the pool's reserved bytes; for goalloc-vmm the
    physical memory mapped), for torch's allocators their max reserved."""
    a = result.get("allocator") or {}
    return a.get("pool_reserved_max_read") if is_goalloc(config) else a.get("reserved_peak")


def device_peak(_: str, result: dict[str, Any]) -> Any:
    return dig(result, "device", "peak_over_baseline")


def memory_medians(doc: dict[str, Any], workload: str, a: str, b: str,
                   get: Callable[[str, dict[str, Any]], Any] = memory_of_record
                   ) -> tuple[Optional[float], Optional[float], str]:
    """a's and b's median peak memory, over the repeats both ran where one
    lacks a repeat the other ran (each repeat draws its own shapes), and a
    note saying so."""
    ma, mb = by_repeat(doc, workload, a, get), by_repeat(doc, workload, b, get)
    if set(ma) == set(mb):
        return Agg(list(ma.values())).median, Agg(list(mb.values())).median, ""
    both = sorted(k for k in ma if k in mb)
    if not both:
        return None, None, ""
    note = (f" (over the {len(both)} repeat(s) both ran, {', '.join(str(k) for k in both)}: "
            f"{a} ran {len(ma)}, {b} {len(mb)})")
    return Agg([ma[k] for k in both]).median, Agg([mb[k] for k in both]).median, note


MEMORY_BASIS = {"goalloc": "driver pool reserved high-water mark",
                "goalloc-vmm": "physical memory mapped, high-water mark"}


# --- formatting ------------------------------------------------------------------


def fmt(v: Optional[float], digits: int = 2) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def fmt_x(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.3f}×"


def fmt_bytes(v: Optional[float]) -> str:
    if v is None:
        return "—"
    if abs(v) >= GiB:
        return f"{v / GiB:.2f} GiB"
    if abs(v) >= MiB or v == 0:
        return f"{v / MiB:.1f} MiB"
    return f"{v / KiB:.0f} KiB"


def fmt_spread(a: Agg, f: Callable[[Optional[float]], str]) -> str:
    if a.n == 0:
        return "—"
    return f"{f(a.median)} (n=1)" if a.n == 1 else f"{f(a.median)} ({f(a.lo)}–{f(a.hi)}, n={a.n})"


def pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def present_configs(doc: dict[str, Any], workload: str) -> list[str]:
    """The configurations planned or run for a workload, in the standard order."""
    seen = {r.get("config") for r in doc.get("plan", []) + doc.get("runs", []) if r.get("workload") == workload}
    return [c for c in CONFIGS if c in seen] + sorted(c for c in seen if c not in CONFIGS and c)


def first_line(s: Any, last: bool = False) -> str:
    lines = [ln.strip() for ln in s.strip().splitlines() if ln.strip()] if isinstance(s, str) else []
    return (lines[-1] if last else lines[0])[:200].replace("|", "/") if lines else ""


def status_counts(runs: list[dict[str, Any]]) -> str:
    counts = collections.Counter(r.get("status", "?") for r in runs)
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"


# --- the sections -------------------------------------------------------------------


def section_header(doc: dict[str, Any]) -> list[str]:
    inputs = doc.get("inputs")
    lines = ["# goalloc benchmarks", "",
             "Generated by `bench/render.py` from the suite's `bench.json`"
             + (f" files ({len(inputs)}, merged)" if inputs else "") + ". Each run a fresh process,",
             "configurations interleaved in a rotated order; medians over the repeats (min–max, n),",
             "ratios of medians.", ""]
    if inputs:
        for i, d in enumerate(inputs, 1):
            lines += [f"Input {i}: `{d.get('path', '?')}`", ""] + environment(d) + [""]
        lines.append(f"- merged runs: {status_counts(doc.get('runs', []))}"
                     + (f"; {doc['replaced']} run(s) of an earlier input replaced by a later one's"
                        if doc.get("replaced") else ""))
    else:
        lines += environment(doc)
    bad = [r for r in doc.get("runs", []) if r.get("status") not in ("ok", None)]
    if bad:
        lines += ["", "Runs that did not finish:", ""]
        for r in bad:
            why = r.get("reason") or first_line(dig(r, "meta", "error")) or first_line(r.get("output_tail"), last=True)
            lines.append(f"- {r.get('name', '?')}: {r.get('status')}" + (f": {why}" if why else ""))
    return lines


def environment(doc: dict[str, Any]) -> list[str]:
    """One suite's GPU, versions, command, options and run counts, as list items."""
    env, smi, opts = doc.get("env") or {}, doc.get("nvidia_smi") or {}, doc.get("options") or {}
    visible = (doc.get("host") or {}).get("cuda_visible_devices") or env.get("cuda_visible_devices")
    first, reps = opts.get("first_repeat") or 0, opts.get("repeats", "?")
    if first and isinstance(reps, int):
        reps = f"{reps} (repeats {first}–{first + reps - 1})"
    planned = {p.get("workload") for p in doc.get("plan", [])} or {"gpt2", "resnet50"}
    train = []
    for w, ranges in SHAPE_RANGES.items():
        prefix = ranges[0][0].split("-")[0]
        if w in planned:
            train.append(f"{w} {opts.get(f'{prefix}_warmup', '?')} warm-up + {opts.get(f'{prefix}_steps', '?')} timed "
                         "steps, " + ", ".join(f"{n.split('-')[1]} {'–'.join(map(str, opts.get(n.replace('-', '_'), '?')))}"
                                               for n, *_ in ranges))
    workloads = opts.get("workloads")
    lines = [
        f"- GPU: {smi.get('name') or env.get('gpu') or 'unknown'}; driver {smi.get('driver_version') or 'unknown'}; "
        f"{fmt_bytes(number(env.get('gpu_memory')))}" + (f"; CUDA_VISIBLE_DEVICES={visible}" if visible else ""),
        f"- torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', '?')}), transformers "
        f"{env.get('transformers', '?')}, torchvision {env.get('torchvision', '?')}, Python {env.get('python', '?')}",
        f"- date: {doc.get('started', '?')} (UTC); suite wall time {fmt(number(doc.get('elapsed_s')), 0)} s "
        f"of a {fmt(number(doc.get('budget_s')), 0)} s budget",
        f"- command: `{doc.get('command', '?')}`",
        "- options: " + (f"workloads {','.join(workloads)}; " if isinstance(workloads, list) else "")
        + f"repeats {reps}; " + "; ".join(train) + f"; mem_get_info sampled every {opts.get('sample_ms', '?')} ms"
        + (f"; GOALLOC_CONF `{opts['goalloc_conf']}`" if opts.get("goalloc_conf") else "; goalloc's default configuration")
        + "".join(f"; {name} adds `{conf}`" for name, conf in (opts.get("variants") or {}).items()),
        f"- runs: {status_counts(doc.get('runs', []))}"
        + (f"; repository commit {doc['git_commit']}" if doc.get("git_commit") else "")
        + library_built(doc),
    ]
    return lines


def library_built(doc: dict[str, Any]) -> str:
    """What the input says of the goalloc library its runs loaded: the commit Go stamped it with,
    when it differs from the repository's or was built with changes not committed."""
    lib = doc.get("goalloc_library")
    if not isinstance(lib, dict) or not lib.get("revision"):
        return ""
    rev, repo = str(lib["revision"]), str(doc.get("git_commit") or "")
    dirty = lib.get("modified") == "true"
    if rev == repo and not dirty:
        return ""
    return f"; goalloc's library built at {rev[:12]}" + (" with changes not committed" if dirty else "")


def train_aggs(doc: dict[str, Any], workload: str, config: str) -> dict[str, Agg]:
    runs = runs_of(doc, workload, config)
    return {"speed": collect(runs, lambda r: r.get("units_per_s")),
            "memory": collect(runs, lambda r: memory_of_record(config, r)),
            "device": collect(runs, lambda r: dig(r, "device", "peak_over_baseline")),
            "live": collect(runs, lambda r: dig(r, "allocator", "allocated_peak")),
            "step": collect(runs, lambda r: r.get("median_step_s"))}


MODELS = {"gpt2": "`transformers.GPT2LMHeadModel(GPT2Config())`, AdamW",
          "llama": "`transformers.LlamaForCausalLM`, 12 layers, hidden 2048, 16 query heads sharing 4 key/value "
                   "heads, AdamW",
          "resnet50": "`torchvision.models.resnet50(weights=None)`, channels_last, SGD with momentum",
          "rollout": "3 `generate` calls from the LLaMA with 10 layers, then AdamW with activation checkpointing "
                     "on the rows generated, in micro-batches of varied size: an iteration a step",
          "checkpoint": "the LLaMA under FSDP (`fully_shard` per layer, bf16) in a group of one, checkpointed, AdamW",
          "serving": "the LLaMA in bf16, `generate` for requests of varied batch, prompt and generated length",
          "moe": "4 layers of 16 SwiGLU experts, top-2 routing, a router bias drawn per step, AdamW"}


def section_train(doc: dict[str, Any], workload: str, label: str, unit: str, heading: str) -> list[str]:
    configs = present_configs(doc, workload)
    lines = [f"## {heading}. " + ("" if workload == "serving" else "Training: ") + label, "",
             f"{MODELS[workload]}; random init, bf16 autocast, a shape drawn per step (the same for every",
             "configuration of a repeat)" + ("; every shape first trained once untimed (`--plan-shapes`)."
                                             if any(dig(r, "result", "planned_shapes") for r in runs_of(doc, workload))
                                             else "."),
             "Throughput over the timed steps. Peak device memory on each configuration's basis; 'device",
             "peak over idle' by the driver's count (`mem_get_info`, sampled); peak live: allocated bytes.", ""]
    aggs = {c: train_aggs(doc, workload, c) for c in configs}
    base = aggs.get("native")
    apart = [c for c in configs if suites_differ(doc, workload, c)]
    rows = []
    for c, a in aggs.items():
        rows.append([c, fmt_spread(a["speed"], lambda v: fmt(v, 0)),
                     "—" if c in apart else fmt_x(ratio(a["speed"].median, base["speed"].median if base else None)),
                     fmt_bytes(a["memory"].median), fmt_x(ratio(a["memory"].median, a["live"].median)),
                     fmt_x(ratio(a["memory"].median, base["memory"].median if base else None)),
                     fmt_bytes(a["device"].median), fmt_bytes(a["live"].median),
                     MEMORY_BASIS.get(base_config(c), "torch max reserved")])
    lines += table(["config", unit, "× native", "peak device memory", "÷ peak live", "× native",
                    "device peak over idle", "peak live", "basis"], rows)
    if apart:
        lines += ["", f"—: no throughput ratio for {', '.join(apart)}: native's runs of the same repeats come from "
                      "other suites, not interleaved with these."]
    lines += per_repeat_table(doc, workload, configs)
    miss = miss_latency_table(doc, workload, [c for c in configs if is_goalloc(c)])
    return lines + ([""] + miss if miss else [])


def live_ratio(config: str, result: dict[str, Any]) -> Optional[float]:
    """A run's peak device memory (memory_of_record) over its peak live."""
    return ratio(number(memory_of_record(config, result)), number(dig(result, "allocator", "allocated_peak")))


def per_repeat_table(doc: dict[str, Any], workload: str, configs: list[str]) -> list[str]:
    """Peak memory over peak live by repeat: a repeat draws the same shapes
    in every configuration, so a column compares the allocators on one
    run's shapes where the medians mix several (nothing with one repeat)."""
    by = {c: by_repeat(doc, workload, c, live_ratio) for c in configs}
    reps = sorted({k for v in by.values() for k in v if isinstance(k, int)})
    if len(reps) < 2:
        return []
    rows = [[c] + [fmt(by[c].get(k), 4) for k in reps] for c in configs]
    return ["", "Peak device memory ÷ peak live, by repeat (the same shapes across a column):", ""] + \
        table(["config"] + [f"repeat {k}" for k in reps], rows)


def timed_driver(result: dict[str, Any], key: str) -> Optional[float]:
    """What goalloc's driver totals (logged after every step: "ns", "calls",
    "unmaps", "creates") grew by over the timed steps; None without them."""
    log = result.get("step_log") or []
    total, seen = 0.0, False
    for prev, e in zip(log, log[1:]):
        a, b = dig(prev, "goalloc_driver", key), dig(e, "goalloc_driver", key)
        if e.get("timed") and number(a) is not None and number(b) is not None:
            total, seen = total + b - a, True
    return total if seen else None


def miss_latency_table(doc: dict[str, Any], workload: str, configs: list[str]) -> list[str]:
    """goalloc's cache misses (its calls to its memory source): how many and
    how long, per goalloc configuration, and the driver's share of the timed
    steps where the runs logged it."""
    if not configs:
        return []
    aggs = {}
    for c in configs:
        runs = runs_of(doc, workload, c)
        a = {"count": collect(runs, lambda r: dig(r, "allocator", "device_alloc_ns", "count"))}
        for k in ("p50", "p99", "max"):
            a[k] = collect(runs, lambda r, k=k: dig(r, "allocator", "device_alloc_ns", k), 1e-3)
        a["driver_ms"] = collect(runs, lambda r: timed_driver(r, "ns"), 1e-6)
        a["moves"] = collect(runs, lambda r: timed_driver(r, "unmaps"))
        aggs[c] = a
    if all(a["count"].n == 0 for a in aggs.values()):
        return ["Cache-miss latency: not reported (the library of these runs has no `goalloc.device_alloc_ns.*`",
                "counters in `goalloc.memory_stats`)."]
    lines = ["Cache misses: goalloc's calls to its memory source over the whole run (`goalloc.device_alloc_ns.*`),",
             "medians over the repeats.", ""]
    rows = [[c, fmt_spread(a["count"], lambda v: fmt(v, 0)), fmt(a["p50"].median, 1), fmt(a["p99"].median, 1),
             fmt(a["max"].median, 1)] for c, a in aggs.items()]
    head = ["config", "misses", "p50 µs", "p99 µs", "max µs"]
    if any(a["driver_ms"].n for a in aggs.values()):
        lines[2:2] = ["The last two columns: the timed steps' driver calls (`goalloc.driver.*` after every step), "
                      "their time and the handles unmapped."]
        head += ["driver ms, timed steps", "unmaps, timed steps"]
        for row, a in zip(rows, aggs.values()):
            row += [fmt(a["driver_ms"].median, 1), fmt(a["moves"].median, 0)]
    return lines + table(head, rows)


# --- goals ---------------------------------------------------------------------------


def goals(doc: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The goals section, and the goals as data."""
    lines = ["## Goals", "", "Computed from the tables above (medians of the same run).", ""]
    data: list[dict[str, Any]] = []

    def add(name: str, ok: Optional[bool], text: str) -> None:
        data.append({"goal": name, "met": ok, "text": text})
        lines.append(f"- {name}: {({True: '**met**', False: '**missed**', None: '**not measured**'})[ok]}. {text}")

    planned = {p.get("workload") for p in doc.get("plan", [])}
    for workload, label, unit in TRAIN:
        if workload in planned:
            train_goals(doc, workload, label, unit, add, lines)
    counts = [sum(d["met"] is v for d in data) for v in (True, False, None)]
    lines += ["", f"{counts[0]} met, {counts[1]} missed, {counts[2]} not measured."]
    return lines, data


def best_goalloc(doc: dict[str, Any], workload: str) -> tuple[Optional[str], dict[str, dict[str, Agg]]]:
    """The goalloc configuration of the lowest median peak memory over the
    repeats both ran (on a tie the default backend's), and the figures of
    each that ran; None when neither has memory figures."""
    present = present_configs(doc, workload)
    aggs = {c: train_aggs(doc, workload, c) for c in GOALLOC_CONFIGS if c in present}
    measured = [c for c, a in aggs.items() if a["memory"].median is not None]
    if len(measured) < 2:
        return (measured[0] if measured else None), aggs
    other = next(c for c in measured if c != DEFAULT_GOALLOC)
    mine, theirs, _ = memory_medians(doc, workload, DEFAULT_GOALLOC, other)
    if mine is None or theirs is None:
        return DEFAULT_GOALLOC, aggs
    return (other if theirs < mine else DEFAULT_GOALLOC), aggs


def train_goals(doc: dict[str, Any], workload: str, label: str, unit: str,
                add: Callable[[str, Optional[bool], str], None], lines: list[str]) -> None:
    """A training workload's goals: the better goalloc configuration's peak
    memory over peak live and below every other configuration's, goalloc
    (backend:async) against torch's cudaMallocAsync, and throughput against native."""
    goal = GOAL_MEMORY_OVER_LIVE.get(workload, 1.03)
    best, cands = best_goalloc(doc, workload)
    g = cands.get(best) if best else None
    mem = g["memory"].median if g else None
    name = f"{label} peak memory ≤ {goal:.2f} × peak live"
    r = ratio(mem, g["live"].median) if g else None
    if g is None or r is None:
        add(name, None, "No goalloc figures.")
    else:
        how = (f"{best} (the better goalloc configuration) {fmt_bytes(mem)} over peak live "
               f"{fmt_bytes(g['live'].median)} = {r:.3f}×" + ("" if r <= goal else f", {pct(r / goal)} over the goal"))
        for c, a in cands.items():
            rc = ratio(a["memory"].median, a["live"].median)
            if c != best and rc is not None:
                how += f"; {c} {fmt_bytes(a['memory'].median)}, {rc:.3f}×"
        add(name, r <= goal, how + ".")
        lines.extend(breakdown(doc, workload, best))
    others = ["native", "expandable", "async"]
    # goalloc-vmm's variants are goalloc's own settings, not rivals.
    for other in others + [c for c in present_configs(doc, workload) if c not in others and not is_goalloc(c)]:
        mine, theirs, note = memory_medians(doc, workload, best, other) if best else (None, None, "")
        rr = ratio(mine, theirs)
        name = f"{label} peak memory below {other}"
        if rr is None:
            add(name, None, f"No figures for goalloc or {other}.")
            continue
        dev_r = ratio(*memory_medians(doc, workload, best, other, device_peak)[:2])
        extra = "" if dev_r is None else f"; by the driver's count (device peak over idle), {dev_r:.3f}×"
        add(name, rr < 1, f"{best} {fmt_bytes(mine)} vs {other} {fmt_bytes(theirs)}{note}: {rr:.3f}× ({pct(rr)}){extra}.")
    ga, asy, note = memory_medians(doc, workload, "goalloc", "async")
    ra = ratio(ga, asy)
    add(f"{label} goalloc (backend:async) peak memory ≤ async", None if ra is None else ra <= 1,
        "No figures for goalloc or async." if ra is None else
        f"goalloc {fmt_bytes(ga)} vs async (torch's cudaMallocAsync) {fmt_bytes(asy)}{note}: {ra:.3f}× ({pct(ra)}).")
    n = train_aggs(doc, workload, "native")
    name = f"{label} throughput ≥ {GOAL_THROUGHPUT_VS_NATIVE:.2f} × native"
    apart = g is not None and suites_differ(doc, workload, best)
    rs = ratio(g["speed"].median, n["speed"].median) if g and not apart else None
    # Runs in lockstep decide where they were made: they share the host's state.
    lock = lockstep_goal(doc, workload, best or DEFAULT_GOALLOC)
    if (g is None or rs is None) and lock is None:
        add(name, None, f"No ratio: {best}'s runs and native's of the same repeats come from different suites, "
                        "not interleaved, and none ran in lockstep." if apart else "No figures for goalloc or native.")
        return
    decided = lock[0] if lock else rs
    assert decided is not None
    ok = decided >= GOAL_THROUGHPUT_VS_NATIVE
    under = f", {(GOAL_THROUGHPUT_VS_NATIVE - decided) * 100:.1f} points under the goal"
    parts = [lock[1] + ("" if ok else under)] + ([lock[2]] if lock[2] else []) if lock else []
    if g is not None and rs is not None:
        how = (("in the suite's runs, one after another, " if lock else "")
               + f"{best} {fmt(g['speed'].median, 0)} vs native {fmt(n['speed'].median, 0)} {unit} = {rs:.3f}×")
        if not ok and not lock:
            how += under
            if g["step"].median is not None and n["step"].median is not None:
                how += f"; median step {g['step'].median * 1e3:.1f} ms vs {n['step'].median * 1e3:.1f} ms"
        paired = paired_speed_ratios(doc, workload, best)
        if paired:
            how += (f"; per repeat, on the same shapes, {', '.join(f'{x:.3f}' for x in paired)}× "
                    f"(median {Agg(paired).median:.3f}×)")
        for c, a in cands.items():
            rc = ratio(a["speed"].median, n["speed"].median)
            if c != best and rc is not None and not suites_differ(doc, workload, c):
                how += f"; {c} {rc:.3f}×"
        parts.append(how)
    elif apart:
        parts.append(f"the suites' runs of {best} and native come from different suites: no ratio")
    add(name, ok, "; ".join(parts) + ".")


def breakdown(doc: dict[str, Any], workload: str, config: str) -> list[str]:
    """Where a goalloc configuration's peak memory goes, from its own
    counters: differences of peaks (medians), a guide to the layers."""
    runs = runs_of(doc, workload, config)

    def med(*path: str) -> Optional[float]:
        return collect(runs, lambda r: dig(r, *path)).median

    pool, alloc, req = med("allocator", "pool_reserved_max_read"), med("allocator", "allocated_peak"), \
        med("allocator", "requested_peak")
    # goalloc's own reserved peak: its own key where the library has it (with
    # backend:vmm reserved_bytes.all is the physical memory).
    own = med("allocator", "stats", "goalloc.own_reserved_bytes.peak")
    res = own if own is not None else med("allocator", "reserved_peak")
    parts = []
    if pool is not None and res is not None:
        source = "mapped physical memory" if base_config(config) == "goalloc-vmm" else "driver pool"
        parts.append(f"{source} over goalloc's own reserved peak {fmt_bytes(pool - res)}")
    if res is not None and alloc is not None:
        parts.append(f"goalloc reserved over allocated peak (cache and segment slack) {fmt_bytes(res - alloc)}")
    if alloc is not None and req is not None:
        parts.append(f"allocated over requested peak (rounding) {fmt_bytes(alloc - req)}")
    lines = [f"  - where {config}'s goes (its own counters; differences of peaks): " + "; ".join(parts) + "."] \
        if parts else []
    # The same at the device's own peak (DeviceMemory's at_peak): read
    # together, so the parts add up to what the device held then.
    used, held, own, alloc = (med("device", "at_peak", k) for k in ("used_over_baseline", "held", "own", "allocated"))
    at = [(label, a - b) for label, a, b in (("outside the allocator", used, held),
                                            ("mapped between goalloc's blocks", held, own),
                                            ("goalloc's cache and slack", own, alloc)) if a is not None and b is not None]
    shared, spans = med("device", "at_peak", "held_split", "free_shared"), med("device", "at_peak", "held_split", "free_spans")
    if shared is not None and spans is not None:
        at.append((f"of that mapped, free ends of handles shared with live memory ({spans:.0f} free spans)", shared))
    if at:
        lines.append(f"  - at the device's peak ({fmt_bytes(used)} over the idle process; medians): "
                     + "; ".join(f"{label} {fmt_bytes(v)}" for label, v in at) + ".")
    # goalloc-vmm's own split, taken by the device when held last peaked.
    peak = {k: med("allocator", "held_split_at_peak", k)
            for k in ("held", "live", "free_shared", "free_spans", "free_whole", "pending", "free_beside_small")}
    if peak["held"] is not None and peak["live"] is not None:
        parts = [f"live spans {fmt_bytes(peak['live'])}"]
        if peak["free_shared"] is not None:
            small = ("" if peak["free_beside_small"] is None else
                     f"; {fmt_bytes(peak['free_beside_small'])} of it beside live blocks under 1 MiB")
            parts.append(f"free ends of handles shared with live memory {fmt_bytes(peak['free_shared'])} "
                         f"({peak['free_spans'] or 0:.0f} free spans{small})")
        parts += [f"{label} {fmt_bytes(peak[k])}" for label, k in (("whole free handles", "free_whole"),
                                                                      ("pending", "pending")) if peak[k]]
        lines.append(f"  - when {config} held its most ({fmt_bytes(peak['held'])}; the device's own split, "
                     "medians): " + "; ".join(parts) + ".")
    return lines


# --- training in lockstep (bench/lockstep.py) -----------------------------------------


def lockstep_groups(doc: dict[str, Any]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """The lockstep inputs' compared repeats by (workload, A, B); each one's "compare" is B's against A's."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for ls in doc.get("lockstep", []):
        pair = list(ls.get("pair") or [])
        if len(pair) == 2:
            groups.setdefault((str(ls.get("workload")), pair[0], pair[1]), []).extend(
                p for p in ls.get("pairs", []) if p.get("status") == "ok" and p.get("compare") and "error" not in p["compare"])
    return {k: v for k, v in groups.items() if v}


def lockstep_summary(compares: list[dict[str, Any]]) -> str:
    """B's throughput over A's, median (min–max, n), and B faster in k of n."""
    t = Agg([c["throughput"] for c in compares])
    faster = sum(1 for c in compares if c["throughput"] > 1)
    return f"{t.median:.3f}× ({t.lo:.3f}–{t.hi:.3f}, n={t.n}; faster in {faster} of {t.n})"


def section_lockstep(doc: dict[str, Any]) -> list[str]:
    lines = ["### Training in lockstep", "",
             "`bench/lockstep.py`: the two configurations of a repeat in two processes on one GPU, taking turns",
             "step by step. Per repeat B's throughput over A's and the median of A's step time over B's; over",
             "the repeats, medians (min–max, n). A pair of one configuration shows the method's own spread.", ""]
    for i, ls in enumerate(doc.get("lockstep", []), 1):
        host, opts, pairs = ls.get("host") or {}, ls.get("options") or {}, ls.get("pairs", [])
        ok = len([p for p in pairs if p.get("status") == "ok"])
        lines += [f"Lockstep input {i}: `{ls.get('path', '?')}`", "", f"- command: `{ls.get('command', '?')}`",
                  f"- date: {ls.get('started', '?')}; CPUs {','.join(map(str, host.get('cpus_allowed') or [])) or '?'} of "
                  f"{host.get('cpus', '?')}; repository commit {ls.get('git_commit', '?')}{library_built(ls)}",
                  f"- options: workload {ls.get('workload')}; repeats {opts.get('first_repeat', '?')}–"
                  f"{(opts.get('first_repeat') or 0) + (opts.get('repeats') or 0) - 1}; "
                  f"{ok} compared, {len(pairs) - ok} not", ""]
    rows = []
    for (workload, a, b), pairs in lockstep_groups(doc).items():
        cs = [p["compare"] for p in pairs]
        sm = Agg([c["step_median"] for c in cs])
        ma, mb = (Agg([c["median_step_s"][k] for c in cs]).median for k in ("a", "b"))
        rows.append([workload, f"{b} against {a}", lockstep_summary(cs), f"{sm.median:.3f}× ({sm.lo:.3f}–{sm.hi:.3f})",
                     f"{ma * 1e3:.2f} ms", f"{mb * 1e3:.2f} ms"])
    return lines + table(["workload", "B against A", "throughput, B over A", "step median, A's over B's",
                          "A's median step", "B's median step"], rows)


def lockstep_goal(doc: dict[str, Any], workload: str, config: str) -> Optional[tuple[float, str, str]]:
    """config against native in lockstep, where an input has it: the median
    of the repeats' throughput ratios, its text, and the method's own spread
    (native against native) where that ran too."""
    groups = lockstep_groups(doc)
    cs, aa = ([p["compare"] for p in groups.get((workload, "native", c), [])] for c in (config, "native"))
    if not cs:
        return None
    return (Agg([c["throughput"] for c in cs]).median, f"In lockstep with native, {config} {lockstep_summary(cs)}",
            f"native against native in lockstep, {lockstep_summary(aa)}" if aa else "")


# --- bench/multigpu.sh's runs (bench/multigpu_render.py) -------------------------------

MULTIGPU = {"ddp": "DDP, 2 ranks", "fsdp": "FSDP, 2 ranks", "mp": "model parallel, 2 GPUs in one process"}


def multigpu_tables(records: list[dict[str, Any]]) -> list[str]:
    """bench/multigpu.sh's runs as BENCHMARKS.md's tables: per workload,
    allocator and rank (device, for the model-parallel run), the medians over
    rounds of tokens/s and of peak device memory (mem_get_info over the idle
    process) against peak live, and both against native's."""
    runs: dict[tuple[str, str, int], list[tuple[float, float, float]]] = collections.defaultdict(list)
    for r in records:
        for d in (0, 1) if r["workload"] == "mp" else (r["rank"],):
            used, live = ((r[k][d] if r["workload"] == "mp" else r[k]) for k in ("peak_device_used", "peak_allocated"))
            runs[(r["workload"], r["allocator"], d)].append((r["tokens_per_s"], used, live))
    med = {k: [Agg(list(x)).median for x in zip(*v)] + [len(v)] for k, v in runs.items()}
    lines = []
    for w, name in MULTIGPU.items():
        rows = [[a, str(d), str(m[3]), fmt(m[0], 0), f"{m[0] / n[0]:.3f}", fmt_bytes(m[1]), fmt_bytes(m[2]),
                 f"{m[1] / m[2]:.3f}", f"{m[1] / n[1]:.3f}"]
                for a in ("native", "expandable", "goalloc") for d in (0, 1)
                for m, n in [(med.get((w, a, d)), med.get((w, "native", d)))] if m and n]
        lines += ["", f"**{name}**", ""] + table(["allocator", "rank/device", "runs", "tokens/s (median)", "vs native",
                                                  "peak device", "peak live", "device / live", "device vs native"], rows)
    return lines


# --- the document, merging, keeping ---------------------------------------------------


def render(doc: dict[str, Any]) -> str:
    lines = section_header(doc)
    planned = {p.get("workload") for p in doc.get("plan", [])} | {r.get("workload") for r in doc.get("runs", [])}
    for i, (workload, label, unit) in enumerate(TRAIN):
        if workload in planned:
            lines += [""] + section_train(doc, workload, label, unit, "3" + "abcdefg"[i])
    if doc.get("lockstep"):
        lines += [""] + section_lockstep(doc)
    return "\n".join(lines + [""] + goals(doc)[0]) + "\n"


def run_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r.get("workload"), r.get("config"), r.get("repeat"), r.get("trace"))


def merge(docs: list[dict[str, Any]], paths: list[str],
          warn: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Several bench.json as one: every input's runs and plan, a run two
    inputs have taken from the later (and warn says so), each input's
    environment under "inputs". One input is returned as it is, but for the
    suite of each run of a merged one (suite_in)."""
    if len(docs) == 1:
        d = docs[0]
        return d | {"runs": [r | {"suite": suite_in(d, r)} for r in d.get("runs", [])]} if d.get("inputs") else d
    runs: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
    plan: dict[tuple[Any, ...], dict[str, Any]] = {}
    replaced = 0
    first = 0  # the index, among the merged inputs, of this document's first input
    for i, (doc, path) in enumerate(zip(docs, paths)):
        for r in doc.get("runs", []):
            r = r | {"suite": first + suite_in(doc, r)}
            k = run_key(r)
            if k in runs:
                j, old = runs[k]
                replaced += 1
                warn(f"render: run {r.get('name', k)} is in {paths[j]} ({old.get('status')}) and in {path} "
                     f"({r.get('status')}): keeping {path}'s")
            runs[k] = (i, r)
        plan.update((run_key(p), p) for p in doc.get("plan", []))
        first += len(doc.get("inputs") or [doc])
    # A merged or kept document brings its own inputs, lockstep runs and
    # history, so that a kept file given again with new suites still names
    # every suite's command and decides with its lockstep runs.
    inputs = [x for d, p in zip(docs, paths)
              for x in (d["inputs"] if d.get("inputs") else
                        [{k: v for k, v in d.items() if k not in ("runs", "plan")}
                         | {"path": p, "runs": d.get("runs", []), "plan": d.get("plan", [])}])]
    return {"schema": 1, "inputs": inputs, "replaced": replaced, "runs": [r for _, r in runs.values()],
            "plan": list(plan.values()), "lockstep": [ls for d in docs for ls in d.get("lockstep") or []],
            "kept_from": [k for d in docs for k in [dig(d, "produced_by", "kept")] if k]}


def suite_in(doc: dict[str, Any], run: dict[str, Any]) -> int:
    """The index, among doc's inputs, of the suite run came from: 0 for a
    suite's own bench.json; in a merged document, the run's "suite", or
    for a document kept before runs had one, the last input that names the
    run (a later input's run replaced an earlier one's)."""
    inputs = doc.get("inputs")
    if not inputs:
        return 0
    if isinstance(run.get("suite"), int):
        return run["suite"]
    named = [i for i, d in enumerate(inputs) if any(x.get("name") == run.get("name") for x in d.get("runs", []))]
    return named[-1] if named else 0


# What keep() leaves of a run: the fields the sections above read.
KEEP_RUN = ("id", "name", "workload", "config", "repeat", "trace", "status", "reason", "command", "wall_s", "suite")
KEEP_RESULT = ("unit", "warmup", "steps", "planned_shapes", "timed_seconds", "timed_units", "units_per_s",
               "median_step_s", "losses_finite")
KEEP_ALLOCATOR = ("pool_reserved_max_read", "reserved_peak", "allocated_peak", "requested_peak", "device_alloc_ns",
                  "held_split_at_peak", "backend")


def pick(d: Any, keys: Iterable[str]) -> dict[str, Any]:
    return {k: d[k] for k in keys if isinstance(d, dict) and k in d}


def keep_result(res: Any) -> Any:
    """A run's result pruned to what render() reads."""
    if not isinstance(res, dict):
        return res
    out = pick(res, KEEP_RESULT)
    a = res.get("allocator") or {}
    out["allocator"] = pick(a, KEEP_ALLOCATOR)
    own = (a.get("stats") or {}).get("goalloc.own_reserved_bytes.peak")
    if own is not None:
        out["allocator"]["stats"] = {"goalloc.own_reserved_bytes.peak": own}
    out["device"] = pick(res.get("device"), ("peak_over_baseline", "baseline_used", "at_peak"))
    log = res.get("step_log") or []
    if any("goalloc_driver" in e for e in log):  # timed_driver's figures
        out["step_log"] = [{"timed": e.get("timed"), "goalloc_driver": pick(e.get("goalloc_driver"), ("ns", "unmaps"))}
                           for e in log]
    return out


def keep_lockstep(ls: dict[str, Any]) -> dict[str, Any]:
    """A lockstep.json with the pairs' comparisons and each side's steps,
    speed and CPU by thread (bench/lockstep.py report's figures)."""
    out = dict(ls, path=Path(str(ls.get("path", "?"))).name, pairs=[])
    for p in ls.get("pairs", []):
        q = pick(p, ("repeat", "status", "reason", "wall_s", "compare"))
        q["sides"] = [pick(side, ("label", "config", "name", "status"))
                      | ({"result": pick(side["result"], ("steps", "threads", "units_per_s", "median_step_s",
                                                          "pinned_threads"))}
                         if isinstance(side.get("result"), dict) else {})
                      for side in p.get("sides", [])]
        out["pairs"].append(q)
    return out


def keep(doc: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """doc (one suite or several merged, with its lockstep runs) pruned to
    what render() reads: the same tables from a fraction of the size."""
    plan_keys = ("workload", "config", "repeat", "trace")
    inputs = doc.get("inputs") or [doc]
    history = doc["kept_from"] if "kept_from" in doc else [k for k in [dig(doc, "produced_by", "kept")] if k]
    out: dict[str, Any] = {
        "about": "bench/render.py --keep: the runs of the inputs below (each with the command that produced it), "
                 "pruned to what bench/render.py reads; it renders the same tables alone.",
        "produced_by": {"suites": [d.get("command") for d in inputs],
                        "lockstep": [ls.get("command") for ls in doc.get("lockstep", [])],
                        "kept": "; then ".join([*history, "python3 bench/render.py " + " ".join(argv)])},
    }
    out |= {k: v for k, v in doc.items()
            if k not in ("runs", "plan", "inputs", "lockstep", "argv", "outdir", "kept_from", "produced_by")}
    out["runs"] = [pick(r, KEEP_RUN) | {"result": keep_result(r.get("result"))}
                   for r in doc.get("runs", [])]
    out["plan"] = [pick(p, plan_keys) for p in doc.get("plan", [])]
    if doc.get("inputs"):
        out["inputs"] = [{k: v for k, v in d.items() if k not in ("runs", "plan", "argv", "outdir")}
                         | {"path": Path(str(d.get("path", "?"))).name,
                            "runs": [pick(r, ("name", "status")) for r in d.get("runs", [])],
                            "plan": [pick(p, plan_keys) for p in d.get("plan", [])]} for d in doc["inputs"]]
    out["lockstep"] = [keep_lockstep(ls) for ls in doc.get("lockstep", [])]
    return out


def read_lockstep(path: str) -> Optional[dict[str, Any]]:
    return read_input(path, lambda d: isinstance(d, dict) and d.get("kind") == "lockstep",
                      "a bench/lockstep.py lockstep.json")


def read_input(path: str, valid: Callable[[Any], bool], what: str) -> Optional[dict[str, Any]]:
    """An input file's JSON object, or None after saying on stderr why not."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        print(f"render: cannot read {path}: {e}", file=sys.stderr)
        return None
    if not valid(d):
        print(f"render: {path} is not {what}", file=sys.stderr)
        return None
    return d


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", nargs="+", help="suites' bench.json files, merged (a run in two: the later one's)")
    ap.add_argument("--output", help="write the markdown to this file instead of stdout")
    ap.add_argument("--lockstep", action="append", default=[], metavar="FILE", help="a bench/lockstep.py lockstep.json")
    ap.add_argument("--keep", metavar="FILE", help="also write the runs (merged, with the lockstep runs) pruned to "
                                                   "what this renderer reads (bench/results/training.json)")
    args = ap.parse_args(argv)
    docs = [read_input(p, lambda d: isinstance(d, dict), "a suite's bench.json (not a JSON object)")
            for p in args.bench_json]
    if any(d is None for d in docs):
        return 1
    doc = merge(docs, args.bench_json)  # type: ignore[arg-type]
    doc["lockstep"] = list(doc.get("lockstep") or [])  # a kept document carries its own
    for path in args.lockstep:
        d = read_lockstep(path)
        if d is None:
            return 1
        doc["lockstep"].append(d | {"path": path})
    text = render(doc)
    if args.keep:
        kept = keep(doc, argv if argv is not None else sys.argv[1:])
        Path(args.keep).write_text(json.dumps(kept, separators=(",", ":")) + "\n")
        print(f"render: kept {len(kept['runs'])} runs in {args.keep}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
        print(f"render: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
