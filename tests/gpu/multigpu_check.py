"""Two GPUs with goalloc installed through the Python package, as a user
would: peer copies both ways, a kernel on one device reading the other's
memory, record_stream with the other device's stream, per-device caps, stats
and empty_cache, and allocation for device 1 from a thread whose current
device is 0. Prints one JSON object; tests/gpu/test_multigpu.py asserts on it.

    GOALLOC_LIBRARY=build/libgoalloc.so PYTHONPATH=python python3 tests/gpu/multigpu_check.py [--first 0|1]

--first says which device is used (and gets its goalloc pool) first: peer
access must not depend on the order.
"""
import argparse
import json
import threading

import goalloc

ap = argparse.ArgumentParser()
ap.add_argument("--first", type=int, default=0)
args = ap.parse_args()
goalloc.install()

import torch  # noqa: E402

out = {"devices": torch.cuda.device_count(), "first": args.first}
if out["devices"] < 2:
    print(json.dumps(out))
    raise SystemExit(0)
out["can_access_peer"] = [torch.cuda.can_device_access_peer(0, 1), torch.cuda.can_device_access_peer(1, 0)]
dev = [torch.device("cuda", i) for i in (0, 1)]
first, second = dev[args.first], dev[1 - args.first]


def attempt(fn):
    """fn's value, or the error it raised as a string."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- the test wants the message
        return f"{type(e).__name__}: {e}"


# Pools are made in order: first, then second.
a = torch.arange(1 << 20, device=first, dtype=torch.float32)
torch.cuda.synchronize(first)


def peer_copies(src_dev, dst_dev):
    src = torch.arange(1 << 20, device=src_dev, dtype=torch.float32) * 3
    want = src.cpu()
    res = {}
    res["to"] = attempt(lambda: bool(torch.equal(src.to(dst_dev).cpu(), want)))
    dst = torch.empty(1 << 20, device=dst_dev, dtype=torch.float32)
    res["copy_"] = attempt(lambda: bool(torch.equal(dst.copy_(src).cpu(), want)))
    res["cat"] = attempt(lambda: bool(torch.equal(
        torch.cat([src[: 1 << 19].to(dst_dev), src[1 << 19:].to(dst_dev)]).cpu(), want)))
    # A dtype-converting copy is not a memcpy: with peer access, torch runs a
    # kernel on the destination device that reads the source device's memory.
    res["kernel_reads_peer"] = attempt(lambda: bool(torch.equal(
        torch.empty(1 << 20, device=dst_dev, dtype=torch.float64).copy_(src).cpu(), want.double())))
    # ... and a strided (transposed) copy, also a kernel.
    m = src.view(1024, 1024)
    res["strided"] = attempt(lambda: bool(torch.equal(
        torch.empty(1024, 1024, device=dst_dev).copy_(m.t()).cpu(), want.view(1024, 1024).t())))
    torch.cuda.synchronize(src_dev)
    torch.cuda.synchronize(dst_dev)
    return res


out["peer_0_to_1"] = peer_copies(dev[0], dev[1])
out["peer_1_to_0"] = peer_copies(dev[1], dev[0])


# record_stream with the other device's stream: x lives on device 0 and a
# kernel queued on device 1's side stream, behind a long sleep, reads it
# directly. x is freed at once; goalloc must not hand its memory out again
# until device 1's stream is past that read.
def record_stream_other_device(rounds=20):
    mismatches, s1 = 0, torch.cuda.Stream(device=dev[1])
    for i in range(rounds):
        x = torch.full((1 << 22,), float(i), device=dev[0])
        torch.cuda.synchronize(dev[0])
        with torch.cuda.device(dev[1]), torch.cuda.stream(s1):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time on device 1
            y = torch.empty(1 << 22, device=dev[1], dtype=torch.float64)
            y.copy_(x)  # a kernel on device 1 reading device 0's x
        x.record_stream(s1)
        del x
        junk = [torch.full((1 << 22,), -1.0, device=dev[0]) for _ in range(4)]  # would land on x's memory
        torch.cuda.synchronize(dev[0])
        s1.synchronize()
        if not bool((y == float(i)).all()):
            mismatches += 1
        del y, junk
    st = goalloc.memory_stats(0)
    return {"mismatches": mismatches, "deferred_frees": st["goalloc.deferred_frees"]}


out["record_stream"] = attempt(record_stream_other_device)

# Per-device stats: allocations on device 1 show on device 1 only.
before = [goalloc.memory_allocated(d) for d in (0, 1)]
big = torch.empty(256 << 20, dtype=torch.uint8, device=dev[1])
after = [goalloc.memory_allocated(d) for d in (0, 1)]
out["stats"] = {"delta": [after[d] - before[d] for d in (0, 1)],
                "torch_delta1": torch.cuda.memory_allocated(1) - before[1]}
del big

# Per-device caps: a cap on device 1 refuses there, device 0 is untouched.
torch.cuda.set_per_process_memory_fraction(0.02, device=1)  # ~2.8 GiB of an H200
cap = goalloc.config().get("caps", {})
gib4 = 4 << 30
out["cap"] = {"dev1": attempt(lambda: torch.empty(gib4, dtype=torch.uint8, device=dev[1]) is not None),
              "dev0": attempt(lambda: torch.empty(gib4, dtype=torch.uint8, device=dev[0]) is not None),
              "ooms": [goalloc.memory_stats(d)["num_ooms"] for d in (0, 1)],
              "config_caps": cap}
torch.cuda.set_per_process_memory_fraction(1.0, device=1)
out["cap"]["dev1_after_raise"] = attempt(lambda: torch.empty(gib4, dtype=torch.uint8, device=dev[1]) is not None)

# empty_cache releases on both devices.
keep = [torch.empty(64 << 20, device=d) for d in dev]
del keep
reserved_before = [goalloc.memory_reserved(d) for d in (0, 1)]
torch.cuda.empty_cache()
out["empty_cache"] = {"before": reserved_before, "after": [goalloc.memory_reserved(d) for d in (0, 1)],
                      "allocated": [goalloc.memory_allocated(d) for d in (0, 1)]}

# A thread whose current device is 0 allocates for device 1 (and the reverse
# order of first use is covered by --first 1).
thread_res = {}


def other_thread():
    torch.cuda.set_device(0)
    t = torch.ones(1 << 20, device=dev[1])
    thread_res["sum"] = float(t.sum())
    thread_res["current_after"] = torch.cuda.current_device()
    thread_res["tensor_device"] = t.device.index


th = threading.Thread(target=other_thread)
th.start()
th.join()
out["thread"] = thread_res
out["bad_input"] = {d: {k: v for k, v in goalloc.memory_stats(d).items() if k.startswith("goalloc.bad_input.") and v}
                    for d in (0, 1)}
print(json.dumps(out))
