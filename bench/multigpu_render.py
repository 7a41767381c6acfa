"""Render bench/multigpu.sh's results (JSON lines) as the markdown tables in
BENCHMARKS.md: per workload, allocator and rank (device, for the
model-parallel run), the median over rounds of tokens/s and of peak device
memory (mem_get_info above the process's idle use, sampled every step) against
peak live (max_memory_allocated), and both as ratios to the native allocator.

    python3 bench/multigpu_render.py OUT/multigpu.jsonl
    python3 bench/multigpu_render.py bench/results/multigpu.json   # the kept results: {"records": [...]}
"""
import collections
import json
import statistics
import sys

ORDER = ("native", "expandable", "goalloc")
NAMES = {"ddp": "DDP, 2 ranks", "fsdp": "FSDP, 2 ranks", "mp": "model parallel, 2 GPUs in one process"}


def records(path):
    """The runs of a JSON lines file, or of a JSON document's "records"."""
    text = open(path).read()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("records"), list):
        return doc["records"]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rows(path):
    """One record per (workload, allocator, rank or device) and round."""
    for r in records(path):
        if r["workload"] == "mp":
            for d in (0, 1):
                yield (r["workload"], r["allocator"], d), r["round"], r["tokens_per_s"], \
                    r["peak_device_used"][d], r["peak_allocated"][d]
        else:
            yield (r["workload"], r["allocator"], r["rank"]), r["round"], r["tokens_per_s"], \
                r["peak_device_used"], r["peak_allocated"]


def main(path):
    runs = collections.defaultdict(list)
    for key, rnd, tps, used, live in rows(path):
        runs[key].append((rnd, tps, used, live))
    med = {k: {"n": len(v), "tps": statistics.median(x[1] for x in v),
               "used": statistics.median(x[2] for x in v), "live": statistics.median(x[3] for x in v)}
           for k, v in runs.items()}
    gib = 1 << 30
    for w in ("ddp", "fsdp", "mp"):
        print(f"\n**{NAMES[w]}**\n")
        print("| allocator | rank/device | runs | tokens/s (median) | vs native | peak device | peak live "
              "| device / live | device vs native |")
        print("|---|---|---|---|---|---|---|---|---|")
        for a in ORDER:
            for r in (0, 1):
                m, n = med.get((w, a, r)), med.get((w, "native", r))
                if not m or not n:
                    continue
                print(f"| {a} | {r} | {m['n']} | {m['tps']:,.0f} | {m['tps'] / n['tps']:.3f} "
                      f"| {m['used'] / gib:.2f} GiB | {m['live'] / gib:.2f} GiB | {m['used'] / m['live']:.3f} "
                      f"| {m['used'] / n['used']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
