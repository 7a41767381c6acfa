"""The core allocator inside PyTorch, with nothing but ctypes: load
libgoalloc.so as a CUDAPluggableAllocator with its four hooks, train a small
model forward and backward (backward runs on the autograd thread, which has
no CUDA context), hand a tensor between two streams with record_stream and
check its data, and check what empty_cache and set_per_process_memory_fraction
do to the pool. Prints one JSON object; tests/gpu/test_core_torch.py asserts
on it. Run from the repository root:

    GOALLOC_LIBRARY=build/libgoalloc.so python3 tests/gpu/core_torch_check.py
"""
import json
import sys

import torch

from rawlib import RawGoalloc  # noqa: E402

goalloc = RawGoalloc()
goalloc.install(torch)
stats, frag = goalloc.stats, goalloc.fragmentation
out = {}

# 1. Train a small transformer: forward, backward (autograd thread), AdamW.
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Embedding(1000, 256),
    torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 2),
    torch.nn.Linear(256, 1000),
).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
data = torch.randint(0, 1000, (64, 33), device="cuda")
for step in range(30):
    seq = 16 + (step * 7) % 17  # variable length, as in real training
    x, y = data[:, :seq], data[:, 1:seq + 1]
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 1000), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.cuda.synchronize()
# The same training on the CPU, from the same seed, must agree closely.
st = stats()
out["train"] = {"first_loss": losses[0], "last_loss": losses[-1], "finite": all(l == l for l in losses),
                "cache_hits": st["goalloc.cache_hits"], "cache_misses": st["goalloc.cache_misses"],
                "allocated_peak": st["allocated_bytes.all.peak"], "reserved_peak": st["reserved_bytes.all.peak"],
                "own_reserved_peak": st["goalloc.own_reserved_bytes.peak"],
                "bad_input": {k: v for k, v in st.items() if k.startswith("goalloc.bad_input")}}
del model, opt, data, logits, loss, x, y
torch.cuda.synchronize()

# 2. record_stream: the consumer stream is kept busy while the producer frees
# the tensor and allocates the same size again and scribbles on it. Without
# the deferred free, the consumer would read the scribbles.
side = torch.cuda.Stream()
mismatches = 0
deferred_before = stats()["goalloc.deferred_frees"]
for trial in range(20):
    n = 1 << (10 + trial % 12)  # 4 KiB .. 8 MiB of float32
    src = torch.full((n,), float(trial + 1), device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000)  # keep the side stream busy
        dst = src * 2
    src.record_stream(side)
    del src
    again = torch.empty((n,), device="cuda")
    again.fill_(-1.0)  # would overwrite src's memory if it were reused early
    side.synchronize()
    mismatches += int((dst != 2.0 * (trial + 1)).sum().item())
    del dst, again
torch.cuda.synchronize()
out["record_stream"] = {"mismatches": mismatches, "deferred_frees": stats()["goalloc.deferred_frees"] - deferred_before}

# 3. empty_cache gives cached memory back to the pool and trims the pool.
keep = [torch.empty(n, device="cuda") for n in (1 << 20, 1 << 24, 1 << 26)]
del keep
before = stats()["reserved_bytes.all.current"]
pool_before = frag()["pool_reserved_bytes"]
torch.cuda.empty_cache()
out["empty_cache"] = {"reserved_before": before, "reserved_after": stats()["reserved_bytes.all.current"],
                      "pool_reserved_before": pool_before, "pool_reserved_after": frag()["pool_reserved_bytes"]}

# 4. set_per_process_memory_fraction caps goalloc: an over-cap request fails
# with goalloc's message, the process keeps working.
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(0.05)
ooms_before = stats()["num_ooms"]
try:
    # my_malloc raises; goalloc_malloc's NULL would have made a tensor
    # whose first kernel faults (export/torch_malloc.cpp).
    big = torch.empty(int(total * 0.08) // 4, device="cuda")
    big.fill_(1.0)
    over_cap = "allocated"
except RuntimeError as e:
    over_cap = type(e).__name__ + ": " + str(e).splitlines()[0][:200]
small = torch.ones(1000, device="cuda") * 3
out["fraction"] = {"over_cap": over_cap, "ooms": stats()["num_ooms"] - ooms_before,
                   "still_works": float(small.sum().item()), "reserved": stats()["reserved_bytes.all.current"],
                   "cap": int(total * 0.05)}
torch.cuda.set_per_process_memory_fraction(1.0)
big = torch.empty(int(total * 0.08) // 4, device="cuda")
out["fraction"]["after_raising_cap"] = "allocated"
del big, small

# 5. Threads: allocations from fresh Python threads (no current context).
import threading

errors = []


def worker(i):
    try:
        t = torch.full((1 << 16,), float(i), device="cuda")
        assert float(t.sum().item()) == float(i) * (1 << 16)
    except Exception as e:  # noqa: BLE001
        errors.append(repr(e))


threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
out["threads"] = {"errors": errors}
out["stats_final"] = {k: v for k, v in stats().items() if k.startswith("goalloc.") or k.startswith("num_")}
print(json.dumps(out))
sys.stdout.flush()
