"""Data-parallel training with goalloc in every rank: DistributedDataParallel
over NCCL, a small transformer, variable sequence lengths. Prints each rank's
peak memory, throughput and final loss, so a run with goalloc and a run with
PyTorch's own allocator can be compared at the same seed.

    torchrun --nproc_per_node=N examples/ddp_train.py --allocator goalloc
    torchrun --nproc_per_node=N examples/ddp_train.py --allocator native
    (the library: PYTHONPATH=python GOALLOC_LIBRARY=build/libgoalloc.so,
     or an installed goalloc package)

Each rank calls goalloc.install() before it touches CUDA; a per-rank cap goes
in GOALLOC_CONF (fraction:0.5) or through set_per_process_memory_fraction.
"""
import argparse
import json
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--allocator", choices=["goalloc", "native", "expandable"], default="goalloc")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--fsdp", action="store_true", help="FullyShardedDataParallel instead of DDP")
ap.add_argument("--warmup", type=int, default=5, help="first steps not timed")
ap.add_argument("--json", help="append one JSON line per rank to this file")
args = ap.parse_args()

rank = int(os.environ.get("RANK", "0"))
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))

if args.allocator == "goalloc":
    import goalloc

    goalloc.install()  # each rank, before CUDA starts
elif args.allocator == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
# This rank's device memory before the model (CUDA context, NCCL's buffers,
# libraries): what no allocator controls. Peaks below are measured above it.
# NCCL sets its communicator up at the first collective, so run one first and
# give the allocator's memory back.
warm = torch.ones(1, device="cuda")
dist.all_reduce(warm)
del warm
torch.cuda.synchronize()
torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info()
idle_used, peak_used = total - free, 0
torch.manual_seed(1234)  # same weights in every rank and in both runs
vocab, width = 8000, 512
model = torch.nn.Sequential(
    torch.nn.Embedding(vocab, width),
    torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True, dropout=0.0), 4),
    torch.nn.Linear(width, vocab),
).cuda()
if args.fsdp:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(model)
else:
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
gen = torch.Generator().manual_seed(99 + rank)  # each rank its own data, same in both runs
tokens, losses = 0, []
torch.cuda.synchronize()
start = time.time()
for step in range(args.steps):
    batch = int(torch.randint(8, 17, (1,), generator=gen))
    seq = int(torch.randint(64, 513, (1,), generator=gen))
    x = torch.randint(0, vocab, (batch, seq + 1), generator=gen).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if step + 1 == args.warmup:  # the clock starts after the warm-up steps
        torch.cuda.synchronize()
        start, tokens = time.time(), 0
    elif step >= args.warmup:
        tokens += batch * seq
    free, total = torch.cuda.mem_get_info()
    peak_used = max(peak_used, total - free - idle_used)
torch.cuda.synchronize()
elapsed = time.time() - start
free, total = torch.cuda.mem_get_info()
result = {
    "rank": rank, "world": world, "allocator": args.allocator, "mode": "fsdp" if args.fsdp else "ddp",
    "steps": args.steps, "tokens_per_s": tokens / elapsed, "final_loss": losses[-1], "loss_first": losses[0],
    "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
    "device_used": total - free, "peak_device_used": peak_used, "idle_used": idle_used,
}
if args.allocator == "goalloc":
    s = goalloc.memory_stats()
    result["goalloc_ooms"] = s["num_ooms"]
    result["goalloc_bad_input"] = {k: v for k, v in s.items() if k.startswith("goalloc.bad_input.") and v}
print(json.dumps(result), flush=True)
if args.json:
    with open(args.json, "a") as f:
        f.write(json.dumps(result) + "\n")
dist.destroy_process_group()
