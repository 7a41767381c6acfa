"""GPU scenarios for the goalloc Python package, one fresh process each.

goalloc.install() must come before CUDA starts and lasts for the process, so
every scenario runs alone in its own interpreter. test_python_gpu.py runs
them under pytest; without pytest, run them directly from the repository root:

    python tests/gpu/scenarios.py all [OUT_DIR]     # every scenario, a summary
    python tests/gpu/scenarios.py train [OUT_DIR]   # one scenario, in this process

A scenario raises AssertionError on failure, and on success prints one last
line `RESULT {json}` with what it measured. Without an installed goalloc the
package is taken from python/ and the library from build/libgoalloc.so
(GOALLOC_LIBRARY), which is how the GPU machine, which has no Go, runs them.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def child_env() -> dict[str, str]:
    """The environment a scenario needs: the source-tree package and library
    unless told otherwise, the real CUDA device, no simulated-device settings."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
    env.setdefault("GOALLOC_LIBRARY", str(ROOT / "build" / "libgoalloc.so"))
    env["GOALLOC_DEVICE"] = "cuda"
    for k in ("GOALLOC_SIM_DEVICES", "GOALLOC_SIM_MEMORY", "GOALLOC_CONF"):
        env.pop(k, None)
    return env


# --- helpers used inside scenarios ------------------------------------------------

def tiny_lm(torch: Any, vocab: int = 512, width: int = 256, layers: int = 4) -> Any:
    """A small causal transformer language model."""
    nn = torch.nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
            self.body = nn.TransformerEncoder(layer, num_layers=layers)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens: Any, mask: Any) -> Any:
            return self.head(self.body(self.embed(tokens), mask=mask, is_causal=True))

    return TinyLM()


def batch(torch: Any, vocab: int = 512, n: int = 16, seq: int = 64) -> tuple[Any, Any]:
    """Sequences that count up by one (mod vocab): easy to learn, so the loss falls."""
    start = torch.randint(0, vocab, (n, 1), device="cuda")
    seqs = (start + torch.arange(seq + 1, device="cuda")) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def live_tensor_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct CUDA storages behind tensors."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.is_cuda:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def train(torch: Any, steps: int, measure: Callable[[int, list[Any]], None] | None = None) -> list[float]:
    """Train tiny_lm for some steps; after each optimizer step, call
    measure(step, every tensor the loop still holds)."""
    torch.manual_seed(0)
    model = tiny_lm(torch).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(64, device="cuda")
    losses = []
    for step in range(steps):
        tokens, targets = batch(torch)
        logits = model(tokens, mask)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        del logits, loss
        if measure is not None:
            torch.cuda.synchronize()
            held = [mask, tokens, targets]
            held += [p for p in model.parameters()] + [p.grad for p in model.parameters()]
            held += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
            measure(step, held)
        opt.zero_grad(set_to_none=True)
    del model, opt, mask, tokens, targets
    return losses


# --- scenarios --------------------------------------------------------------------

def scenario_install(out: Path) -> dict[str, Any]:
    """install() makes goalloc torch's allocator; the four hooks reach it; a
    second call is harmless; torch's statistics answer from goalloc."""
    import torch
    import goalloc

    alloc = goalloc.install()
    assert goalloc.install() is alloc, "a second install() returns the same allocator"
    torch.cuda.init()  # CUDA starts here, with goalloc as its allocator
    assert goalloc.install() is alloc, "install() after CUDA started, when installed, is harmless"
    requested = goalloc.memory_stats()["requested_bytes.all.current"]
    x = torch.ones(1 << 20, device="cuda")  # 4 MiB
    assert goalloc.memory_stats()["requested_bytes.all.current"] - requested == 4 * MiB
    assert torch.cuda.memory_allocated() == goalloc.memory_allocated() >= 4 * MiB
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == goalloc.memory_allocated()
    assert "Allocated memory" in torch.cuda.memory_summary()
    assert goalloc.snapshot()["segments"], "goalloc holds the tensor's memory"

    # record_stream hook: the free waits for the side stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2
    x.record_stream(side)
    del x
    side.synchronize()
    deferred = goalloc.memory_stats()["goalloc.deferred_frees"]
    assert deferred >= 1, "Tensor.record_stream reached goalloc"
    assert y.sum().item() == 2 * (1 << 20)
    del y

    # reset hook: torch.cuda.empty_cache() gives goalloc's cache back.
    torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved()
    assert reserved_after < reserved_before, (reserved_before, reserved_after)
    assert goalloc.memory_stats()["num_sync_all_streams"] >= 1

    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    return {"deferred_frees": deferred, "reserved_before_empty_cache": reserved_before,
            "reserved_after_empty_cache": reserved_after, "backend": torch.cuda.get_allocator_backend()}


def scenario_install_after_cuda(out: Path) -> dict[str, Any]:
    """install() after CUDA started raises an error that says what to do."""
    import torch
    import goalloc

    torch.zeros(1, device="cuda")
    try:
        goalloc.install()
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError("install() after CUDA started did not raise")
    assert "before" in msg and "top of the script" in msg, msg
    assert torch.ones(4, device="cuda").sum().item() == 4, "torch goes on with its own allocator"
    return {"message": msg}


def scenario_train(out: Path) -> dict[str, Any]:
    """Train a small transformer on goalloc; after every step,
    torch.cuda.memory_allocated() against the live tensors."""
    import torch
    import goalloc

    goalloc.install()
    rows: list[dict[str, int]] = []

    def measure(step: int, held: list[Any]) -> None:
        s = goalloc.memory_stats()
        rows.append({
            "step": step,
            "live_tensor_bytes": live_tensor_bytes(held),
            "requested": s["requested_bytes.all.current"],
            "allocated": s["allocated_bytes.all.current"],
            "torch_memory_allocated": torch.cuda.memory_allocated(),
            "torch_max_memory_allocated": torch.cuda.max_memory_allocated(),
            "torch_memory_reserved": torch.cuda.memory_reserved(),
        })

    losses = train(torch, steps=30, measure=measure)
    gc.collect()
    torch.cuda.synchronize()
    leftover = goalloc.memory_stats()["requested_bytes.all.current"]  # no tensor left

    # Tensors of known sizes: requested grows by exactly their bytes.
    sizes = [1, 511, 4096, 65536, 65537, 3_000_000, 64 * MiB + 3]
    before = goalloc.memory_stats()
    extra = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    after = goalloc.memory_stats()
    grown_requested = after["requested_bytes.all.current"] - before["requested_bytes.all.current"]
    grown_allocated = after["allocated_bytes.all.current"] - before["allocated_bytes.all.current"]
    del extra

    for r in rows:
        assert r["torch_memory_allocated"] == r["allocated"], r  # torch answers from goalloc
        assert r["allocated"] >= r["requested"] >= r["live_tensor_bytes"], r
        assert r["torch_max_memory_allocated"] >= r["torch_memory_allocated"], r
        assert r["torch_memory_reserved"] >= r["torch_memory_allocated"], r
    # What goalloc holds beyond the live tensors (cuBLAS workspaces) is the
    # same after every step, and is what remains once every tensor is gone.
    overheads = [r["requested"] - r["live_tensor_bytes"] for r in rows[2:]]
    assert len(set(overheads)) == 1, overheads
    assert overheads[0] == leftover, (overheads[0], leftover)
    assert grown_requested == sum(sizes), (grown_requested, sum(sizes))
    assert sum(sizes) <= grown_allocated <= sum(sizes) * 1.25 + 512 * len(sizes), grown_allocated
    assert losses[-1] < 0.5 * losses[0], losses
    assert goalloc.memory_stats()["num_ooms"] == 0
    return {"losses": [round(x, 3) for x in losses[::5]], "last_step": rows[-1],
            "non_tensor_bytes": leftover, "known_sizes_requested": grown_requested,
            "known_sizes_allocated": grown_allocated}


def scenario_fraction(out: Path) -> dict[str, Any]:
    """set_per_process_memory_fraction caps goalloc: an over-cap allocation
    fails with goalloc's message in the exception, and the process keeps working.

    torch 2.11 does not check a NULL from a pluggable allocator: it makes a
    tensor with no memory, and a kernel run on that tensor writes through
    NULL and poisons the CUDA context (illegal memory access). So the failed
    tensor is inspected, never computed on.
    """
    import torch
    import goalloc

    goalloc.install()
    torch.ones(1, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05)
    limit = goalloc.config()["limits"]["0"]
    assert abs(limit - 0.05 * total) < 0.01 * total, (limit, total)
    torch_error = None
    pointer = None
    try:
        big = torch.empty(int(0.10 * total), dtype=torch.uint8, device="cuda")
        pointer = big.untyped_storage().data_ptr()
        del big
    except RuntimeError as e:  # raised with goalloc's message (torch.OutOfMemoryError with the C++ class)
        torch_error = str(e).splitlines()[0]
    assert torch_error is not None, "an allocation of twice the cap did not raise"
    sys.stderr.flush()
    stats = goalloc.memory_stats()
    assert stats["num_ooms"] == 1, stats["num_ooms"]
    # The process keeps working, under the cap.
    a = torch.randn(1024, 1024, device="cuda")
    value = (a @ a).sum().item()
    assert value == value  # not NaN
    torch.cuda.set_per_process_memory_fraction(1.0)
    b = torch.empty(int(0.10 * total), dtype=torch.uint8, device="cuda")
    assert b.untyped_storage().data_ptr() != 0, "the cap lifted, the same allocation succeeds"
    b.fill_(1)
    torch.cuda.synchronize()
    return {"limit": limit, "total": total, "failed_data_ptr": pointer, "torch_error": torch_error}


def scenario_mempool(out: Path) -> dict[str, Any]:
    """goalloc.mempool() with torch.cuda.use_mem_pool: allocations inside the
    block come from goalloc, the rest from torch's own allocator."""
    import torch
    import goalloc

    native = torch.randn(256, 256, device="cuda")  # CUDA already running: mempool() still works
    before = goalloc.memory_stats()
    pool = goalloc.mempool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.randn(2048, 2048, device="cuda")
        y = x @ x
    outside = torch.randn(2048, 2048, device="cuda")
    during = goalloc.memory_stats()

    def in_goalloc(t: Any) -> bool:
        p = t.data_ptr()
        return any(s["address"] <= p < s["address"] + s["total_size"] for s in goalloc.snapshot()["segments"])

    assert in_goalloc(x) and in_goalloc(y), "the pool's tensors live in goalloc's memory"
    assert not in_goalloc(outside) and not in_goalloc(native), "the rest does not"
    # goalloc's own count: the pool's figure (reserved_bytes.all) may not
    # grow if the pool places them in memory it holds idle.
    assert during["goalloc.own_reserved_bytes.current"] >= before["goalloc.own_reserved_bytes.current"] + 2 * 2048 * 2048 * 4
    want = (x.double() @ x.double()).float()
    assert torch.allclose(y, want, rtol=1e-3, atol=1e-2), "the pool's memory computes correctly"
    del x, y, want
    torch.cuda.synchronize()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    released = goalloc.memory_stats()
    return {"goalloc_reserved_during": during["reserved_bytes.all.current"],
            "goalloc_device_allocs": during["num_device_alloc"],
            "goalloc_allocated_after_pool_deleted": released["allocated_bytes.all.current"]}


def scenario_viz(out: Path) -> dict[str, Any]:
    """dump_snapshot() after recorded training steps, turned into HTML by
    python -m torch.cuda._memory_viz (trace_plot and segment_plot)."""
    import torch
    import goalloc

    goalloc.install()
    goalloc.record_history(True, max_entries=100_000)
    train(torch, steps=3)
    out.mkdir(parents=True, exist_ok=True)
    pickle_path = out / "goalloc_snapshot.pickle"
    goalloc.dump_snapshot(pickle_path)
    # torch's own snapshot API answers from goalloc too.
    torch_path = out / "torch_dump_snapshot.pickle"
    torch.cuda.memory._dump_snapshot(str(torch_path))
    snap = goalloc.snapshot()
    events = len(snap["device_traces"][0])
    assert events > 100, events
    made = {}
    for command, html in (("trace_plot", "goalloc_trace.html"), ("segment_plot", "goalloc_segments.html")):
        proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", command, str(pickle_path),
                               "-o", str(out / html)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        text = (out / html).read_text()
        assert "MemoryViz.js" in text, html
        made[html] = len(text)
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(torch_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return {"events": events, "segments": len(snap["segments"]), "html": made, "out": str(out)}


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "install": scenario_install,
    "install_after_cuda": scenario_install_after_cuda,
    "train": scenario_train,
    "fraction": scenario_fraction,
    "mempool": scenario_mempool,
    "viz": scenario_viz,
}


def run_one(name: str, out: Path) -> None:
    result = SCENARIOS[name](out)
    print("RESULT " + json.dumps(result), flush=True)


def run_all(out: Path) -> int:
    failed = 0
    for name in SCENARIOS:
        t = time.time()
        proc = subprocess.run([sys.executable, __file__, name, str(out)], env=child_env(),
                              capture_output=True, text=True)
        ok = proc.returncode == 0
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.time() - t:.1f} s)")
        if not ok:
            print(proc.stdout[-4000:] + proc.stderr[-4000:])
        else:
            print("  " + proc.stdout.strip().splitlines()[-1])
    print(f"{len(SCENARIOS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or (sys.argv[1] != "all" and sys.argv[1] not in SCENARIOS):
        sys.exit(f"usage: {sys.argv[0]} all|{'|'.join(SCENARIOS)} [OUT_DIR]")
    out_dir = Path(sys.argv[2] if len(sys.argv) > 2 else
                   os.environ.get("GOALLOC_GPU_OUT") or tempfile.mkdtemp(prefix="goalloc-gpu-"))
    if sys.argv[1] == "all":
        sys.exit(run_all(out_dir))
    import importlib.util

    if importlib.util.find_spec("goalloc") is None:
        sys.path.insert(0, str(ROOT / "python"))
        os.environ.setdefault("GOALLOC_LIBRARY", str(ROOT / "build" / "libgoalloc.so"))
    run_one(sys.argv[1], out_dir)
