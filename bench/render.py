#!/usr/bin/env python3
"""Turn a benchmark suite's bench.json into markdown tables (BENCHMARKS.md quotes them).

    python3 bench/render.py OUTDIR/bench.json                 # markdown on stdout
    python3 bench/render.py OUTDIR/bench.json --output F.md   # write F.md
    python3 bench/render.py OUTDIR/bench.json --into F.md     # replace F.md's bench:begin..end section
    python3 bench/render.py OUTDIR/bench.json --unpack DIR    # one JSON file per run
    python3 bench/render.py A/bench.json B/bench.json --keep bench/results/training.json
    python3 bench/render.py A/bench.json B/bench.json         # several suites (GPUs, calls), merged

Every figure of the tables is computed here from the runs recorded in
bench.json (medians over repeats, ratios of medians, goals met or missed and
by how much). Standard library only.

Several bench.json files (suites run at once on different GPUs, or in
several calls with --first-repeat) render as one: their runs are merged, a
run is known by its workload, configuration, repeat and trace, and where two
files have the same run the later file's is kept (and stderr says so).

--lockstep FILE (bench/lockstep.py's lockstep.json, repeatable) adds the
runs made in lockstep: a table of them, and, where they paired native with
goalloc's configuration on a workload, the throughput goal of that workload
is judged by their median (the suite's own figure is given beside it).

--keep FILE writes the merged runs and lockstep runs, pruned to the fields
this renderer reads, as one JSON file that renders the same tables (what the
repository keeps: bench/results/training.json, which renders alone).

--notes FILE appends a hand-written closing note (the why of a missed goal,
from a profile) under the computed goals; it should carry no numbers of its
own: the computed sections above it have them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

CONFIGS = ("native", "expandable", "async", "goalloc", "goalloc-vmm", "goalloc-mempool", "c-floor")
# The configurations whose memory is goalloc's own (installed as torch's
# allocator); the goals take the better of them.
GOALLOC_INSTALLED = ("goalloc", "goalloc-vmm")
DEFAULT_GOALLOC = "goalloc-vmm"  # backend:vmm, goalloc's default backend
GOALLOC_CONFIGS = GOALLOC_INSTALLED + ("goalloc-mempool",)
PAIR_CASES = (("4KiB", "4 KiB"), ("1MiB", "1 MiB"), ("64MiB", "64 MiB"), ("burst64", "burst of 64 mixed"))
TRAIN = (("gpt2", "GPT-2 124M", "tokens/s"), ("llama", "LLaMA 672M (GQA)", "tokens/s"),
         ("resnet50", "ResNet-50", "images/s"))

# The project's goals (issue 13): peak device memory over peak live, per
# training workload; throughput against native; the pair cost against c-floor.
GOAL_MEMORY_OVER_LIVE = {"gpt2": 1.03, "llama": 1.03, "resnet50": 1.05}
GOAL_THROUGHPUT_VS_NATIVE = 0.98
GOAL_PAIR_VS_FLOOR = 1.10

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
    """The values of one metric over the repeats, and their median."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> Optional[float]:
        return float(statistics.median(self.values)) if self.values else None

    @property
    def lo(self) -> Optional[float]:
        return min(self.values) if self.values else None

    @property
    def hi(self) -> Optional[float]:
        return max(self.values) if self.values else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def runs_of(doc: dict[str, Any], workload: str, config: Optional[str] = None,
            trace: Optional[str] = None) -> list[dict[str, Any]]:
    """The recorded runs of a workload (and configuration, and trace) that left a result."""
    out = []
    for r in doc.get("runs", []):
        if r.get("workload") != workload or not isinstance(r.get("result"), dict):
            continue
        if config is not None and r.get("config") != config:
            continue
        if trace is not None and r.get("trace") != trace:
            continue
        out.append(r)
    return out


def paired_speed_ratios(doc: dict[str, Any], workload: str, config: str, base: str = "native") -> list[float]:
    """config's throughput over base's, repeat by repeat: each repeat draws its
    own shapes, the same for every configuration, so these ratios compare
    the same work (in repeat order; repeats missing either are left out)."""
    def speeds(c: str) -> dict[Any, float]:
        out = {}
        for r in runs_of(doc, workload, c):
            v = number(r["result"].get("units_per_s"))
            if v is not None:
                out[r.get("repeat")] = v
        return out
    a, b = speeds(config), speeds(base)
    both = sorted((k for k in a if k in b and b[k]), key=lambda k: k if isinstance(k, int) else -1)
    return [a[k] / b[k] for k in both]


def by_repeat(doc: dict[str, Any], workload: str, config: str,
              get: Callable[[str, dict[str, Any]], Any]) -> dict[Any, float]:
    """get(config, run result) by repeat, over the runs where it is a number."""
    out = {}
    for r in runs_of(doc, workload, config):
        v = number(get(config, r["result"]))
        if v is not None:
            out[r.get("repeat")] = v
    return out


def memory_medians(doc: dict[str, Any], workload: str, a: str, b: str,
                   get: Optional[Callable[[str, dict[str, Any]], Any]] = None
                   ) -> tuple[Optional[float], Optional[float], str]:
    """The medians of a's and b's peak memory (get: as the tables compare it,
    by default) for comparing them, and a note.

    Each repeat draws its own shapes, so its peak differs; when one of the two
    lacks a repeat the other ran (a run skipped for the budget), the medians
    are taken over the repeats both ran, and the note says which those are."""
    get = get or memory_of_record
    ma, mb = by_repeat(doc, workload, a, get), by_repeat(doc, workload, b, get)
    if not ma or not mb:
        return None, None, ""
    if set(ma) == set(mb):
        return Agg(list(ma.values())).median, Agg(list(mb.values())).median, ""
    both = sorted(k for k in ma if k in mb)
    if not both:
        return None, None, ""
    note = (f" (over the {len(both)} repeat(s) both ran, {', '.join(str(k) for k in both)}: "
            f"{a} ran {len(ma)}, {b} {len(mb)})")
    return Agg([ma[k] for k in both]).median, Agg([mb[k] for k in both]).median, note


def device_peak(_: str, result: dict[str, Any]) -> Any:
    """A run's device peak over idle (mem_get_info, sampled)."""
    return dig(result, "device", "peak_over_baseline")


def collect(runs: Iterable[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> Agg:
    """Agg of get(run["result"]) over the runs where it is a number.

    A run that failed part way still counts for the sections it finished
    (workloads.py writes a section only once it is complete).
    """
    vals = []
    for r in runs:
        v = number(get(r["result"]))
        if v is not None:
            vals.append(v)
    return Agg(vals)


def memory_of_record(config: str, result: dict[str, Any]) -> Any:
    """The 'peak device memory' of a training run, by configuration.

    goalloc: its driver pool's reserved high-water mark (the maximum of the
    readings taken after every step and at the end; the pool keeps what it
    reserved, release threshold at its maximum). goalloc-vmm: the physical
    memory it has mapped (the same readings: what its backend holds, which
    it reports as the pool's reserved bytes). torch's allocators: their
    max reserved. goalloc-mempool: torch's max reserved (torch's own segments
    plus the segments goalloc handed its pool). c-floor: what it holds from
    cuMemAlloc, at its peak.
    """
    a = result.get("allocator") or {}
    if config in GOALLOC_INSTALLED:
        return a.get("pool_reserved_max_read")
    return a.get("reserved_peak")


MEMORY_BASIS = {
    "goalloc": "driver pool reserved high-water mark",
    "goalloc-vmm": "physical memory mapped, high-water mark",
    "goalloc-mempool": "torch max reserved (its pool's segments come from goalloc)",
    "c-floor": "bytes held from cuMemAlloc, peak",
}


def basis(config: str) -> str:
    return MEMORY_BASIS.get(config, "torch max reserved")


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
    if a.n == 1:
        return f"{f(a.median)} (n=1)"
    return f"{f(a.median)} ({f(a.lo)}–{f(a.hi)}, n={a.n})"


def pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def present_configs(doc: dict[str, Any], workload: str) -> list[str]:
    """The configurations planned or run for a workload, in the standard order."""
    seen = {r.get("config") for r in doc.get("plan", []) + doc.get("runs", []) if r.get("workload") == workload}
    return [c for c in CONFIGS if c in seen] + sorted(c for c in seen if c not in CONFIGS and c)


# --- the sections -------------------------------------------------------------------


def section_header(doc: dict[str, Any]) -> list[str]:
    runs = doc.get("runs", [])
    inputs = doc.get("inputs")
    lines = [
        "# goalloc benchmarks",
        "",
        "Generated by `bench/render.py` from the suite's `bench.json`"
        + (f" files ({len(inputs)}, merged)" if inputs else "") + "; every number below",
        "comes from " + ("those runs" if inputs else "that run") + ". Re-run with the command"
        + ("s" if inputs else "") + " below, then render again (this file is",
        "replaced, not appended). Each workload ran in a fresh process per configuration and",
        "repeat, configurations interleaved in a rotated order; figures are medians over the",
        "repeats (min–max and n in brackets); ratios are ratios of medians.",
        "",
    ]
    if inputs:
        for i, d in enumerate(inputs, 1):
            lines += [f"Input {i}: `{d.get('path', '?')}`", ""] + environment(d) + dropped(d) + [""]
        counts = status_counts(runs)
        lines.append("- merged runs: " + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none")
                     + (f"; {doc['replaced']} run(s) of an earlier input replaced by a later one's"
                        if doc.get("replaced") else ""))
    else:
        lines += environment(doc) + dropped(doc)
    bad = [r for r in runs if r.get("status") not in ("ok", None)]
    if bad:
        lines += ["", "Runs that did not finish:", ""]
        for r in bad:
            why = r.get("reason") or first_line(dig(r, "meta", "error")) or first_line(r.get("output_tail"), last=True)
            lines.append(f"- {r.get('name', '?')}: {r.get('status')}" + (f": {why}" if why else ""))
    return lines


def dropped(doc: dict[str, Any]) -> list[str]:
    """The header's line on what --drop left out of one input, if anything."""
    return [f"- left out (`--drop`): {', '.join(doc['dropped'])}"] if doc.get("dropped") else []


def status_counts(runs: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    return counts


def environment(doc: dict[str, Any]) -> list[str]:
    """One suite's environment, options and run counts, as list items."""
    env = doc.get("env") or {}
    smi = doc.get("nvidia_smi") or {}
    opts = doc.get("options") or {}
    host = doc.get("host") or {}
    counts = status_counts(doc.get("runs", []))
    gpu = smi.get("name") or env.get("gpu") or "unknown"
    visible = host.get("cuda_visible_devices") or env.get("cuda_visible_devices")
    first = opts.get("first_repeat") or 0
    reps = opts.get("repeats", "?")
    if first and isinstance(reps, int):
        reps = f"{reps} (repeats {first}–{first + reps - 1})"
    workloads = opts.get("workloads")
    planned = {p.get("workload") for p in doc.get("plan", [])}
    train = []
    if "gpt2" in planned or not planned:
        train.append(f"GPT-2 {opts.get('gpt2_warmup', '?')} warm-up + {opts.get('gpt2_steps', '?')} timed steps, "
                     f"batch {rng(opts.get('gpt2_batch'))}, sequence {rng(opts.get('gpt2_seq'))}")
    if "llama" in planned:
        train.append(f"LLaMA {opts.get('llama_warmup', '?')} + {opts.get('llama_steps', '?')} steps, "
                     f"batch {rng(opts.get('llama_batch'))}, sequence {rng(opts.get('llama_seq'))}")
    if "resnet50" in planned or not planned:
        train.append(f"ResNet-50 {opts.get('resnet_warmup', '?')} + {opts.get('resnet_steps', '?')} steps, "
                     f"batch {rng(opts.get('resnet_batch'))}, {rng(opts.get('resnet_res'))} px")
    lines = [
        f"- GPU: {gpu}; driver {smi.get('driver_version') or env.get('cuda_driver') or 'unknown'}; "
        f"{fmt_bytes(number(env.get('gpu_memory')))}"
        + (f"; CUDA_VISIBLE_DEVICES={visible}" if visible else ""),
        f"- torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', '?')}), transformers "
        f"{env.get('transformers', '?')}, torchvision {env.get('torchvision', '?')}, Python {env.get('python', '?')}",
        f"- date: {doc.get('started', '?')} (UTC); suite wall time {fmt(number(doc.get('elapsed_s')), 0)} s "
        f"of a {fmt(number(doc.get('budget_s')), 0)} s budget",
        f"- command: `{doc.get('command', '?')}`",
        f"- options: " + (f"workloads {','.join(workloads)}; " if isinstance(workloads, list) else "")
        + f"repeats {reps}; " + "; ".join(train) + f"; mem_get_info sampled every {opts.get('sample_ms', '?')} ms"
        + (f"; GOALLOC_CONF `{opts['goalloc_conf']}`" if opts.get("goalloc_conf") else "; goalloc's default configuration"),
        "- runs: " + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none")
        + (f"; repository commit {doc['git_commit']}" if doc.get("git_commit") else ""),
    ]
    for when, key in (("before", "nvidia_smi"), ("after", "nvidia_smi_end")):
        g = doc.get(key) or {}
        if g.get("clocks.sm") or g.get("temperature.gpu"):
            lines.append(f"- GPU {when} the runs (nvidia-smi): SM clock {g.get('clocks.sm', '?')} MHz of "
                         f"{g.get('clocks.max.sm', '?')}, memory clock {g.get('clocks.mem', '?')} MHz, "
                         f"{g.get('temperature.gpu', '?')} °C, power limit {g.get('power.limit', '?')} W")
    cf = doc.get("cfloor") or {}
    if cf and not cf.get("ok"):
        lines.append(f"- c-floor did not build: {first_line(cf.get('error'))}")
    return lines


def rng(v: Any) -> str:
    if isinstance(v, (list, tuple)) and len(v) == 2:
        return f"{v[0]}–{v[1]}"
    return "?"


def first_line(s: Any, last: bool = False) -> str:
    if not isinstance(s, str) or not s.strip():
        return ""
    lines = [ln.strip() for ln in s.strip().splitlines() if ln.strip()]
    line = lines[-1] if last else lines[0]
    return line[:200].replace("|", "/")


def section_pairs(doc: dict[str, Any]) -> list[str]:
    configs = present_configs(doc, "micro")
    lines = ["## 1. Alloc+free pairs through `torch.empty`", "",
             "Microseconds per pair (a tensor made and freed at once in a Python loop; a burst makes 64",
             "tensors of mixed sizes, then frees them in a shuffled order, and counts 64 pairs). Device",
             "allocs: how many times the allocator went to the driver during the timed rounds (median).", ""]
    rows = []
    for key, label in PAIR_CASES:
        base = collect(runs_of(doc, "micro", "native"), lambda r, k=key: dig(r, "pairs", k, "us_per_pair")).median
        floor = collect(runs_of(doc, "micro", "c-floor"), lambda r, k=key: dig(r, "pairs", k, "us_per_pair")).median
        for c in configs:
            runs = runs_of(doc, "micro", c)
            a = collect(runs, lambda r, k=key: dig(r, "pairs", k, "us_per_pair"))
            d = collect(runs, lambda r, k=key: dig(r, "pairs", k, "device_allocs_during"))
            rows.append([label, c, fmt_spread(a, fmt), fmt_x(ratio(a.median, base)), fmt_x(ratio(a.median, floor)),
                         fmt(d.median, 0)])
    lines += table(["size", "config", "µs per pair", "× native", "× c-floor", "device allocs"], rows)
    return lines


def section_cross(doc: dict[str, Any]) -> list[str]:
    configs = present_configs(doc, "micro")
    lines = ["## 2. Cross-stream producer/consumer", "",
             "Every iteration a producer stream allocates buffers of "
             + cross_sizes(doc) + " and fills them; a consumer stream reads them",
             "after it; `record_stream` marks them, and the producer frees them at once. Throughput in",
             "iterations per second; memory: peak reserved on the basis of the training tables (goalloc:",
             "its driver pool; goalloc-vmm: the physical memory it mapped), the driver's peak in use (`mem_get_info`) over the idle baseline, and the",
             "peak of live bytes. 'correct': the consumer's sums came out exact in every run (a buffer",
             "reused too early breaks them).", ""]
    base = collect(runs_of(doc, "micro", "native"), lambda r: dig(r, "cross_stream", "iterations_per_s")).median
    floor = collect(runs_of(doc, "micro", "c-floor"), lambda r: dig(r, "cross_stream", "iterations_per_s")).median
    rows = []
    for c in configs:
        runs = [r for r in runs_of(doc, "micro", c) if dig(r["result"], "cross_stream") is not None]
        it = collect(runs, lambda r: dig(r, "cross_stream", "iterations_per_s"))
        res = collect(runs, lambda r, c=c: memory_of_record(c, r["cross_stream"]))
        dev = collect(runs, lambda r: dig(r, "cross_stream", "device", "peak_over_baseline"))
        live = collect(runs, lambda r: dig(r, "cross_stream", "allocator", "allocated_peak"))
        correct = [dig(r["result"], "cross_stream", "correct") for r in runs]
        ok = "—" if not correct else ("yes" if all(x is True for x in correct) else
                                     f"NO ({sum(x is not True for x in correct)} of {len(correct)})")
        rows.append([c, fmt_spread(it, lambda v: fmt(v, 0)), fmt_x(ratio(it.median, base)),
                     fmt_x(ratio(it.median, floor)), fmt_bytes(res.median), fmt_bytes(dev.median),
                     fmt_bytes(live.median), ok])
    lines += table(["config", "iterations/s", "× native", "× c-floor", "peak reserved",
                    "device peak over idle", "peak live", "correct"], rows)
    return lines


def cross_sizes(doc: dict[str, Any]) -> str:
    for r in runs_of(doc, "micro"):
        b = dig(r["result"], "cross_stream", "buffers")
        if isinstance(b, list) and b:
            return ", ".join(fmt_bytes(float(x)) for x in b)
    return "several sizes"


def train_aggs(doc: dict[str, Any], workload: str, config: str) -> dict[str, Agg]:
    runs = runs_of(doc, workload, config)
    return {
        "speed": collect(runs, lambda r: r.get("units_per_s")),
        "memory": collect(runs, lambda r, c=config: memory_of_record(c, r)),
        "device": collect(runs, lambda r: dig(r, "device", "peak_over_baseline")),
        "live": collect(runs, lambda r: dig(r, "allocator", "allocated_peak")),
        "requested": collect(runs, lambda r: dig(r, "allocator", "requested_peak")),
        "reserved": collect(runs, lambda r: dig(r, "allocator", "reserved_peak")),
        "step": collect(runs, lambda r: r.get("median_step_s")),
    }


def section_train(doc: dict[str, Any], workload: str, label: str, unit: str, heading: str) -> list[str]:
    configs = present_configs(doc, workload)
    lines = [f"## {heading}. Training: {label}", ""]
    if workload == "gpt2":
        lines += ["`transformers.GPT2LMHeadModel(GPT2Config())`, random init, bf16 autocast, AdamW; batch and",
                  "sequence length drawn per step (the same draws for every configuration of a repeat)."]
    elif workload == "llama":
        lines += ["`transformers.LlamaForCausalLM`, 12 layers, hidden 2048, MLP 5632, 16 query heads sharing 4",
                  "key/value heads (grouped-query attention), vocabulary 32000; random init, bf16 autocast, AdamW;",
                  "batch and sequence length drawn per step (the same draws for every configuration of a repeat)."]
    else:
        lines += ["`torchvision.models.resnet50(weights=None)`, channels_last, bf16 autocast, SGD with momentum;",
                  "batch and resolution drawn per step (the same draws for every configuration of a repeat)."]
    if any((r.get("result") or {}).get("planned_shapes") for r in doc.get("runs", []) if r.get("workload") == workload):
        lines.append("Every run first took one untimed step of each shape it trains (`--plan-shapes`), so that")
        lines += (["cuDNN's planning of a new shape (100-250 ms on the host, the same under every allocator)",
                   "is out of the timed steps."] if workload == "resnet50" else
                  ["the first sight of a shape (130-150 ms longer than its later steps under every configuration,",
                   "median over an unplanned suite's runs on the H200) is out of the timed steps."])
    lines += ["Throughput over the timed steps (wall time between device synchronisations). Peak device",
              "memory, as compared here: goalloc, its driver pool's reserved high-water mark; goalloc-vmm,",
              "the high-water mark of the physical memory it mapped; torch's allocators, their max",
              "reserved (see 'basis'); 'device peak over idle' is the driver's count",
              "(`mem_get_info`, sampled) over the idle baseline for every configuration, which also holds",
              "the CUDA context's growth (lazily loaded kernels, library handles); peak live is the",
              "allocator's peak of allocated bytes.", ""]
    aggs = {c: train_aggs(doc, workload, c) for c in configs}
    base = aggs.get("native")
    floor = aggs.get("c-floor")  # c-floor trains only when --train-configs asks for it
    rows = []
    for c in configs:
        a = aggs[c]
        rows.append([
            c,
            fmt_spread(a["speed"], lambda v: fmt(v, 0)),
            fmt_x(ratio(a["speed"].median, base["speed"].median if base else None)),
        ] + ([fmt_x(ratio(a["speed"].median, floor["speed"].median))] if floor else []) + [
            fmt_bytes(a["memory"].median),
            fmt_x(ratio(a["memory"].median, a["live"].median)),
            fmt_x(ratio(a["memory"].median, base["memory"].median if base else None)),
            fmt_bytes(a["device"].median),
            fmt_bytes(a["live"].median),
            basis(c),
        ])
    lines += table(["config", unit, "× native"] + (["× c-floor"] if floor else []) +
                   ["peak device memory", "÷ peak live", "× native", "device peak over idle", "peak live", "basis"], rows)
    if "goalloc-mempool" in configs:
        lines += ["", "goalloc-mempool: `torch.cuda.use_mem_pool` routes the calling thread's allocations only;",
                  "autograd runs backward on its own thread, whose allocations go to torch's own allocator."]
    miss = miss_latency_table(doc, workload, [c for c in configs if c in GOALLOC_CONFIGS])
    if miss:
        lines += [""] + miss
    return lines


def miss_aggs(doc: dict[str, Any], workload: str, config: str) -> dict[str, Agg]:
    """The cache-miss latency figures of a configuration's runs: count, and
    p50, p99 and max in microseconds, each over the repeats."""
    runs = runs_of(doc, workload, config)
    out = {"count": collect(runs, lambda r: dig(r, "allocator", "device_alloc_ns", "count"))}
    for k in ("p50", "p99", "max"):
        out[k] = collect(runs, lambda r, k=k: us(dig(r, "allocator", "device_alloc_ns", k)))
    out["timed_driver_ms"] = collect(runs, lambda r: none_or(timed_driver(r, "ns"), lambda v: v / 1e6))
    out["timed_moves"] = collect(runs, lambda r: timed_driver(r, "unmaps"))
    return out


def none_or(v: Optional[float], f: Callable[[float], float]) -> Optional[float]:
    return None if v is None else f(v)


def timed_driver(result: dict[str, Any], key: str) -> Optional[float]:
    """How much of goalloc's driver profile (the step log's goalloc_driver
    totals, taken after every step: key "ns", "calls", "unmaps" or
    "creates") fell in the timed steps: the sum over timed steps of what
    each added to the step before it. None for runs that did not record it."""
    log = result.get("step_log") or []
    total, seen = 0.0, False
    for prev, e in zip(log, log[1:]):
        a, b = dig(prev, "goalloc_driver", key), dig(e, "goalloc_driver", key)
        if e.get("timed") and number(a) is not None and number(b) is not None:
            total += b - a
            seen = True
    return total if seen else None


def us(ns: Any) -> Optional[float]:
    v = number(ns)
    return None if v is None else v / 1e3


def miss_latency_table(doc: dict[str, Any], workload: str, configs: list[str]) -> list[str]:
    """The latency of goalloc's cache misses (its calls to its memory source:
    the driver pool for backend:async, mapping for backend:vmm), per goalloc
    configuration; [] when no goalloc configuration ran."""
    if not configs:
        return []
    lines = ["Cache-miss latency: how long goalloc's calls to its memory source took (its cache misses,",
             "over the whole run, warm-up included; `goalloc.device_alloc_ns.*` in `goalloc.memory_stats`),",
             "medians over the repeats, in microseconds.", ""]
    aggs = {c: miss_aggs(doc, workload, c) for c in configs}
    if all(a["count"].n == 0 for a in aggs.values()):
        return ["Cache-miss latency: not reported (the library of these runs has no `goalloc.device_alloc_ns.*`",
                "counters in `goalloc.memory_stats`)."]
    rows = [[c, fmt_spread(a["count"], lambda v: fmt(v, 0)), fmt(a["p50"].median, 1), fmt(a["p99"].median, 1),
             fmt(a["max"].median, 1)] for c, a in aggs.items()]
    head = ["config", "misses", "p50 µs", "p99 µs", "max µs"]
    if any(a["timed_driver_ms"].n for a in aggs.values()):
        # Runs that logged goalloc's driver profile after every step.
        lines[3:3] = ["The last two columns: goalloc's driver calls during the timed steps only, their time and",
                      "the handles unmapped (`backend:vmm` moves memory by unmapping it where it is free), from the",
                      "totals logged after every step."]
        head += ["driver ms, timed steps", "unmaps, timed steps"]
        for row, a in zip(rows, aggs.values()):
            row += [fmt(a["timed_driver_ms"].median, 1), fmt(a["timed_moves"].median, 0)]
    return lines + table(head, rows)


def section_replay(doc: dict[str, Any]) -> list[str]:
    lines = ["## 4. Trace replay on the GPU", "",
             "`goalloc replay TRACE --device cuda --policy P --json` on the shipped traces, one process each.",
             "Peak reserved: the driver pool's reserved high-water mark; ratio: peak reserved ÷ peak live;",
             "'native (recorded)': the native allocator's max reserved ÷ max allocated in the recorded run,",
             "from the trace header; 'vs native' divides the two ratios.", ""]
    traces = sorted({r.get("trace") for r in runs_of(doc, "replay") if r.get("trace")} |
                    {p.get("trace") for p in doc.get("plan", []) if p.get("workload") == "replay" and p.get("trace")})
    policies = sorted({p.get("config") for p in doc.get("plan", []) + doc.get("runs", [])
                       if p.get("workload") == "replay" and p.get("config")})
    rows = []
    for t in traces:
        for p in policies:
            runs = runs_of(doc, "replay", p, t)
            live = collect(runs, lambda r: r.get("peak_live_bytes"))
            res = collect(runs, lambda r: r.get("peak_reserved_bytes"))
            rat = collect(runs, lambda r: r.get("ratio"))
            nat = collect(runs, lambda r: r.get("native_ratio"))
            ns = collect(runs, lambda r: r.get("ns_per_op"))
            ooms = collect(runs, lambda r: r.get("ooms"))
            rows.append([Path(t).name, p, fmt_bytes(live.median), fmt_bytes(res.median), fmt(rat.median, 3),
                         fmt(nat.median, 3), fmt_x(ratio(rat.median, nat.median)),
                         fmt_spread(ns, lambda v: fmt(v, 0)), fmt(ooms.median, 0)])
    lines += table(["trace", "policy", "peak live", "peak reserved", "ratio", "native (recorded)", "vs native",
                    "ns per event", "OOMs"], rows)
    return lines


# --- goals ---------------------------------------------------------------------------


def verdict(ok: Optional[bool]) -> str:
    return {True: "**met**", False: "**missed**", None: "**not measured**"}[ok]


def goals(doc: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The goals section, and the goals as data (for tests and the console)."""
    lines = ["## Goals", "", "Computed from the tables above (medians of the same run).", ""]
    data: list[dict[str, Any]] = []

    def add(name: str, ok: Optional[bool], text: str) -> None:
        data.append({"goal": name, "met": ok, "text": text})
        lines.append(f"- {name}: {verdict(ok)}. {text}")

    for workload, label, unit in TRAIN:
        if not any(p.get("workload") == workload for p in doc.get("plan", [])):
            continue
        train_goals(doc, workload, label, unit, add, lines)

    for key, label in PAIR_CASES:
        def med(c: str, k: str = key) -> Optional[float]:
            return collect(runs_of(doc, "micro", c), lambda res: dig(res, "pairs", k, "us_per_pair")).median

        ga, fl, asy = med("goalloc"), med("c-floor"), med("async")
        r = ratio(ga, fl)
        if r is None:
            add(f"pair ({label}) ≤ {GOAL_PAIR_VS_FLOOR:.2f} × c-floor", None, "No figures for goalloc or c-floor.")
        else:
            ok = r <= GOAL_PAIR_VS_FLOOR
            how = f"goalloc {ga:.2f} µs vs c-floor {fl:.2f} µs = {r:.3f}×"
            if not ok:
                how += f", {pct(r / GOAL_PAIR_VS_FLOOR)} over the goal ({ga - fl:.2f} µs per pair above the floor)"
                d = collect(runs_of(doc, "micro", "goalloc"), lambda rr, k=key: dig(rr, "pairs", k, "device_allocs_during"))
                if d.median is not None:
                    how += f"; goalloc went to the driver {d.median:.0f} times during the timed rounds"
            add(f"pair ({label}) ≤ {GOAL_PAIR_VS_FLOOR:.2f} × c-floor", ok, how + ".")
        ra = ratio(ga, asy)
        if ra is None:
            add(f"pair ({label}) below async", None, "No figures for goalloc or async.")
        else:
            add(f"pair ({label}) below async", ra < 1, f"goalloc {ga:.2f} µs vs async {asy:.2f} µs = {ra:.3f}×.")

    met = [d for d in data if d["met"] is True]
    missed = [d for d in data if d["met"] is False]
    unknown = [d for d in data if d["met"] is None]
    lines += ["", f"{len(met)} met, {len(missed)} missed, {len(unknown)} not measured."]
    if missed:
        lines += ["", "Where a goal is missed, the closing note says why, from a profile, and what would close it."]
    return lines, data


def best_goalloc(doc: dict[str, Any], workload: str) -> tuple[Optional[str], dict[str, dict[str, Agg]]]:
    """The goalloc configuration (goalloc, goalloc-vmm) of the lowest median
    peak memory on a workload, and the figures of each that ran; None when
    neither has memory figures."""
    present = present_configs(doc, workload)
    aggs = {c: train_aggs(doc, workload, c) for c in GOALLOC_INSTALLED if c in present}
    measured = [c for c, a in aggs.items() if a["memory"].median is not None]
    if len(measured) < 2:
        return (measured[0] if measured else None), aggs
    # Over the repeats both ran (each repeat draws its own shapes); on a tie,
    # the default backend's configuration: it is what users get.
    other = next(c for c in measured if c != DEFAULT_GOALLOC)
    mine, theirs, _ = memory_medians(doc, workload, DEFAULT_GOALLOC, other)
    if mine is None or theirs is None:
        return DEFAULT_GOALLOC, aggs
    return (other if theirs < mine else DEFAULT_GOALLOC), aggs


def train_goals(doc: dict[str, Any], workload: str, label: str, unit: str,
                add: Callable[[str, Optional[bool], str], None], lines: list[str]) -> None:
    """A training workload's goals: the better goalloc configuration's peak
    memory over peak live, below every other configuration's, and its
    throughput against native; and goalloc (backend:async) against torch's
    cudaMallocAsync backend, the same driver pool under another allocator."""
    goal = GOAL_MEMORY_OVER_LIVE.get(workload, max(GOAL_MEMORY_OVER_LIVE.values()))
    best, cands = best_goalloc(doc, workload)
    g = cands.get(best) if best else None
    mem = g["memory"].median if g else None
    name = f"{label} peak memory ≤ {goal:.2f} × peak live"
    r = ratio(mem, g["live"].median) if g else None
    if g is None or r is None:
        add(name, None, "No goalloc figures.")
    else:
        ok = r <= goal
        how = (f"{best} (the better goalloc configuration) {fmt_bytes(mem)} over peak live "
               f"{fmt_bytes(g['live'].median)} = {r:.3f}×" + ("" if ok else f", {pct(r / goal)} over the goal"))
        for c, a in cands.items():
            rc = ratio(a["memory"].median, a["live"].median)
            if c != best and rc is not None:
                how += f"; {c} {fmt_bytes(a['memory'].median)}, {rc:.3f}×"
        add(name, ok, how + ".")
        lines.extend(breakdown(doc, workload, best))
    others = ["native", "expandable", "async"]
    others += [c for c in present_configs(doc, workload) if c not in others and c not in GOALLOC_INSTALLED]
    for other in others:
        o = train_aggs(doc, workload, other)
        mine, theirs, note = memory_medians(doc, workload, best, other) if best else (None, None, "")
        rr = ratio(mine, theirs)
        name = f"{label} peak memory below {other}"
        if rr is None:
            add(name, None, f"No figures for goalloc or {other}.")
            continue
        dev_mine, dev_theirs, _ = memory_medians(doc, workload, best, other, device_peak)
        dev_r = ratio(dev_mine, dev_theirs)
        extra = "" if dev_r is None else f"; by the driver's count (device peak over idle), {dev_r:.3f}×"
        add(name, rr < 1, f"{best} {fmt_bytes(mine)} vs {other} {fmt_bytes(theirs)}{note}: "
                          f"{rr:.3f}× ({pct(rr)}){extra}.")
    ga, asy, note = memory_medians(doc, workload, "goalloc", "async")
    ra = ratio(ga, asy)
    name = f"{label} goalloc (backend:async) peak memory ≤ async"
    if ra is None:
        add(name, None, "No figures for goalloc or async.")
    else:
        add(name, ra <= 1, f"goalloc {fmt_bytes(ga)} vs async (torch's cudaMallocAsync) {fmt_bytes(asy)}{note}: "
                           f"{ra:.3f}× ({pct(ra)}).")
    n = train_aggs(doc, workload, "native")
    name = f"{label} throughput ≥ {GOAL_THROUGHPUT_VS_NATIVE:.2f} × native"
    rs = ratio(g["speed"].median, n["speed"].median) if g else None
    # Runs in lockstep, where they were made, decide: two runs compared step
    # by step share the host's state, where runs one after the other do not.
    lock = lockstep_goal(doc, workload, best or DEFAULT_GOALLOC)
    if (g is None or rs is None) and lock is None:
        add(name, None, "No figures for goalloc or native.")
        return
    decided = lock[0] if lock else rs
    assert decided is not None
    ok = decided >= GOAL_THROUGHPUT_VS_NATIVE
    parts = []
    if lock:
        parts.append(lock[1] + ("" if ok else f", {(GOAL_THROUGHPUT_VS_NATIVE - decided) * 100:.1f} points under "
                                              "the goal"))
        parts += [lock[2]] if lock[2] else []
    if g is not None and rs is not None:
        how = (("in the suite's runs, one after another, " if lock else "")
               + f"{best} {fmt(g['speed'].median, 0)} vs native {fmt(n['speed'].median, 0)} {unit} = {rs:.3f}×")
        if rs < GOAL_THROUGHPUT_VS_NATIVE and not lock:
            how += f", {(GOAL_THROUGHPUT_VS_NATIVE - rs) * 100:.1f} points under the goal"
            gs, ns = g["step"].median, n["step"].median
            if gs is not None and ns is not None:
                how += f"; median step {gs * 1e3:.1f} ms vs {ns * 1e3:.1f} ms"
        paired = paired_speed_ratios(doc, workload, best)
        if paired:
            how += (f"; per repeat, on the same shapes, {', '.join(f'{x:.3f}' for x in paired)}× "
                    f"(median {Agg(paired).median:.3f}×)")
        for c, a in cands.items():
            rc = ratio(a["speed"].median, n["speed"].median)
            if c != best and rc is not None:
                how += f"; {c} {rc:.3f}×"
        parts.append(how)
    add(name, ok, "; ".join(parts) + ".")


# --- training in lockstep (bench/lockstep.py) -----------------------------------------


def lockstep_groups(doc: dict[str, Any]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """The lockstep inputs' compared repeats by (workload, A, B), in order of
    appearance: each one's comparison of B against A."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for ls in doc.get("lockstep", []):
        pair = list(ls.get("pair") or [])
        if len(pair) != 2:
            continue
        key = (str(ls.get("workload")), pair[0], pair[1])
        for p in ls.get("pairs", []):
            c = p.get("compare")
            if p.get("status") == "ok" and c and "error" not in c:
                groups.setdefault(key, []).append(c)
    return groups


def lockstep_summary(compares: list[dict[str, Any]]) -> str:
    """B's throughput over A's, median (min–max, n), and B faster in k of n."""
    t = Agg([c["throughput"] for c in compares])
    faster = sum(1 for c in compares if c["throughput"] > 1)
    return f"{t.median:.3f}× ({t.lo:.3f}–{t.hi:.3f}, n={t.n}; faster in {faster} of {t.n})"


def section_lockstep(doc: dict[str, Any]) -> list[str]:
    lines = ["### Training in lockstep", "",
             "`bench/lockstep.py`: the two configurations of a repeat train at the same time, each in a fresh",
             "process, on one GPU, taking turns step by step (A, B, A, B: the same shapes, each step alone,",
             "its threads pinned alike in both processes), so that the host's drift falls on both.",
             "Per repeat: B's throughput over A's over the timed steps, and the median over the steps of",
             "A's step time over B's; over the repeats, medians (min–max, n). A pair of one configuration",
             "shows how far from 1 the method itself lands. Memory is not measured this way.", ""]
    for i, ls in enumerate(doc.get("lockstep", []), 1):
        host = ls.get("host") or {}
        opts = ls.get("options") or {}
        lines += [f"Lockstep input {i}: `{ls.get('path', '?')}`", "",
                  f"- command: `{ls.get('command', '?')}`",
                  f"- date: {ls.get('started', '?')}; CPUs {','.join(map(str, host.get('cpus_allowed') or [])) or '?'} of "
                  f"{host.get('cpus', '?')}; repository commit {ls.get('git_commit', '?')}",
                  f"- options: workload {ls.get('workload')}; repeats {opts.get('first_repeat', '?')}–"
                  f"{(opts.get('first_repeat') or 0) + (opts.get('repeats') or 0) - 1}; "
                  f"{len([p for p in ls.get('pairs', []) if p.get('status') == 'ok'])} compared, "
                  f"{len([p for p in ls.get('pairs', []) if p.get('status') != 'ok'])} not", ""]
    rows = []
    for (workload, a, b), cs in lockstep_groups(doc).items():
        sm = Agg([c["step_median"] for c in cs])
        ma = Agg([c["median_step_s"]["a"] for c in cs])
        mb = Agg([c["median_step_s"]["b"] for c in cs])
        rows.append([workload, f"{b} against {a}", lockstep_summary(cs),
                     f"{sm.median:.3f}× ({sm.lo:.3f}–{sm.hi:.3f})",
                     f"{ma.median * 1e3:.2f} ms", f"{mb.median * 1e3:.2f} ms"])
    lines += table(["workload", "B against A", "throughput, B over A", "step median, A's over B's",
                    "A's median step", "B's median step"], rows)
    return lines


def lockstep_goal(doc: dict[str, Any], workload: str, config: str) -> Optional[tuple[float, str, str]]:
    """config against native in lockstep, where an input has it: the median
    of its repeats' throughput ratios, the text of it, and the method's own
    spread (native against native) where that ran too."""
    groups = lockstep_groups(doc)
    cs = groups.get((workload, "native", config))
    if not cs:
        return None
    aa = groups.get((workload, "native", "native"))
    return (Agg([c["throughput"] for c in cs]).median, f"In lockstep with native, {config} {lockstep_summary(cs)}",
            f"native against native in lockstep, {lockstep_summary(aa)}" if aa else "")


def first_number(*vs: Any) -> Any:
    """The first of vs that is a number, else None."""
    for v in vs:
        if number(v) is not None:
            return v
    return None


def breakdown(doc: dict[str, Any], workload: str, config: str) -> list[str]:
    """Where a goalloc configuration's peak memory goes, from its own
    counters (medians).

    These are differences of peaks, which need not fall at the same moment:
    a guide to the layers, not an exact account.
    """
    runs = runs_of(doc, workload, config)
    pool = collect(runs, lambda r: dig(r, "allocator", "pool_reserved_max_read")).median
    # goalloc's own reserved peak: its own key where the library has it (with
    # backend:vmm reserved_bytes.all is the physical memory, the pool figure).
    res = collect(runs, lambda r: first_number(dig(r, "allocator", "stats", "goalloc.own_reserved_bytes.peak"),
                                                dig(r, "allocator", "reserved_peak"))).median
    alloc = collect(runs, lambda r: dig(r, "allocator", "allocated_peak")).median
    req = collect(runs, lambda r: dig(r, "allocator", "requested_peak")).median
    parts = []
    if pool is not None and res is not None:
        source = "mapped physical memory" if config == "goalloc-vmm" else "driver pool"
        parts.append(f"{source} over goalloc's own reserved peak {fmt_bytes(pool - res)}")
    if res is not None and alloc is not None:
        parts.append(f"goalloc reserved over allocated peak (cache and segment slack) {fmt_bytes(res - alloc)}")
    if alloc is not None and req is not None:
        parts.append(f"allocated over requested peak (rounding) {fmt_bytes(alloc - req)}")
    if not parts:
        return []
    return [f"  - where {config}'s goes (its own counters; differences of peaks): " + "; ".join(parts) + "."]


# --- the document -----------------------------------------------------------------------


def render(doc: dict[str, Any], notes: Optional[str] = None) -> str:
    lines = section_header(doc)
    planned = {p.get("workload") for p in doc.get("plan", [])} | {r.get("workload") for r in doc.get("runs", [])}
    if "micro" in planned:
        lines += [""] + section_pairs(doc) + [""] + section_cross(doc)
    for i, (workload, label, unit) in enumerate(TRAIN):
        if workload in planned:
            lines += [""] + section_train(doc, workload, label, unit, "3" + "abc"[i])
    if doc.get("lockstep"):
        lines += [""] + section_lockstep(doc)
    if "replay" in planned:
        lines += [""] + section_replay(doc)
    g, _ = goals(doc)
    lines += [""] + g
    lines += ["", "## Closing note", ""]
    lines.append(notes.strip() if notes else "None was given to this rendering (`bench/render.py --notes FILE`).")
    return "\n".join(lines) + "\n"


def run_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a run the same run in two bench.json files."""
    return (r.get("workload"), r.get("config"), r.get("repeat"), r.get("trace"))


def merge(docs: list[dict[str, Any]], paths: list[str],
          warn: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Several suites' bench.json as one document: every input's runs and
    plan, a run (workload, config, repeat, trace) that two inputs have taken
    from the later input (and warn says so), and each input's environment
    kept under "inputs" for the header. One input is returned as it is."""
    if len(docs) == 1:
        return docs[0]
    runs: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
    plan: dict[tuple[Any, ...], dict[str, Any]] = {}
    replaced = 0
    for i, (doc, path) in enumerate(zip(docs, paths)):
        for r in doc.get("runs", []):
            k = run_key(r)
            if k in runs:
                j, old = runs[k]
                replaced += 1
                warn(f"render: run {r.get('name', k)} is in {paths[j]} ({old.get('status')}) and in {path} "
                     f"({r.get('status')}): keeping {path}'s")
            runs[k] = (i, r)
        for p in doc.get("plan", []):
            plan[run_key(p)] = p
    inputs = [{k: v for k, v in d.items() if k not in ("runs", "plan")} | {"path": p, "runs": d.get("runs", []),
                                                                          "plan": d.get("plan", [])}
              for d, p in zip(docs, paths)]
    return {"schema": 1, "inputs": inputs, "replaced": replaced, "runs": [r for _, r in runs.values()],
            "plan": list(plan.values())}


DROPPABLE_WORKLOADS = ("env", "micro", "replay") + tuple(w for w, _, _ in TRAIN)


def parse_drops(specs: list[str], paths: list[str]) -> dict[int, list[str]]:
    """--drop FILE:NAME arguments as {input index: [NAME, ...]}. FILE must be
    one of the inputs as given, NAME a configuration or a workload."""
    out: dict[int, list[str]] = {}
    for spec in specs:
        path, sep, name = spec.rpartition(":")
        if not sep or not path or not name:
            raise ValueError(f"--drop {spec!r}: expected FILE:CONFIG or FILE:WORKLOAD")
        if path not in paths:
            raise ValueError(f"--drop {spec!r}: {path} is not one of the inputs")
        if name not in CONFIGS and name not in DROPPABLE_WORKLOADS:
            raise ValueError(f"--drop {spec!r}: {name!r} is neither a configuration ({', '.join(CONFIGS)}) "
                             f"nor a workload ({', '.join(DROPPABLE_WORKLOADS)})")
        out.setdefault(paths.index(path), []).append(name)
    return out


def drop_runs(doc: dict[str, Any], names: list[str]) -> None:
    """Leave the runs and plan entries of each name (a configuration or a
    workload) out of one input, in place, noting in doc["dropped"] what went
    and how many runs."""
    for name in names:
        key = "config" if name in CONFIGS else "workload"
        n = sum(1 for r in doc.get("runs", []) if r.get(key) == name)
        doc["runs"] = [r for r in doc.get("runs", []) if r.get(key) != name]
        doc["plan"] = [p for p in doc.get("plan", []) if p.get(key) != name]
        doc.setdefault("dropped", []).append(f"{key} {name} ({n} runs)")


def unpack(doc: dict[str, Any], folder: Path) -> list[Path]:
    """Write every run of doc as folder/NAME.json; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in doc.get("runs", []):
        name = r.get("name") or f"{r.get('id', 0):03d}-{r.get('workload')}-{r.get('config')}-r{r.get('repeat')}"
        p = folder / f"{name}.json"
        p.write_text(json.dumps(r, indent=1) + "\n")
        paths.append(p)
    return paths


# What keep() leaves of a run: the fields the sections above read.
KEEP_RUN = ("id", "name", "workload", "config", "repeat", "trace", "status", "reason", "command", "wall_s")
KEEP_RESULT = ("unit", "warmup", "steps", "planned_shapes", "timed_seconds", "timed_units", "units_per_s",
               "median_step_s", "losses_finite")
KEEP_REPLAY = ("peak_live_bytes", "peak_reserved_bytes", "ratio", "native_ratio", "ns_per_op", "ooms", "policy", "trace")
KEEP_ALLOCATOR = ("pool_reserved_max_read", "reserved_peak", "allocated_peak", "requested_peak", "device_alloc_ns",
                  "backend")


def pick(d: Any, keys: Iterable[str]) -> dict[str, Any]:
    return {k: d[k] for k in keys if isinstance(d, dict) and k in d}


def keep_result(workload: Any, res: Any) -> Any:
    """A run's result, pruned to what render() reads (pairs and the
    cross-stream loop of micro runs kept whole)."""
    if not isinstance(res, dict):
        return res
    if workload == "replay":
        return pick(res, KEEP_REPLAY)
    if workload == "micro":
        return pick(res, ("pairs", "cross_stream"))
    out = pick(res, KEEP_RESULT)
    a = res.get("allocator") or {}
    out["allocator"] = pick(a, KEEP_ALLOCATOR)
    own = (a.get("stats") or {}).get("goalloc.own_reserved_bytes.peak")
    if own is not None:
        out["allocator"]["stats"] = {"goalloc.own_reserved_bytes.peak": own}
    out["device"] = pick(res.get("device"), ("peak_over_baseline", "baseline_used"))
    log = res.get("step_log") or []
    if any("goalloc_driver" in e for e in log):  # timed_driver's figures
        out["step_log"] = [{"timed": e.get("timed"), "goalloc_driver": pick(e.get("goalloc_driver"), ("ns", "unmaps"))}
                           for e in log]
    return out


def keep_lockstep(ls: dict[str, Any]) -> dict[str, Any]:
    """A lockstep.json without the processes' allocator figures: the pairs'
    comparisons and each side's steps, speed and CPU by thread
    (bench/lockstep.py report's figures)."""
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
    what render() reads: the same tables from a file a fraction of the size."""
    def run(r: dict[str, Any]) -> dict[str, Any]:
        return pick(r, KEEP_RUN) | {"result": keep_result(r.get("workload"), r.get("result"))}

    def plan(p: dict[str, Any]) -> dict[str, Any]:
        return pick(p, ("workload", "config", "repeat", "trace"))

    inputs = doc.get("inputs") or [doc]
    out: dict[str, Any] = {
        "about": "bench/render.py --keep: the runs of the inputs below (each with the command that produced it), "
                 "pruned to what bench/render.py reads; it renders the same tables alone.",
        "produced_by": {"suites": [d.get("command") for d in inputs],
                        "lockstep": [ls.get("command") for ls in doc.get("lockstep", [])],
                        "kept": "python3 bench/render.py " + " ".join(argv)},
    }
    out |= {k: v for k, v in doc.items() if k not in ("runs", "plan", "inputs", "lockstep", "argv", "outdir")}
    out["runs"] = [run(r) for r in doc.get("runs", [])]
    out["plan"] = [plan(p) for p in doc.get("plan", [])]
    if doc.get("inputs"):
        out["inputs"] = [{k: v for k, v in d.items() if k not in ("runs", "plan", "argv", "outdir")}
                         | {"path": Path(str(d.get("path", "?"))).name,
                            "runs": [pick(r, ("name", "status")) for r in d.get("runs", [])],
                            "plan": [plan(p) for p in d.get("plan", [])]} for d in doc["inputs"]]
    out["lockstep"] = [keep_lockstep(ls) for ls in doc.get("lockstep", [])]
    return out


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def splice(document: str, rendered: str) -> str:
    """document with the text between its markers replaced by rendered, its
    headings one level down (the suite becomes a section of the document)."""
    a, b = document.find(BEGIN), document.find(END)
    if a < 0 or b < a:
        raise ValueError(f"no {BEGIN} ... {END} section to replace")
    lines, fence = [], False
    for line in rendered.strip().splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#"):
            line = "#" + line
        lines.append(line)
    return document[:a + len(BEGIN)] + "\n" + "\n".join(lines) + "\n" + document[b:]


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
    ap.add_argument("bench_json", nargs="+",
                    help="the suite's bench.json; several (other GPUs, other calls) are merged, a run in two "
                         "of them taken from the later one")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--output", help="write the markdown to this file instead of stdout")
    out.add_argument("--into", metavar="FILE",
                     help="replace the text between the bench:begin and bench:end markers of FILE "
                          "(a document that keeps other text around the suite's)")
    ap.add_argument("--drop", action="append", default=[], metavar="FILE:NAME",
                    help="leave out the runs of NAME, a configuration or a workload, of the input FILE (as given "
                         "among the inputs): e.g. a configuration the library changed after FILE ran, or a "
                         "workload a later input measured again; the header says what was left out")
    ap.add_argument("--lockstep", action="append", default=[], metavar="FILE",
                    help="a bench/lockstep.py lockstep.json: its table, and the throughput goal of its workload "
                         "where it paired native (A) with goalloc's configuration (B)")
    ap.add_argument("--notes", help="a hand-written closing note (markdown) to append")
    ap.add_argument("--keep", metavar="FILE",
                    help="also write the runs (merged, with the lockstep runs) pruned to what this renderer reads, "
                         "as one JSON file that renders the same (bench/results/training.json)")
    ap.add_argument("--unpack", metavar="DIR", help="also write each run as DIR/NAME.json")
    args = ap.parse_args(argv)
    docs = []
    for path in args.bench_json:
        d = read_input(path, lambda d: isinstance(d, dict), "a suite's bench.json (not a JSON object)")
        if d is None:
            return 1
        docs.append(d)
    try:
        drops = parse_drops(args.drop, args.bench_json)
    except ValueError as e:
        print(f"render: {e}", file=sys.stderr)
        return 2
    for i, names in drops.items():
        drop_runs(docs[i], names)
    doc = merge(docs, args.bench_json)
    doc["lockstep"] = list(doc.get("lockstep") or [])  # a merged document may carry its own (bench/results/training.json)
    for path in args.lockstep:
        d = read_input(path, lambda d: isinstance(d, dict) and d.get("kind") == "lockstep",
                       "a bench/lockstep.py lockstep.json")
        if d is None:
            return 1
        doc["lockstep"].append(d | {"path": path})
    notes = Path(args.notes).read_text() if args.notes else None
    text = render(doc, notes)
    if args.keep:
        kept = keep(doc, argv if argv is not None else sys.argv[1:])
        Path(args.keep).write_text(json.dumps(kept, separators=(",", ":")) + "\n")
        print(f"render: kept {len(kept['runs'])} runs in {args.keep}", file=sys.stderr)
    if args.unpack:
        n = len(unpack(doc, Path(args.unpack)))
        print(f"render: wrote {n} run files under {args.unpack}", file=sys.stderr)
    if args.into:
        path = Path(args.into)
        try:
            text = splice(path.read_text(), text)
        except (OSError, ValueError) as e:
            print(f"render: {path}: {e}", file=sys.stderr)
            return 1
    if args.output or args.into:
        path = Path(args.into or args.output)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
        print(f"render: wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
