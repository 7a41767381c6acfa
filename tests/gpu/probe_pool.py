"""Probe how a private CUDA memory pool reserves memory, straight through
libcuda with ctypes (no goalloc code involved). The simulated device's pool
model (arena/simpool.go) is calibrated against what this prints.

    python3 tests/gpu/probe_pool.py > pool.json
"""
import ctypes as C
import json
import sys

cu = C.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what} failed: CUresult {r}")


class Props(C.Structure):
    _fields_ = [("allocType", C.c_int), ("handleTypes", C.c_int), ("locType", C.c_int),
                ("locId", C.c_int), ("win32", C.c_void_p), ("maxSize", C.c_size_t),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 54)]


assert C.sizeof(Props) == 88
ck(cu.cuInit(0), "cuInit")
dev = C.c_int()
ck(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
ctx = C.c_void_p()
ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "setcurrent")
MiB = 1 << 20


class Pool:
    def __init__(self):
        p = Props()
        p.allocType, p.locType, p.locId = 1, 1, 0
        self.h = C.c_void_p()
        ck(cu.cuMemPoolCreate(C.byref(self.h), C.byref(p)), "cuMemPoolCreate")
        v = C.c_uint64(2**64 - 1)
        ck(cu.cuMemPoolSetAttribute(self.h, 4, C.byref(v)), "release threshold")

    def attr(self, a):
        v = C.c_uint64()
        ck(cu.cuMemPoolGetAttribute(self.h, a, C.byref(v)), "getattr")
        return v.value

    def reserved(self):
        return self.attr(5)

    def alloc(self, n, stream=None):
        p = C.c_uint64()
        ck(cu.cuMemAllocFromPoolAsync(C.byref(p), C.c_size_t(n), self.h, C.c_void_p(stream)), f"alloc {n}")
        return p.value

    def free(self, p, stream=None):
        ck(cu.cuMemFreeAsync(C.c_uint64(p), C.c_void_p(stream)), "free")

    def sync(self):
        ck(cu.cuCtxSynchronize(), "sync")

    def trim(self):
        self.sync()
        ck(cu.cuMemPoolTrimTo(self.h, C.c_size_t(0)), "trim")

    def destroy(self):
        self.sync()
        ck(cu.cuMemPoolDestroy(self.h), "destroy")


out = {}
# E1: reserved for one allocation of each size in a fresh pool.
sizes = [512, 4096, 65536, 1 * MiB, 2 * MiB - 512, 2 * MiB, 2 * MiB + 512, 3 * MiB, 8 * MiB + 512,
         20 * MiB, 31 * MiB, 32 * MiB, 32 * MiB + 512, 33 * MiB, 63 * MiB, 64 * MiB + 512, 100 * MiB,
         257 * MiB, 1024 * MiB + 512]
e1 = []
for n in sizes:
    pool = Pool()
    p = pool.alloc(n)
    e1.append({"size": n, "reserved": pool.reserved(), "addr_mod_2M": p % (2 * MiB)})
    pool.free(p)
    pool.destroy()
out["single"] = e1

# E2/E3: a run of equal allocations: how does the pool grow and pack them?
for name, n, count in [("run_1M", 1 * MiB, 40), ("run_3M", 3 * MiB, 24), ("run_20K", 20480, 300),
                       ("run_9M", 9 * MiB, 12), ("run_50M", 50 * MiB, 6)]:
    pool = Pool()
    rows, ptrs = [], []
    for i in range(count):
        p = pool.alloc(n)
        ptrs.append(p)
        rows.append((pool.reserved(), p - ptrs[0]))
    out[name] = {"size": n, "reserved_after_each": [r for r, _ in rows], "offset_from_first": [o for _, o in rows]}
    for p in ptrs:
        pool.free(p)
    pool.destroy()

# E4: do neighbouring frees coalesce? 10M + 10M freed, then 20M.
pool = Pool()
a, b = pool.alloc(10 * MiB), pool.alloc(10 * MiB)
r0 = pool.reserved()
pool.free(a); pool.free(b); pool.sync()
c = pool.alloc(20 * MiB)
out["coalesce_10+10_then_20"] = {"reserved_before": r0, "reserved_after": pool.reserved(), "b_minus_a": b - a, "c_minus_a": c - a}
pool.free(c)
# E5: a freed big block split for two halves.
d = pool.alloc(64 * MiB)
r1 = pool.reserved()
pool.free(d); pool.sync()
e, f = pool.alloc(32 * MiB), pool.alloc(32 * MiB)
out["split_64_then_32+32"] = {"reserved_before": r1, "reserved_after": pool.reserved(), "e_minus_d": e - d, "f_minus_d": f - d}
pool.free(e); pool.free(f)
# E6: small allocations after a large free: do they go into the freed large range?
g = pool.alloc(64 * MiB)
pool.free(g); pool.sync()
r2 = pool.reserved()
h = pool.alloc(4096)
out["small_into_freed_large"] = {"reserved_before": r2, "reserved_after": pool.reserved(), "h_minus_g": h - g}
pool.free(h)
pool.destroy()

# E9: is physical memory fungible? Free two 40 MiB blocks around a live one,
# then ask for 80 MiB: a pool that can remap the freed chunks at the end of
# its range grows little; one that cannot must map 80 MiB more.
pool = Pool()
a, b, c = pool.alloc(40 * MiB), pool.alloc(40 * MiB), pool.alloc(40 * MiB)
r0 = pool.reserved()
pool.free(a); pool.free(c); pool.sync()
d = pool.alloc(80 * MiB)
out["fungible_40_40_40_free_outer_then_80"] = {"reserved_before": r0, "reserved_after": pool.reserved(), "d_minus_a": d - a}
pool.destroy()
# E10: 64 x 1 MiB, free the first 32 (one whole chunk), ask for 40 MiB.
pool = Pool()
ps = [pool.alloc(MiB) for _ in range(64)]
r0 = pool.reserved()
for p in ps[:32]:
    pool.free(p)
pool.sync()
d = pool.alloc(40 * MiB)
out["fungible_free_first_chunk_then_40"] = {"reserved_before": r0, "reserved_after": pool.reserved(), "d_minus_first": d - ps[0]}
pool.destroy()
# E11: after trimming, is the freed hole reused, and remapped?
pool = Pool()
a, b = pool.alloc(64 * MiB), pool.alloc(8 * MiB)
pool.free(a); pool.trim()
r0 = pool.reserved()
c = pool.alloc(64 * MiB)
out["trim_then_realloc"] = {"reserved_after_trim": r0, "reserved_after": pool.reserved(), "c_minus_a": c - a}
pool.destroy()

# E7: cross-stream reuse without completion: free on s1 while s1 is busy,
# alloc on s2. Does the pool grow (no reuse) or reuse (internal dependency)?
s1, s2 = C.c_void_p(), C.c_void_p()
ck(cu.cuStreamCreate(C.byref(s1), 1), "stream")
ck(cu.cuStreamCreate(C.byref(s2), 1), "stream")
pool = Pool()
x = pool.alloc(64 * MiB, s1.value)
pool.free(x, s1.value)
y = pool.alloc(64 * MiB, s2.value)
out["cross_stream_reuse"] = {"reused": x == y, "reserved": pool.reserved()}
pool.free(y, s2.value)
pool.destroy()

# E8: replay each shipped trace straight onto a pool (alloc/free_completed),
# sampling reserved every 2000 events: the curve the simulation must follow.
import gzip
import os

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for name in ("gpt2", "resnet50"):
    pool = Pool()
    ids, live, peak, samples, growth = {}, 0, 0, [], []
    last = 0
    with gzip.open(os.path.join(root, "traces", f"{name}-train.jsonl.gz"), "rt") as f:
        f.readline()
        for i, line in enumerate(f):
            e = json.loads(line)
            if e["a"] == "alloc":
                ids[e["addr"]] = (pool.alloc(e["size"]), e["size"])
                live += e["size"]
                peak = max(peak, live)
                r = pool.reserved()
                if r != last:
                    growth.append((i, e["size"], live, r))
                    last = r
            elif e["a"] == "free_completed" and e["addr"] in ids:
                p, n = ids.pop(e["addr"])
                pool.free(p)
                live -= n
            if i % 2000 == 0:
                samples.append((i, live, pool.reserved()))
    out["replay_" + name] = {"peak_live": peak, "reserved_high": pool.attr(6), "used_high": pool.attr(8),
                             "ratio": pool.attr(6) / peak, "samples": samples, "growth": growth}
    for p, _ in ids.values():
        pool.free(p)
    pool.destroy()
json.dump(out, sys.stdout, indent=1)
print()
