"""The VMM backend (GOALLOC_CONF=backend:vmm) inside PyTorch, against the
stream-ordered pool (backend:async), each in a fresh process because the
allocator is installed before CUDA starts:

  train   a small transformer, 40 steps of variable length, through
          goalloc.install(); the loss must fall. Then what the device lost
          (torch.cuda.mem_get_info, against the figure read right after
          install) is compared with goalloc's memory_reserved() and the
          backend's own reserved figure (the physical bytes it holds, for
          vmm; the pool's CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, for async).
          On both backends memory_reserved() and max_memory_reserved() are
          the backend's figure and its high-water mark, and the three agree
          up to what CUDA itself takes for kernels and library workspaces.
  cap     backend:vmm with fraction:0.25 (cap_async: backend:async): 40 MiB
          tensors up to half the cap with every other one freed (the
          survivors pin the pool's chunks), then 1 GiB tensors until torch
          raises OutOfMemoryError; the device must never lose more than the
          cap (plus the same CUDA overhead).

Prints one JSON object and exits 1 if a check fails. Skips (exit 0) without
torch or CUDA. Run from the repository root, library built:

    GOALLOC_LIBRARY=build/libgoalloc.so PYTHONPATH=python python3 tests/gpu/vmm_check.py
"""
import json
import os
import subprocess
import sys

# CUDA's own memory next to goalloc's: lazily loaded kernels, cuBLAS handles.
OVERHEAD = 256 << 20


def child(mode):
    import torch
    import goalloc

    conf = {"async": "backend:async", "vmm": "backend:vmm", "cap": "backend:vmm,fraction:0.25",
            "cap_async": "backend:async,fraction:0.25"}[mode]
    goalloc.install(conf)
    free0, total = torch.cuda.mem_get_info()
    out = {"conf": conf, "total": total}

    def device_lost():
        return free0 - torch.cuda.mem_get_info()[0]

    if mode.startswith("cap"):
        cap = int(0.25 * total)
        held, worst, oom = [], 0, None
        # Holes first: freed 40 MiB tensors between live ones, so that what
        # the backend holds is more than goalloc's own count.
        holes = [torch.empty(40 << 20, dtype=torch.uint8, device="cuda") for _ in range(cap // 2 // (40 << 20))]
        del holes[::2]
        worst = device_lost()
        for _ in range(int(total // (1 << 30)) + 2):
            try:
                held.append(torch.empty(1 << 28, dtype=torch.float32, device="cuda"))  # 1 GiB
            except torch.OutOfMemoryError as e:
                oom = str(e).splitlines()[0][:300]
                break
            worst = max(worst, device_lost())
        frag = goalloc.fragmentation()
        out.update(cap=cap, tensors=len(held), device_lost_max=worst, oom=oom,
                   reserved=goalloc.memory_reserved(), reserved_peak=goalloc.max_memory_reserved(),
                   own_reserved=goalloc.memory_stats()["goalloc.own_reserved_bytes.current"],
                   backend_reserved=frag.pool_reserved_bytes, backend_reserved_high=frag.pool_reserved_high_bytes)
        return out

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(2000, 512),
        torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 4),
        torch.nn.Linear(512, 2000),
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 2000, (64, 257), device="cuda")
    losses = []
    for step in range(40):
        seq = 64 + (step * 37) % 193  # variable length, as in real training
        logits = model(data[:, :seq])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 2000), data[:, 1:seq + 1].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    frag = goalloc.fragmentation()
    st = goalloc.memory_stats()
    out.update(first_loss=losses[0], last_loss=losses[-1],
               allocated_peak=st["allocated_bytes.all.peak"], reserved_peak=st["reserved_bytes.all.peak"],
               reserved=goalloc.memory_reserved(), backend_reserved=frag.pool_reserved_bytes,
               backend_reserved_high=frag.pool_reserved_high_bytes, device_lost=device_lost())
    del model, opt, data, logits, loss
    torch.cuda.empty_cache()
    out.update(after_empty_cache={"reserved": goalloc.memory_reserved(),
                                  "backend_reserved": goalloc.fragmentation().pool_reserved_bytes,
                                  "device_lost": device_lost()})
    return out


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return 0
    try:
        import torch
    except ImportError:
        print(json.dumps({"skipped": "no torch"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    res, failures = {}, []
    for mode in ("async", "vmm", "cap", "cap_async"):
        env = dict(os.environ)
        env.pop("GOALLOC_CONF", None)
        p = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True, text=True,
                           timeout=150)
        if p.returncode != 0:
            failures.append(f"{mode}: exit {p.returncode}: {p.stderr[-2000:]}")
            continue
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])

    def check(cond, what):
        if not cond:
            failures.append(what)

    for mode in ("async", "vmm"):
        r = res.get(mode)
        if r is None:
            continue
        r["device_over_reserved"] = round(r["device_lost"] / max(r["reserved"], 1), 3)
        r["reserved_peak_over_allocated_peak"] = round(r["reserved_peak"] / max(r["allocated_peak"], 1), 3)
        check(r["last_loss"] < r["first_loss"], f"{mode}: the loss did not fall")
    for mode in ("async", "vmm"):
        v = res.get(mode)
        if v is None:
            continue
        # memory_reserved() and max_memory_reserved() report what the
        # backend holds, on both backends (caching/held.go): what the
        # device lost, up to CUDA's own overhead.
        check(v["reserved"] == v["backend_reserved"],
              f"{mode}: memory_reserved() {v['reserved']}, the backend holds {v['backend_reserved']}")
        check(v["reserved_peak"] == v["backend_reserved_high"],
              f"{mode}: max_memory_reserved() {v['reserved_peak']}, the backend's high-water {v['backend_reserved_high']}")
        check(abs(v["device_lost"] - v["backend_reserved"]) <= OVERHEAD,
              f"{mode}: the device lost {v['device_lost']} bytes, the backend holds {v['backend_reserved']}")
        a = v["after_empty_cache"]
        check(a["reserved"] == a["backend_reserved"],
              f"{mode}: after empty_cache memory_reserved() {a['reserved']}, the backend holds {a['backend_reserved']}")
        check(a["backend_reserved"] <= v["backend_reserved"] // 4,
              f"{mode}: empty_cache left {a['backend_reserved']} bytes held")
        check(a["device_lost"] <= a["backend_reserved"] + OVERHEAD, f"{mode}: the device did not get memory back")
    for mode in ("cap", "cap_async"):
        c = res.get(mode)
        if c is None:
            continue
        check(c["oom"] is not None, f"{mode}: no OutOfMemoryError")
        check(c["device_lost_max"] <= c["cap"] + OVERHEAD,
              f"{mode}: the device lost {c['device_lost_max']} bytes under a cap of {c['cap']}")
        check(c["backend_reserved"] <= c["cap"], f"{mode}: the backend holds more than the cap")
        check(c["reserved_peak"] <= c["cap"], f"{mode}: max_memory_reserved() {c['reserved_peak']} above the cap")
        check(c["reserved"] == c["backend_reserved"],
              f"{mode}: memory_reserved() {c['reserved']}, the backend holds {c['backend_reserved']}")
    res["failures"] = failures
    print(json.dumps(res, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
