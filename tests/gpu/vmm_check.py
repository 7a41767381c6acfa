"""The VMM backend (GOALLOC_CONF=backend:vmm) inside PyTorch, against the
stream-ordered pool (backend:async), each in a fresh process because the
allocator is installed before CUDA starts:

  train   a small transformer, 40 steps of variable length, through
          goalloc.install(); the loss must fall. Then what the device lost
          (torch.cuda.mem_get_info, against the figure read right after
          install) is compared with goalloc's memory_reserved() and the
          backend's own reserved figure (the physical bytes it holds, for
          vmm). With vmm the three should agree up to what CUDA itself
          takes for kernels and library workspaces; with async the device
          holds what the pool keeps besides.
  cap     backend:vmm with fraction:0.25: 1 GiB tensors until torch raises
          OutOfMemoryError; the device must never lose more than the cap
          (plus the same CUDA overhead).

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

    conf = {"async": "backend:async", "vmm": "backend:vmm", "cap": "backend:vmm,fraction:0.25"}[mode]
    goalloc.install(conf)
    free0, total = torch.cuda.mem_get_info()
    out = {"conf": conf, "total": total}

    def device_lost():
        return free0 - torch.cuda.mem_get_info()[0]

    if mode == "cap":
        cap = int(0.25 * total)
        held, worst, oom = [], 0, None
        for _ in range(int(total // (1 << 30)) + 2):
            try:
                held.append(torch.empty(1 << 28, dtype=torch.float32, device="cuda"))  # 1 GiB
            except torch.OutOfMemoryError as e:
                oom = str(e).splitlines()[0][:300]
                break
            worst = max(worst, device_lost())
        out.update(cap=cap, tensors=len(held), device_lost_max=worst, oom=oom,
                   reserved=goalloc.memory_reserved(),
                   backend_reserved=goalloc.fragmentation().pool_reserved_bytes)
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
    for mode in ("async", "vmm", "cap"):
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
    v = res.get("vmm")
    if v:
        # The backend's figure is the physical memory: at least goalloc's
        # reserved, and what the device lost, up to CUDA's own overhead.
        check(v["backend_reserved"] >= v["reserved"], "vmm: backend reserved below goalloc's reserved")
        # memory_reserved() and max_memory_reserved() report the physical
        # memory itself on this backend (caching/held.go).
        check(v["reserved"] == v["backend_reserved"],
              f"vmm: memory_reserved() {v['reserved']}, the backend holds {v['backend_reserved']}")
        check(v["reserved_peak"] == v["backend_reserved_high"],
              f"vmm: max_memory_reserved() {v['reserved_peak']}, the backend's high-water {v['backend_reserved_high']}")
        check(abs(v["device_lost"] - v["backend_reserved"]) <= OVERHEAD,
              f"vmm: the device lost {v['device_lost']} bytes, the backend holds {v['backend_reserved']}")
        a = v["after_empty_cache"]
        check(a["backend_reserved"] <= v["backend_reserved"] // 4,
              f"vmm: empty_cache left {a['backend_reserved']} bytes held")
        check(a["device_lost"] <= a["backend_reserved"] + OVERHEAD, "vmm: the device did not get memory back")
    c = res.get("cap")
    if c:
        check(c["oom"] is not None, "cap: no OutOfMemoryError")
        check(c["device_lost_max"] <= c["cap"] + OVERHEAD,
              f"cap: the device lost {c['device_lost_max']} bytes under a cap of {c['cap']}")
        check(c["backend_reserved"] <= c["cap"], "cap: the backend holds more than the cap")
    res["failures"] = failures
    print(json.dumps(res, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
