"""goalloc's C++ allocator class inside PyTorch (python/goalloc/csrc): each
check behaves as with PyTorch's own allocator. One check per process, since
install() must precede CUDA's start; prints one JSON object last, which
tests/gpu/test_cxx_gpu.py asserts on. From the repository root:

    GOALLOC_CXX=1 GOALLOC_LIBRARY=build/libgoalloc.so python3 tests/gpu/cxx_check.py CHECK

CHECK is one of oom, stats, cudnn, compile, compile_paths, mempool, graphs, peer.
GOALLOC_CXX=1 makes install() fail rather than fall back to the pluggable
allocator when the class cannot be built; GOALLOC_CXX=0 runs the same check
on the pluggable path (which fails these checks: that is the point of them).
"""
import copy
import json
import os
import pickle
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import goalloc  # noqa: E402
from goalloc import _cxx, _torch  # noqa: E402

MiB = 1 << 20


def install():
    goalloc.install()
    return {"cxx": _cxx.installed(), "backend": torch.cuda.get_allocator_backend(),
            "cxx_failure": _cxx.failure()}


def check_oom():
    """A refusal under set_per_process_memory_fraction raises
    torch.OutOfMemoryError with goalloc's message, and the process goes on."""
    out = install()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.10)
    keep = torch.ones(MiB, device="cuda")
    try:
        torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
    except Exception as e:  # noqa: BLE001  (the type is what is checked)
        out["error_type"] = type(e).__name__
        out["is_oom_error"] = isinstance(e, torch.OutOfMemoryError)
        out["message"] = str(e)[:500]
    else:
        out["error_type"] = None
    # The process goes on: new tensors, kernels, and the old tensor intact.
    x = torch.arange(MiB, device="cuda", dtype=torch.float64)  # every partial sum exact
    out["after_sum_ok"] = x.sum().item() == float(MiB * (MiB - 1) // 2)
    out["keep_ok"] = keep.sum().item() == MiB
    out["num_ooms"] = torch.cuda.memory_stats()["num_ooms"]
    try:  # the pluggable allocator refuses getMemoryFraction
        out["fraction"] = torch.cuda.get_per_process_memory_fraction(0)
    except (AttributeError, RuntimeError):
        out["fraction"] = None
    return out


def check_stats():
    """torch's statistics, snapshot and history functions answer from
    goalloc, through torch's own functions (none replaced)."""
    out = install()
    out["replaced"] = [name for name in _torch._PATCHES
                       if not isinstance(getattr(torch._C, name, None), types.BuiltinFunctionType)]
    torch.cuda.init()
    base = torch.cuda.memory_allocated()
    x = torch.empty(3_000_000, dtype=torch.uint8, device="cuda")
    st, gst = torch.cuda.memory_stats(), goalloc.memory_stats()
    keys = [k for k in gst if not k.startswith("goalloc.") and k in st]
    out["stats_keys_compared"] = len(keys)
    out["stats_mismatch"] = {k: (st[k], gst[k]) for k in keys if st[k] != gst[k]}
    out["allocated_delta"] = torch.cuda.memory_allocated() - base
    out["allocated_equal"] = torch.cuda.memory_allocated() == goalloc.memory_allocated()
    out["reserved_equal"] = torch.cuda.memory_reserved() == goalloc.memory_reserved()
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del y
    out["peak_above_current"] = torch.cuda.max_memory_allocated() > torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out["peak_reset"] = torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    torch.cuda.reset_accumulated_memory_stats()
    out["accumulated_reset"] = torch.cuda.memory_stats()["allocation.all.freed"] == 0
    out["summary_ok"] = "Allocated memory" in torch.cuda.memory_summary()

    torch.cuda.memory._record_memory_history(max_entries=1000)
    z = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    zp = z.data_ptr()
    del z
    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][0]
    out["trace_alloc_seen"] = any(e["action"] == "alloc" and e["addr"] == zp for e in trace)
    out["trace_free_seen"] = any(e["action"].startswith("free") and e["addr"] == zp for e in trace)
    out["segments"] = len(snap["segments"])
    out["x_in_snapshot"] = any(b["state"] == "active_allocated" and b["address"] == x.data_ptr()
                               for s in snap["segments"] for b in s["blocks"])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            dumped = pickle.load(f)
        out["dump_ok"] = bool(dumped["segments"]) and bool(dumped["device_traces"][0])
    torch.cuda.memory._record_memory_history(enabled=None)
    out["history_off"] = not goalloc.config().get("history")
    del x
    return out


def check_cudnn():
    """cudnn.benchmark trains a convolutional net (it asks cacheInfo)."""
    out = install()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for step in range(10):
        x = torch.randn(32, 3, 32 + 8 * (step % 3), 32 + 8 * (step % 3), device="cuda")
        y = torch.randint(0, 10, (32,), device="cuda")
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["losses_finite"] = all(l == l and abs(l) < 1e6 for l in losses)
    out["steps"] = len(losses)
    return out


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 10)).cuda()


def _train(model, steps, data, eval_every=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, evals = [], []
    for step in range(steps):
        x, y = data[step]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if eval_every and step % eval_every == eval_every - 1:
            with torch.no_grad():
                evals.append(model(data[0][0]).float().sum().item())
    return losses, evals


def _compile(eval_every):
    out = install()
    torch.manual_seed(1)
    data = [(torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")) for _ in range(20)]
    eager = _mlp()
    compiled_model = copy.deepcopy(eager)
    eager_losses, eager_evals = _train(eager, 20, data, eval_every)
    from torch._dynamo.utils import counters

    compiled = torch.compile(compiled_model, mode="reduce-overhead")
    losses, evals = _train(compiled, 20, data, eval_every)
    out["eager_losses"], out["losses"] = eager_losses, losses
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(eager_losses, losses))
    out["max_eval_diff"] = max([abs(a - b) for a, b in zip(eager_evals, evals)] or [0.0])
    out["cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
    try:
        from torch._inductor import cudagraph_trees

        mgr = cudagraph_trees.get_container(0).tree_manager
        out["graphs_recorded"] = mgr.graph_counter if mgr is not None else None
        out["checkpoints_applied"] = mgr.debug_checkpointing_counter if mgr is not None else None
    except Exception as e:  # noqa: BLE001  (diagnostics only)
        out["tree_manager"] = repr(e)
    out["pool_bytes"] = goalloc.memory_stats().get("goalloc.graph_pools.reserved_bytes")
    return out


def check_compile():
    """torch.compile(mode="reduce-overhead") trains 20 steps, losses as eager's."""
    return _compile(eval_every=0)


def check_compile_paths():
    """The same, with an inference pass every 5 steps: CUDA graph trees then
    switch paths, which sets the pool back to a checkpoint."""
    return _compile(eval_every=5)


def check_mempool():
    """torch.cuda.MemPool and use_mem_pool in user code, goalloc installed."""
    out = install()
    pool = torch.cuda.MemPool()
    out["use_count_made"] = pool.use_count()
    with torch.cuda.use_mem_pool(pool):
        a = torch.ones(8 * MiB // 4, device="cuda")
        b = torch.ones(1000, device="cuda")
        out["use_count_inside"] = pool.use_count()
    c = torch.ones(8 * MiB // 4, device="cuda")
    out["use_count_after"] = pool.use_count()
    pool_addrs = {blk["address"] for s in pool.snapshot() for blk in s["blocks"]
                  if blk["state"] == "active_allocated"}
    out["pool_segments_own_id"] = all(tuple(s["segment_pool_id"]) == tuple(pool.id) for s in pool.snapshot())
    out["a_b_in_pool"] = {a.data_ptr(), b.data_ptr()} <= pool_addrs
    out["c_not_in_pool"] = c.data_ptr() not in pool_addrs
    out["values_ok"] = a.sum().item() == 2 * MiB and b.sum().item() == 1000 and c.sum().item() == 2 * MiB
    a_ptr = a.data_ptr()
    del a
    with torch.cuda.use_mem_pool(pool):
        a2 = torch.empty(8 * MiB // 4, device="cuda")
    out["pool_reuses_its_memory"] = a2.data_ptr() == a_ptr
    del a2  # back in the pool's cache, which eager allocations never take
    d = torch.empty(8 * MiB // 4, device="cuda")
    out["eager_never_gets_pool_memory"] = d.data_ptr() != a_ptr
    out["goalloc_mempool_is_a_mempool"] = isinstance(goalloc.mempool(), torch.cuda.MemPool)
    del b, pool
    out["graph_pools_after"] = goalloc.memory_stats()["goalloc.graph_pools"]
    return out


def check_graphs():
    """CUDA graphs (capture, replay, a second graph sharing the pool) and
    Tensor.record_stream, as before."""
    out = install()
    x = torch.randn(1 << 16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            y = x * 2 + 1  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tmp = x * 2
        y = tmp + 1
        del tmp
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=g.pool()):
        z = y * 3
    x.copy_(torch.arange(1 << 16, device="cuda", dtype=torch.float32))
    g.replay()
    g2.replay()
    torch.cuda.synchronize()
    want = torch.arange(1 << 16, device="cuda", dtype=torch.float32) * 2 + 1
    out["replay_ok"] = bool(torch.equal(y, want)) and bool(torch.equal(z, want * 3))
    st = goalloc.memory_stats()
    out["graph_pools"] = st["goalloc.graph_pools"]
    out["graph_begins"] = st["goalloc.graph_hooks.begin"]
    del g, g2, y, z
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    deferred = goalloc.memory_stats()["goalloc.deferred_frees"]
    src = torch.full((MiB,), 7.0, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        dst = src * 1
    src.record_stream(side)
    del src
    again = torch.full((MiB,), -1.0, device="cuda")
    side.synchronize()
    out["record_stream_deferred"] = goalloc.memory_stats()["goalloc.deferred_frees"] - deferred
    out["record_stream_data_ok"] = dst.sum().item() == 7.0 * MiB
    del again, dst
    out["bad_input"] = {k: v for k, v in goalloc.memory_stats().items() if k.startswith("goalloc.bad_input")}
    return out


def check_peer():
    """A copy between two devices (contiguous: the allocator's memcpyAsync)."""
    out = install()
    out["devices"] = torch.cuda.device_count()
    if out["devices"] < 2:
        return out
    a = torch.randn(1 << 20, device="cuda:0")
    b = a.to("cuda:1")
    c = torch.empty(1 << 20, device="cuda:0")
    c.copy_(b)
    out["to_ok"] = bool(torch.equal(b.cpu(), a.cpu()))
    out["copy_ok"] = bool(torch.equal(c, a))
    return out


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: cxx_check.py {{{','.join(CHECKS)}}}")
    print(json.dumps(CHECKS[sys.argv[1]](), default=str))
