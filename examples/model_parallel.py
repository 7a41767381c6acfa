"""Model parallelism on two GPUs with goalloc: the first half of a small
transformer on cuda:0, the second half on cuda:1, activations moved between
them with .to() (a peer copy when the GPUs can reach each other). Prints one
JSON line with the losses, throughput and each device's peak memory, so a run
with goalloc and one with PyTorch's own allocator can be compared at the same
seed:

    python3 examples/model_parallel.py --allocator goalloc
    python3 examples/model_parallel.py --allocator native
    (the library: PYTHONPATH=python GOALLOC_LIBRARY=build/libgoalloc.so,
     or an installed goalloc package)
"""
import argparse
import json
import time

ap = argparse.ArgumentParser()
ap.add_argument("--allocator", choices=["goalloc", "native", "expandable"], default="goalloc")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--warmup", type=int, default=5, help="first steps not timed")
ap.add_argument("--json", help="append the result as one JSON line to this file")
args = ap.parse_args()

if args.allocator == "goalloc":
    import goalloc

    goalloc.install()  # before CUDA starts
elif args.allocator == "expandable":
    import os

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402

if torch.cuda.device_count() < 2:
    raise SystemExit("model_parallel.py needs two CUDA devices")

# The process's own device memory before the model: CUDA contexts and
# libraries, which no allocator controls.
idle = []
for d in (0, 1):
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(d)
    idle.append(total - free)

torch.manual_seed(1234)
vocab, width, layers = 8000, 512, 4
first = torch.nn.Sequential(
    torch.nn.Embedding(vocab, width),
    torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True, dropout=0.0),
                                layers),
).to("cuda:0")
second = torch.nn.Sequential(
    torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True, dropout=0.0),
                                layers),
    torch.nn.Linear(width, vocab),
).to("cuda:1")
opt = torch.optim.AdamW(list(first.parameters()) + list(second.parameters()), lr=3e-4)
gen = torch.Generator().manual_seed(99)
tokens, losses = 0, []
peak_used = [0, 0]


def sample_device_memory():
    for d in (0, 1):
        free, total = torch.cuda.mem_get_info(d)
        peak_used[d] = max(peak_used[d], total - free - idle[d])


for d in (0, 1):
    torch.cuda.synchronize(d)
start = time.time()
for step in range(args.steps):
    batch = int(torch.randint(8, 17, (1,), generator=gen))
    seq = int(torch.randint(64, 513, (1,), generator=gen))
    x = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inp, target = x[:, :-1].to("cuda:0"), x[:, 1:].to("cuda:1")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = first(inp)
        logits = second(h.to("cuda:1"))  # the activation crosses to the second GPU
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()  # gradients cross back to cuda:0
    opt.step()
    losses.append(loss.item())
    if step + 1 == args.warmup:  # the clock starts after the warm-up steps
        for d in (0, 1):
            torch.cuda.synchronize(d)
        start, tokens = time.time(), 0
    elif step >= args.warmup:
        tokens += batch * seq
    sample_device_memory()
for d in (0, 1):
    torch.cuda.synchronize(d)
elapsed = time.time() - start
sample_device_memory()
result = {
    "allocator": args.allocator, "steps": args.steps, "tokens_per_s": tokens / elapsed,
    "losses": losses, "final_loss": losses[-1],
    "peak_allocated": [torch.cuda.max_memory_allocated(d) for d in (0, 1)],
    "peak_reserved": [torch.cuda.max_memory_reserved(d) for d in (0, 1)],
    "peak_device_used": peak_used,
}
print(json.dumps(result), flush=True)
if args.json:
    with open(args.json, "a") as f:
        f.write(json.dumps(result) + "\n")
