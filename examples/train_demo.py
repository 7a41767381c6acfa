"""Train a small transformer with goalloc as PyTorch's allocator and show
what goalloc saw: the one-line install, torch's own memory calls answering
from goalloc, and goalloc's summary. `make demo` runs this where torch and a
GPU exist.

    PYTHONPATH=python GOALLOC_LIBRARY=build/libgoalloc.so python3 examples/train_demo.py
"""
import time

import goalloc

goalloc.install()  # before anything touches CUDA

import torch  # noqa: E402


def main(steps: int = 50) -> None:
    torch.manual_seed(0)
    vocab, width = 8000, 512
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True), 4),
        torch.nn.Linear(width, vocab),
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(1)
    tokens = 0
    start = time.time()
    for step in range(steps):
        # Batch and length drawn per step, as with variable-length data.
        batch = int(torch.randint(8, 33, (1,), generator=gen))
        seq = int(torch.randint(64, 513, (1,), generator=gen))
        x = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens += batch * seq
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}  allocated {torch.cuda.memory_allocated() / 2**20:8.1f} MiB"
                  f"  reserved {torch.cuda.memory_reserved() / 2**20:8.1f} MiB")
    torch.cuda.synchronize()
    elapsed = time.time() - start
    print(f"\n{steps} steps, {tokens / elapsed:,.0f} tokens/s")
    print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, "
          f"peak reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB (both from goalloc)\n")
    print(goalloc.memory_summary())
    f = goalloc.fragmentation()
    print(f"fragmentation now: {f}")


if __name__ == "__main__":
    main()
