"""Replaying what torch records: a memory snapshot of a small training run,
taken with torch's own functions, replayed by `goalloc replay`.

    python3 tests/gpu/snapshot_check.py native    # PyTorch's caching allocator
    python3 tests/gpu/snapshot_check.py goalloc   # goalloc installed first

Each mode trains a small causal transformer for 20 steps of varying batch
and sequence length with

    torch.cuda.memory._record_memory_history(max_entries=1000000, context=None)
    ... the steps ...
    torch.cuda.memory._dump_snapshot(PATH)

(context=None: no stack traces, which keeps the pickle small; with stacks a
snapshot holds several KB an event), writes the pickle to
$GOALLOC_GPU_OUT/native-snapshot.pickle (goalloc mode: goalloc-snapshot.pickle;
without GOALLOC_GPU_OUT, a temporary folder), replays it with build/goalloc,
and prints one JSON object; tests/gpu/test_snapshot.py asserts on it.

native mode asserts the point of the exercise: the native policy, replaying
the snapshot, peaks within 2% of the run's own torch.cuda.max_memory_reserved().
"""

import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "build", "goalloc")
STEPS = 20

mode = sys.argv[1] if len(sys.argv) > 1 else "native"
if mode not in ("native", "goalloc"):
    sys.exit(f"usage: {sys.argv[0]} native|goalloc")
if mode == "goalloc":
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import goalloc

    goalloc.install()
else:
    # The native policy models the default settings.
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)

import torch  # noqa: E402

from scenarios import tiny_lm  # noqa: E402

out_dir = os.environ.get("GOALLOC_GPU_OUT") or tempfile.mkdtemp()
os.makedirs(out_dir, exist_ok=True)
path = os.path.join(out_dir, f"{mode}-snapshot.pickle")

torch.manual_seed(0)
rng = random.Random(0)
# Before anything touches CUDA memory, so that the history starts from an
# empty allocator.
torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
# Sizes large enough that the peak (about a GB) dwarfs the 2 MiB segments of
# torch's small pool, where the replay may place a few blocks differently;
# the number of events, and so the pickle's size, depends on the ops only.
VOCAB = 8192
model = tiny_lm(torch, vocab=VOCAB, width=512, layers=2).cuda()
# fused: one kernel for the update, not a list of temporaries per step,
# which keeps the history (and the pickle) small.
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
shapes = []
for step in range(STEPS):
    n, seq = rng.choice([8, 16, 24, 32]), rng.choice([64, 128, 192, 256, 384, 512])
    shapes.append([n, seq])
    tokens = torch.randint(0, VOCAB, (n, seq + 1), device="cuda")
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device="cuda")
    logits = model(tokens[:, :-1], mask)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
torch.cuda.synchronize()
max_reserved = torch.cuda.max_memory_reserved()
max_allocated = torch.cuda.max_memory_allocated()
torch.cuda.memory._dump_snapshot(path)
torch.cuda.memory._record_memory_history(enabled=None)
size = os.path.getsize(path)


def replay(policy):
    proc = subprocess.run([TOOL, "replay", path, "--policy", policy, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"goalloc replay {path} --policy {policy}: {proc.stderr}"
    return json.loads(proc.stdout), proc.stderr


result = {"mode": mode, "torch": torch.__version__, "steps": STEPS, "shapes": shapes,
          "pickle": path, "pickle_bytes": size,
          "max_memory_reserved": max_reserved, "max_memory_allocated": max_allocated}
for policy in ("native", "goalloc"):
    r, notes = replay(policy)
    s = r["snapshot"]
    result[policy] = {
        "peak_reserved_bytes": r["peak_reserved_bytes"],
        "allocator_peak_reserved_bytes": r["allocator_peak_reserved_bytes"],
        "peak_live_bytes": r["peak_live_bytes"], "events": r["events"],
        "vs_max_memory_reserved": r["peak_reserved_bytes"] / max_reserved - 1,
    }
    result["snapshot"] = {k: s[k] for k in ("recorder", "device", "entries", "actions", "initial_blocks",
                                            "initial_reserved_bytes", "recorded_peak_reserved_bytes")}
    result["notes"] = notes
if mode == "goalloc":
    result["goalloc_max_memory_reserved"] = goalloc.max_memory_reserved()
    # What the history accounts for: goalloc's own segments and blocks
    # (max_memory_reserved() is the pool's high-water mark, above it).
    result["goalloc_own_reserved_peak"] = goalloc.memory_stats()["goalloc.own_reserved_bytes.peak"]

# The checks (test_snapshot.py repeats them on the printed result, and checks
# that the pickle is small enough to commit as a fixture: under 2 MB).
assert result["snapshot"]["entries"] > 0
if mode == "native":
    assert result["snapshot"]["recorder"] == "pytorch"
    assert result["snapshot"]["initial_blocks"] == 0, "the history starts before the first allocation"
    native = result["native"]["peak_reserved_bytes"]
    assert abs(native / max_reserved - 1) <= 0.02, \
        f"native policy peak reserved {native} vs torch.cuda.max_memory_reserved() {max_reserved}"
else:
    # goalloc's own snapshot (the pluggable path) names no recorder; through
    # goalloc's C++ class torch builds it, with goalloc's settings.
    assert result["snapshot"]["recorder"] in ("unknown", "goalloc")
print(json.dumps(result))
