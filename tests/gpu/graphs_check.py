"""CUDA graph capture and replay with goalloc as PyTorch's allocator (issue:
CUDA graphs). Prints one JSON object; tests/gpu/test_graphs.py asserts on it.

    GOALLOC_LIBRARY=build/libgoalloc.so python3 tests/gpu/graphs_check.py
"""
import gc
import json

import torch

from rawlib import RawGoalloc  # noqa: E402

goalloc = RawGoalloc()
goalloc.install(torch)
out = {}


stats = goalloc.stats


def private_free_bytes():
    """Memory goalloc could give back but keeps in graph pools, by pool: free
    large blocks and wholly free small segments. A released pool must keep
    none, only memory still live (such as the cuBLAS workspace torch
    allocated during a capture and keeps) and the free slots of segments
    that still have a live slot."""
    snap = goalloc.snapshot(0)
    free = {}
    for d in snap:
        for s in d["segments"]:
            pid = str(tuple(s["segment_pool_id"]))
            if pid == "(0, 0)":
                continue
            free.setdefault(pid, 0)
            if s["active_size"] == 0:
                free[pid] += s["total_size"]
    return free


def pool_ids():
    snap = goalloc.snapshot(0)
    return sorted({tuple(s["segment_pool_id"]) for d in snap for s in d["segments"]} - {(0, 0)})


def capture_and_replay(name, model, shape, replays=100, pool=None):
    model = model.cuda().eval()
    static_in = torch.randn(*shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):  # warm up outside the capture, as torch's docs say
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g, pool=pool):
        static_out = model(static_in)
    worst = 0.0
    for i in range(replays):
        x = torch.randn(*shape, device="cuda")
        static_in.copy_(x)
        g.replay()
        with torch.no_grad():
            ref = model(x)
        worst = max(worst, (static_out - ref).abs().max().item())
    torch.cuda.synchronize()
    out[name] = {"replays": replays, "max_abs_diff": worst, "graph_pool": list(g.pool())}
    return g, static_out


torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
g1, o1 = capture_and_replay("mlp", mlp, (64, 512))
st = stats()
out["after_capture"] = {"graph_pools": st["goalloc.graph_pools"], "graph_bytes": st["goalloc.graph_pools.reserved_bytes"],
                        "pool_ids_seen_by_goalloc": pool_ids(), "pool_id_torch": list(g1.pool())}
block = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
g2, o2 = capture_and_replay("transformer_block", block, (8, 128, 256))
# A third graph sharing the first graph's pool.
g3, o3 = capture_and_replay("shared_pool", torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()), (64, 512),
                            pool=g1.pool())
st = stats()
out["three_graphs"] = {"graph_pools": st["goalloc.graph_pools"], "graph_bytes": st["goalloc.graph_pools.reserved_bytes"],
                       "pool_ids_seen_by_goalloc": pool_ids()}
# Release: graphs and their outputs go; the pools' memory goes back.
del g1, o1, g3, o3
gc.collect()
torch.cuda.synchronize()
st = stats()
out["after_release_shared"] = {"graph_pools": st["goalloc.graph_pools"], "graph_bytes": st["goalloc.graph_pools.reserved_bytes"],
                               "hooks": [st["goalloc.graph_hooks." + h] for h in ("begin", "end", "release")],
                               "free_in_pools": private_free_bytes()}
del g2, o2
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
st = stats()
out["after_release_all"] = {"graph_pools": st["goalloc.graph_pools"], "graph_bytes": st["goalloc.graph_pools.reserved_bytes"],
                            "hooks": [st["goalloc.graph_hooks." + h] for h in ("begin", "end", "release")],
                            "free_in_pools": private_free_bytes(),
                            "bad_input": {k: v for k, v in st.items() if k.startswith("goalloc.bad_input.") and v}}
# make_graphed_callables, the training-side API.
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
x = torch.randn(32, 256, device="cuda", requires_grad=True)
graphed = torch.cuda.make_graphed_callables(model, (x,))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(20):
    inp = torch.randn(32, 256, device="cuda", requires_grad=True)
    loss = graphed(inp).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
out["make_graphed_callables"] = {"first": losses[0], "last": losses[-1]}
# torch.compile(mode="reduce-overhead") uses cudagraph trees, which call
# allocator functions a pluggable allocator cannot provide. Record what happens.
try:
    f = torch.compile(lambda t: (t * 2).sin(), mode="reduce-overhead")
    for _ in range(3):
        f(torch.randn(1000, device="cuda"))
    torch.cuda.synchronize()
    out["compile_reduce_overhead"] = "ran"
except Exception as e:  # noqa: BLE001
    out["compile_reduce_overhead"] = (type(e).__name__ + ": " + str(e))[:300]
# A graph destroyed while a capture into its pool is open: torch calls
# release_pool inside the capture window. goalloc defers the release until
# the window ends (it used to drop the pool under the window, and the next
# allocation of the capture crashed the process). In the default ("global")
# capture error mode the H200 invalidated the capture when the graph was
# destroyed inside it (the capture's next allocation got
# CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), most likely at torch's
# cudaGraphExecDestroy, a call such a capture does not allow; so this capture
# is made in "relaxed" mode. It runs last: a failed capture leaves torch's RNG
# believing a capture is still under way, and the checks after it would fail.
try:
    before = stats()
    lin = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()).cuda().eval()
    ga, oa = capture_and_replay("release_first", lin, (64, 512), replays=3)
    static_in = torch.randn(64, 512, device="cuda")
    gb = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(gb, pool=ga.pool(), capture_error_mode="relaxed"):
        del ga, oa
        gc.collect()  # torch releases ga's pool: the window into it is open
        static_out = lin(static_in) * 2
    worst = 0.0
    for _ in range(20):
        x = torch.randn(64, 512, device="cuda")
        static_in.copy_(x)
        gb.replay()
        with torch.no_grad():
            worst = max(worst, (static_out - lin(x) * 2).abs().max().item())
    mid = stats()
    del gb, static_out
    gc.collect()
    torch.cuda.synchronize()
    after = stats()
    hooks = lambda st: [st["goalloc.graph_hooks." + h] for h in ("begin", "end", "release")]  # noqa: E731
    out["release_during_capture"] = {
        "max_abs_diff": worst,
        "hooks_during": [m - b for m, b in zip(hooks(mid), hooks(before))],
        "hooks_after": [a_ - b for a_, b in zip(hooks(after), hooks(before))],
        "invalid_pool": after.get("goalloc.bad_input.invalid_pool", 0),
    }
except Exception as e:  # noqa: BLE001
    out["release_during_capture"] = {"error": (type(e).__name__ + ": " + str(e))[:300]}
print(json.dumps(out))
