"""Data-integrity torture for goalloc inside PyTorch (issue: reliability).

Random allocations and frees through torch on several streams, sizes from 1
byte to 256 MiB, tensors handed between streams with record_stream. Every
block is filled with a cookie derived from its id by a kernel on its stream
and checked on the GPU, by every stream that used it, before it dies; the
mismatch count is summed on the GPU and read once at the end. Prints one JSON
object. Run from the repository root:

    GOALLOC_LIBRARY=build/libgoalloc.so python3 tests/gpu/torture_check.py --ops 1000000
    ... --fraction 0.02   (a cap that forces out-of-memory retries)
    ... --threads 4       (several Python threads allocating at once)
"""
import argparse
import json
import random
import threading
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--ops", type=int, default=100000, help="allocations + frees, over all threads")
ap.add_argument("--streams", type=int, default=4)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--fraction", type=float, default=0.0, help="set_per_process_memory_fraction, 0 for none")
ap.add_argument("--max-live", type=int, default=400, help="live tensors per thread")
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--max-log2", type=int, default=28, help="largest size is 2**this bytes (28: 256 MiB)")
ap.add_argument("--native", action="store_true", help="run on PyTorch's own allocator, for comparison")
args = ap.parse_args()

from rawlib import RawGoalloc  # noqa: E402

goalloc = RawGoalloc()
if not args.native:
    goalloc.install(torch)

torch.cuda.init()
if args.fraction:
    torch.cuda.set_per_process_memory_fraction(args.fraction)
MAX_LOG2 = args.max_log2


def cookie(i):
    return (i * 2654435761) % 2147483629 + 1  # nonzero, fits int32


def check(t, v, into):
    """Adds the mismatches of t against v to the GPU counter into. Under a
    cap the comparison's own temporary can fail to allocate (torch raises
    on goalloc's refusal): the check is then skipped and counted."""
    try:
        into += (t != v).sum()
        return 0
    except RuntimeError as e:
        if "CUDA out of memory" not in str(e):
            raise
        return 1


def worker(tid, ops, result):
    rng = random.Random(args.seed * 1000 + tid)
    streams = [torch.cuda.Stream() for _ in range(args.streams)]
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    live = {}  # id -> (tensor, value, alloc stream, [streams that used it])
    next_id = tid << 40
    allocs = frees = handoffs = ooms = skipped = 0
    for _ in range(ops):
        if live and (len(live) >= args.max_live or rng.random() < 0.5):
            k = rng.choice(list(live))
            t, v, s, used = live.pop(k)
            # Check on the owner stream, after every user of the tensor.
            for u in used:
                s.wait_stream(u)
            with torch.cuda.stream(s):
                skipped += check(t, v, mismatches)
            del t
            frees += 1
            continue
        size = max(1, int(2 ** rng.uniform(0, MAX_LOG2)))
        s = rng.choice(streams)
        next_id += 1
        with torch.cuda.stream(s):
            try:
                if size < 64:
                    t = torch.empty(size, dtype=torch.uint8, device="cuda")
                    v = next_id % 251 + 1
                else:
                    t = torch.empty(size // 4, dtype=torch.int32, device="cuda")
                    v = cookie(next_id)
            except RuntimeError as e:  # the cap: goalloc said no, torch raised
                if "CUDA out of memory" not in str(e):
                    raise
                ooms += 1
                continue
            t.fill_(v)
        allocs += 1
        used = []
        if rng.random() < 0.25:
            # Hand it to a consumer stream that reads it late.
            c = rng.choice([x for x in streams if x is not s])
            c.wait_stream(s)
            with torch.cuda.stream(c):
                if rng.random() < 0.2:
                    torch.cuda._sleep(rng.randint(1000, 200000))
                skipped += check(t, v, mismatches)
            t.record_stream(c)
            used.append(c)
            handoffs += 1
        live[next_id] = (t, v, s, used)
    for k, (t, v, s, used) in list(live.items()):
        for u in used:
            s.wait_stream(u)
        with torch.cuda.stream(s):
            skipped += check(t, v, mismatches)
    live.clear()
    torch.cuda.synchronize()
    result[tid] = {"allocs": allocs, "frees": frees, "handoffs": handoffs, "ooms": ooms, "skipped_checks": skipped,
                   "mismatches": int(mismatches.item())}


t0 = time.time()
results = {}
per = args.ops // args.threads
threads = [threading.Thread(target=worker, args=(i, per, results)) for i in range(args.threads)]
[t.start() for t in threads]
[t.join() for t in threads]
elapsed = time.time() - t0
out = {"ops": per * args.threads, "threads": args.threads, "streams": args.streams, "fraction": args.fraction,
       "seconds": round(elapsed, 1),
       "allocs": sum(r["allocs"] for r in results.values()),
       "handoffs": sum(r["handoffs"] for r in results.values()),
       "ooms_seen_by_torch": sum(r["ooms"] for r in results.values()),
       "mismatches": sum(r["mismatches"] for r in results.values()),
       "skipped_checks": sum(r["skipped_checks"] for r in results.values()),
       "threads_finished": len(results)}
if not args.native:
    st = goalloc.stats()
    torch.cuda.empty_cache()
    after = goalloc.stats()
    frag = goalloc.fragmentation()
    out.update({
        "num_ooms": st["num_ooms"], "num_alloc_retries": st["num_alloc_retries"],
        "cache_hits": st["goalloc.cache_hits"], "cache_misses": st["goalloc.cache_misses"],
        "deferred_frees": st["goalloc.deferred_frees"],
        "reserved_peak": st["reserved_bytes.all.peak"],
        "allocated_after": after["allocated_bytes.all.current"],
        "active_after": after["active_bytes.all.current"],
        "reserved_after_empty_cache": after["reserved_bytes.all.current"],
        "pool_reserved_after": frag["pool_reserved_bytes"], "pool_used_after": frag["pool_used_bytes"],
        "bad_input": {k: v for k, v in after.items() if k.startswith("goalloc.bad_input.") and v},
    })
print(json.dumps(out))
