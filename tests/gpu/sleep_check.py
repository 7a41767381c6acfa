"""Memory tags, sleep and wake on a GPU, through goalloc.install() (the C++
class, or the pluggable path with GOALLOC_CXX=0). Prints one JSON object;
tests/gpu/test_sleep_gpu.py asserts on it.

    GOALLOC_LIBRARY=build/libgoalloc.so python3 tests/gpu/sleep_check.py [compile]

The scenario is an RL phase switch: weights and a KV cache tagged, a CUDA
graph captured over the weights, work still queued on a side stream when
sleep is called; after wake the weights must be the same bytes at the same
addresses and the graph must replay as before. "compile" adds
torch.compile(mode="reduce-overhead") across a sleep and wake.
"""
import json
import sys
import threading

import torch

import goalloc

from goalloc import _cxx  # noqa: E402

goalloc.install()
out = {"cxx": _cxx.installed(), "backend": torch.cuda.get_allocator_backend()}
MiB = 1 << 20
dev = torch.device("cuda", 0)


def used():
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        return f"{type(e).__name__}: {e}"
    return None


torch.cuda.init()
torch.zeros(1, device=dev)  # the context, and goalloc's first (untagged) segment
torch.cuda.synchronize()
context = used()

# Untagged memory: another user's tensors, never touched by sleep.
untagged = torch.randn(256 * MiB // 4, device=dev)
untagged_sum = untagged.sum().item()

# Tagged weights (offloaded) and KV cache (discarded).
with goalloc.memory_tag("weights"):
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(dev)
    extra = torch.randn((4 << 30) // 4, device=dev)
weights = [p.detach() for p in model.parameters()] + [extra]
weights_bytes = sum(w.numel() * w.element_size() for w in weights)
with goalloc.memory_tag("kv_cache"):
    kv = torch.empty(8 << 30, dtype=torch.uint8, device=dev)
kv.fill_(7)

# A tagged tensor written by work still queued on a side stream at sleep:
# sleep must wait for that work (its stream's event), not copy too early.
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side), goalloc.memory_tag("weights"):
    busy = torch.zeros(4096, 4096, device=dev)
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(200):  # about tens of milliseconds of matmuls
        torch.mm(a, a, out=busy)
        busy.mul_(1e-3)
    busy.add_(1.0)
with torch.cuda.stream(side):
    expect_busy = busy.clone()  # queued after the writes: the right answer
torch.cuda.current_stream().wait_stream(side)  # only for expect_busy's use below

# A CUDA graph over the weights, captured before the sleep.
static_in = torch.randn(64, 2048, device=dev)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s), torch.no_grad():
    for _ in range(3):
        model(static_in)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.no_grad(), torch.cuda.graph(g):
    static_out = model(static_in)
g.replay()
graph_ref = static_out.clone()
eager_ref = model(static_in).detach().clone()

host_copies = [w.cpu() for w in weights]
ptrs = [w.data_ptr() for w in weights] + [kv.data_ptr(), busy.data_ptr()]
torch.cuda.synchronize()

out["errors"] = {
    "wake_without_sleep": error_of(lambda: goalloc.wake_up()),
    "unknown_tag": error_of(lambda: goalloc.sleep(offload_tags=("no-such-tag",))),
}
# Sleep during a capture: refused, and the capture goes on to replay right.
g2 = torch.cuda.CUDAGraph()
with torch.no_grad(), torch.cuda.graph(g2):
    out["errors"]["during_capture"] = error_of(lambda: goalloc.sleep(offload_tags=("weights",)))
    cap_out = model(static_in)
g2.replay()
out["capture_after_refusal_diff"] = (cap_out - graph_ref).abs().max().item()

# The sleep: queue more work on the side stream first, no synchronize.
with torch.cuda.stream(side):
    for _ in range(50):
        torch.mm(a, a, out=expect_busy)
        expect_busy.mul_(1e-3)
    expect_busy.add_(1.0)
    torch.mm(a, a, out=busy)
    busy.mul_(1e-3)
    busy.add_(1.0)
reserved_before = torch.cuda.memory_reserved(0)
allocated_before = torch.cuda.memory_allocated(0)
used_before = used()
r = goalloc.sleep(offload_tags=("weights",))
torch.cuda.synchronize()
tagged_bytes = weights_bytes + 2 * 4096 * 4096 * 4 + kv.numel()
out["sleep"] = {"offloaded": r.offloaded_bytes, "released": r.released_bytes,
                "weights_bytes": weights_bytes + 2 * 4096 * 4096 * 4,
                "untagged_allocated": torch.cuda.memory_allocated(0) - tagged_bytes,
                "reserved_before": reserved_before, "reserved_after": torch.cuda.memory_reserved(0),
                "allocated_before": allocated_before, "allocated_after": torch.cuda.memory_allocated(0),
                "device_before": used_before - context, "device_after": used() - context,
                "state": goalloc.sleep_state(0)}
out["errors"]["sleep_twice"] = error_of(lambda: goalloc.sleep(offload_tags=()))
out["untagged_use_while_asleep"] = error_of(lambda: (untagged * 2).sum().item())  # None: it works

# Out of memory on wake: a cap that leaves no room, the wake refused with
# torch's exception and everything still asleep; then room, and the wake.
total = torch.cuda.mem_get_info(0)[1]
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(0) + 300 * MiB) / total, 0)
filler = None
try:
    filler = torch.empty(200 * MiB, dtype=torch.uint8, device=dev)
except torch.OutOfMemoryError:
    pass
e = error_of(lambda: goalloc.wake_up())
out["wake_oom"] = {"error": e, "is_torch_oom": False, "asleep": goalloc.sleep_state(0)["asleep"]}
try:
    goalloc.wake_up()
except torch.OutOfMemoryError:
    out["wake_oom"]["is_torch_oom"] = True
except Exception:  # noqa: BLE001
    pass
del filler
torch.cuda.empty_cache()
torch.cuda.set_per_process_memory_fraction(1.0, 0)

w = goalloc.wake_up()
torch.cuda.synchronize()
out["wake"] = {"mapped": w.mapped_bytes, "restored": w.restored_bytes, "woken": list(w.woken),
               "reserved_after": torch.cuda.memory_reserved(0), "device_after": used() - context,
               "state": goalloc.sleep_state(0)}
out["same_addresses"] = ptrs == [x.data_ptr() for x in weights] + [kv.data_ptr(), busy.data_ptr()]
out["weights_equal"] = all(torch.equal(h, x.cpu()) for h, x in zip(host_copies, weights))
out["busy_equal"] = torch.equal(busy, expect_busy)
out["untagged_intact"] = untagged.sum().item() == untagged_sum
kv.fill_(3)
out["kv_usable"] = bool((kv == 3).all().item())
g.replay()
torch.cuda.synchronize()
out["graph_diff"] = (static_out - graph_ref).abs().max().item()
out["eager_diff"] = (model(static_in) - eager_ref).abs().max().item()

# A second cycle: the host area is reused, every tag discarded.
r2 = goalloc.sleep(offload_tags=())
w2 = goalloc.wake_up(tags=["kv_cache"])
w3 = goalloc.wake_up()
out["second"] = {"offloaded": r2.offloaded_bytes, "released": r2.released_bytes,
                 "woken": [list(w2.woken), list(w3.woken)]}

# prepare_sleep from another thread while this one allocates: the host area
# grows, and the allocations were served meanwhile.
before_area = goalloc.sleep_state(0)["host_area_bytes"]
th = threading.Thread(target=goalloc.prepare_sleep, args=(before_area + (2 << 30),))
th.start()
made = [torch.empty(1 << 20, device=dev) for _ in range(200)]
th.join()
del made
out["prepare"] = {"before": before_area, "after": goalloc.sleep_state(0)["host_area_bytes"]}

if "compile" in sys.argv[1:]:
    with goalloc.memory_tag("weights"):
        cm = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).to(dev)
    f = torch.compile(cm, mode="reduce-overhead")
    x = torch.randn(32, 1024, device=dev)
    with torch.no_grad():
        for _ in range(4):
            ref = f(x).clone()
        goalloc.sleep(offload_tags=("weights",))
        goalloc.wake_up()
        again = [f(x).clone() for _ in range(3)]
    out["compile_diff"] = max((y - ref).abs().max().item() for y in again)
print(json.dumps(out))
