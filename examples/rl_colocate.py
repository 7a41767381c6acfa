"""RL-style colocation in one process under goalloc: a rollout engine and a
trainer take turns on one GPU. The engine's weights and KV cache are tagged;
before each training phase they go to sleep (the weights copied to pinned
host memory, the KV cache dropped, the physical memory released at the
same addresses), the trainer's activations use the memory given back, and
the engine wakes for the next rollout with its weights synced in place.
A thread samples memory all along; the timeline goes to an HTML page.

    PYTHONPATH=python GOALLOC_LIBRARY=build/libgoalloc.so python3 examples/rl_colocate.py [--out rl_colocate.html]
"""
import argparse
import threading
import time

import goalloc

goalloc.install()  # before anything touches CUDA

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

GiB = 1 << 30


class Sampler(threading.Thread):
    """(seconds, allocated, reserved, device used above idle, phase), every ~2 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.rows, self.phase, self.stop = [], "start", threading.Event()
        free, total = torch.cuda.mem_get_info()
        self.idle, self.t0 = total - free, time.perf_counter()

    def run(self):
        while not self.stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.rows.append((time.perf_counter() - self.t0, torch.cuda.memory_allocated(),
                              torch.cuda.memory_reserved(), total - free - self.idle, self.phase))
            time.sleep(0.002)


def model(width, layers):
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                                      torch.nn.Linear(4 * width, width)) for _ in range(layers)])


def rollout(engine, kv, gen, width):
    """Decode-like steps: each appends one token's keys and values to the cache."""
    batch = int(torch.randint(16, 65, (1,), generator=gen))
    x = torch.randn(batch, width, device="cuda")
    with torch.no_grad():
        for t in range(int(torch.randint(64, 257, (1,), generator=gen))):
            x = engine(x)
            kv[t % kv.shape[0], :batch].copy_(x)
    return torch.randn(batch * 8, 512, width, device="cuda")  # the "generated" sequences, untagged


def train(policy, opt, data):
    for chunk in data.split(int(data.shape[0] // 4) or 1):
        loss = torch.utils.checkpoint.checkpoint(policy, chunk, use_reentrant=False).square().mean()
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()  # the timeline's phases are the GPU's, not only the launches'


def page(rows, path):
    """An HTML page with the timeline: allocated, reserved and device use (GiB) over seconds."""
    w, h, top = 1000, 360, max(max(r[1:4]) for r in rows) / GiB or 1
    end = rows[-1][0] or 1
    lines = []
    for k, (name, colour) in enumerate((("allocated", "#1f77b4"), ("reserved", "#ff7f0e"), ("device", "#2ca02c"))):
        pts = " ".join(f"{40 + r[0] / end * (w - 60):.1f},{h - 30 - r[k + 1] / GiB / top * (h - 50):.1f}" for r in rows)
        lines.append(f'<polyline fill="none" stroke="{colour}" points="{pts}"/>'
                     f'<text x="{w - 150}" y="{20 + 16 * k}" fill="{colour}">{name}</text>')
    marks, last = [], None
    for r in rows:
        if r[4] != last:
            x = 40 + r[0] / end * (w - 60)
            marks.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="20" y2="{h - 30}" stroke="#ccc"/>'
                         f'<text x="{x + 2:.1f}" y="{h - 14}" font-size="10">{r[4]}</text>')
            last = r[4]
    with open(path, "w") as f:
        f.write(f'<!doctype html><title>goalloc: RL colocation</title><h3>Memory over time (0 to {top:.1f} GiB, '
                f'{end:.1f} s), goalloc</h3><svg width="{w}" height="{h}" font-family="sans-serif" font-size="12">'
                + "".join(marks + lines) + "</svg>")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--out", default="rl_colocate.html")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    width, layers = 2048, 12
    policy = model(width, layers).cuda()  # the trainer's, untagged
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    with goalloc.memory_tag("weights"):
        engine = model(width, layers).cuda().requires_grad_(False)
    with goalloc.memory_tag("kv_cache"):
        kv = torch.empty(256, 64, width, device="cuda")
    sampler = Sampler()
    sampler.start()
    for it in range(args.iterations):
        sampler.phase = f"rollout {it}"
        data = rollout(engine, kv, gen, width)
        sampler.phase = f"sleep {it}"
        s = goalloc.sleep(offload_tags=("weights",))
        sampler.phase = f"train {it}"
        train(policy, opt, data)
        del data
        sampler.phase = f"wake {it}"
        w = goalloc.wake_up()
        with torch.no_grad():  # sync the trained weights into the engine, in place
            for dst, src in zip(engine.parameters(), policy.parameters()):
                dst.copy_(src)
        print(f"iteration {it}: slept {s.offloaded_bytes / GiB:.2f} GiB offloaded, {s.released_bytes / GiB:.2f} GiB "
              f"released; woke {w.restored_bytes / GiB:.2f} GiB restored; peak allocated "
              f"{torch.cuda.max_memory_allocated() / GiB:.2f} GiB, reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB")
    torch.cuda.synchronize()
    sampler.stop.set()
    sampler.join()
    page(sampler.rows, args.out)
    print(f"timeline: {args.out}")


if __name__ == "__main__":
    main()
