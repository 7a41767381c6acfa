"""Sleep and wake speed on a GPU: W GiB of tagged weights offloaded and K GiB
of tagged KV cache discarded, against a plain pinned-memory copy of the
same bytes measured in the same process; each round a fresh process.

    GOALLOC_LIBRARY=build/libgoalloc.so python3 tests/gpu/bench_sleep.py --weights-gib 16 --kv-gib 32 --rounds 3

Prints a JSON object with each round and the medians: sleep and wake
seconds (the first cycle pins the host area, unless --prepare had
goalloc.prepare_sleep do it first; the second reuses it), offload and
restore bandwidth over the plain copy's, over the whole call and over its
copies alone (the library's own times of its steps), and what the device
holds asleep above the process's idle use (by mem_get_info).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GiB = 1 << 30


def one(weights_gib: int, kv_gib: int, prepare: bool) -> dict:
    import torch

    import goalloc

    goalloc.install()
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()

    def used() -> int:
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    idle = used()
    piece = 256 << 20
    with goalloc.memory_tag("weights"):
        weights = [torch.empty(piece, dtype=torch.uint8, device=dev) for _ in range(weights_gib * GiB // piece)]
    with goalloc.memory_tag("kv_cache"):
        kv = [torch.empty(piece, dtype=torch.uint8, device=dev) for _ in range(kv_gib * GiB // piece)]
    for i, w in enumerate(weights):
        w.fill_(i % 251)
    for k in kv:
        k.fill_(1)
    torch.cuda.synchronize()
    res: dict = {"weights_bytes": weights_gib * GiB, "kv_bytes": kv_gib * GiB}

    # The plain copy: the same bytes to and from one pinned buffer, queued
    # on one stream, timed to the last byte.
    host = torch.empty(piece * len(weights), dtype=torch.uint8, pin_memory=True)
    for direction in ("to_host", "to_device"):
        best = float("inf")
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i, w in enumerate(weights):
                h = host[i * piece:(i + 1) * piece]
                (h.copy_(w, non_blocking=True) if direction == "to_host" else w.copy_(h, non_blocking=True))
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        res[f"plain_{direction}_gib_s"] = weights_gib / best
    del host
    if prepare:  # the host area pinned ahead, as a program would while loading its model
        t = time.perf_counter()
        goalloc.prepare_sleep(weights_gib * GiB)
        res["prepare_sleep_s"] = time.perf_counter() - t

    for cycle in ("first", "second"):
        torch.cuda.synchronize()
        t = time.perf_counter()
        s = goalloc.sleep(offload_tags=("weights",))
        t_sleep = time.perf_counter() - t
        asleep_above_idle = used() - idle
        t = time.perf_counter()
        w = goalloc.wake_up()
        torch.cuda.synchronize()
        t_wake = time.perf_counter() - t
        res[cycle] = {"sleep_s": t_sleep, "wake_s": t_wake, "offloaded": s.offloaded_bytes,
                      "released": s.released_bytes, "restored": w.restored_bytes,
                      "asleep_above_idle": asleep_above_idle,
                      "offload_gib_s": s.offloaded_bytes / GiB / t_sleep,
                      "restore_gib_s": w.restored_bytes / GiB / t_wake,
                      "prepare_s": s.prepare_seconds, "offload_s": s.offload_seconds,
                      "map_s": w.map_seconds, "restore_s": w.restore_seconds,
                      "copy_out_gib_s": s.offloaded_bytes / GiB / s.offload_seconds,
                      "copy_back_gib_s": w.restored_bytes / GiB / w.restore_seconds}
    res["intact"] = all(bool((w[:4096] == i % 251).all().item()) and bool((w[-4096:] == i % 251).all().item())
                        for i, w in enumerate(weights))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights-gib", type=int, default=16)
    ap.add_argument("--kv-gib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prepare", action="store_true", help="goalloc.prepare_sleep before the first sleep")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.weights_gib, args.kv_gib, args.prepare)))
        return 0
    rounds = []
    for r in range(args.rounds):
        p = subprocess.run([sys.executable, __file__, "--one", "--weights-gib", str(args.weights_gib),
                            "--kv-gib", str(args.kv_gib)] + ["--prepare"] * args.prepare,
                           capture_output=True, text=True, env=dict(os.environ))
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            return 1
        rounds.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)

    def med(f) -> float:
        return round(statistics.median(f(x) for x in rounds), 3)

    summary = {
        "plain_to_host_gib_s": med(lambda x: x["plain_to_host_gib_s"]),
        "plain_to_device_gib_s": med(lambda x: x["plain_to_device_gib_s"]),
    }
    for c in ("first", "second"):
        summary[c] = {k: med(lambda x, k=k: x[c][k]) for k in (
            "sleep_s", "wake_s", "offload_gib_s", "restore_gib_s", "prepare_s", "offload_s", "map_s", "restore_s")}
        summary[c]["copy_out_over_plain"] = med(lambda x: x[c]["copy_out_gib_s"] / x["plain_to_host_gib_s"])
        summary[c]["copy_back_over_plain"] = med(lambda x: x[c]["copy_back_gib_s"] / x["plain_to_device_gib_s"])
        summary[c]["offload_over_plain"] = med(lambda x: x[c]["offload_gib_s"] / x["plain_to_host_gib_s"])
        summary[c]["restore_over_plain"] = med(lambda x: x[c]["restore_gib_s"] / x["plain_to_device_gib_s"])
        summary[c]["asleep_above_idle_mib"] = med(lambda x: x[c]["asleep_above_idle"] / (1 << 20))
    summary["intact"] = all(x["intact"] for x in rounds)
    print(json.dumps({"args": vars(args), "summary": summary, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
