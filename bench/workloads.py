#!/usr/bin/env python3
"""One benchmark run: one workload under one allocator configuration, in this process.

bench/suite.py starts this script once per (workload, configuration, repeat),
each in a fresh process, so that memory one run cached never inflates the
next, and an allocator swap (which lasts for the life of a process) never
leaks into another configuration. It is not imported by the suite: torch,
transformers and torchvision are imported here only, inside the functions
that need them, so that `--help` and the suite's tests work without them.

    python3 bench/workloads.py --workload micro --config goalloc --repeat 0 --out R.json

Configurations (the parent sets the environment; this script does the rest):

    native           PyTorch's caching allocator, as shipped
    expandable       the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    async            PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
    goalloc          goalloc.install("backend:async"): goalloc is torch's
                     allocator, over a CUDA stream-ordered pool
    goalloc-vmm      goalloc.install("backend:vmm"): the same, its memory mapped
                     by goalloc itself (cuMemCreate/cuMemMap; goalloc's default)
    goalloc-mempool  torch's allocator, with the workload inside
                     `with torch.cuda.use_mem_pool(goalloc.mempool())`
    c-floor          bench/cfloor.c (a trivial free list) as torch's pluggable
                     allocator: the cost of torch's pluggable path itself

Workloads:

    env        versions and the GPU (no timing)
    micro      alloc+free pairs through torch.empty (4 KiB, 1 MiB, 64 MiB, bursts
               of 64 mixed sizes), then the cross-stream producer/consumer loop
    gpt2       GPT-2 124M training steps with a batch and sequence length drawn per step
    llama      a 12-layer LLaMA (672M parameters, grouped-query attention) likewise
    resnet50   ResNet-50 training steps with a batch and resolution drawn per step

The result is one JSON object written to --out (atomically). Sections are
written as they complete, so a run that dies part way still leaves what it
finished; "ok" is true only when the whole run finished.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostcount import HostCounters, cpu_roles, pin_threads, thread_delta, thread_times  # noqa: E402  (bench/hostcount.py)

CONFIGS = ("native", "expandable", "async", "goalloc", "goalloc-vmm", "goalloc-mempool", "c-floor")
WORKLOADS = ("env", "micro", "gpt2", "llama", "resnet50")
# The configurations whose figures are goalloc's own (goalloc.memory_stats).
GOALLOC_INSTALLED = ("goalloc", "goalloc-vmm")
# The backends of goalloc and goalloc-vmm, added to any GOALLOC_CONF the
# suite passes (which may not name a backend: that is what tells them apart).
ASYNC_CONF = "backend:async"
VMM_CONF = "backend:vmm"
# The training workloads whose unit is tokens; the seed offset of each
# workload's shapes, so that two workloads of one repeat draw apart.
TOKEN_WORKLOADS = ("gpt2", "llama")
SHAPE_SEED = {"gpt2": 1, "resnet50": 2, "llama": 3}
# goalloc.memory_stats keys of its cache misses' latency (its calls to its
# memory source), in nanoseconds; a library older than them has none.
MISS_LATENCY_KEYS = ("p50", "p99", "max", "count")
KiB, MiB = 1 << 10, 1 << 20
# --record-history keeps this many events: a ResNet-50 run of the suite makes
# 68,000-78,000 allocations, each an alloc and a free.
HISTORY_ENTRIES = 1_000_000

# The alloc+free pair sizes (bytes) and the burst: 64 sizes log-uniform in
# [512 B, 16 MiB], freed in a shuffled order, the same in every run.
PAIR_SIZES = (("4KiB", 4 * KiB), ("1MiB", MiB), ("64MiB", 64 * MiB))
BURST_LEN = 64
BURST_SEED = 1234

# The cross-stream workload: buffers the producer allocates every iteration.
CROSS_SIZES = (256 * KiB, 8 * MiB, 32 * MiB)


def backend_conf(base: str, backend: str) -> str:
    """A goalloc configuration's GOALLOC_CONF: base (the suite's --goalloc-conf), then its backend."""
    return ",".join(x for x in (base.strip(" ,"), backend) if x)


def vmm_conf(base: str) -> str:
    """goalloc-vmm's GOALLOC_CONF."""
    return backend_conf(base, VMM_CONF)


def async_conf(base: str) -> str:
    """goalloc's GOALLOC_CONF: the stream-ordered pool, named (it is not goalloc's default)."""
    return backend_conf(base, ASYNC_CONF)


def miss_latency(stats: dict[str, Any]) -> Optional[dict[str, int]]:
    """The latency of goalloc's cache misses (calls to its memory source) from
    its memory_stats: p50, p99, max (ns) and count over the process so far;
    None when the library does not report them."""
    out = {k: stats.get(f"goalloc.device_alloc_ns.{k}") for k in MISS_LATENCY_KEYS}
    if all(v is None for v in out.values()):
        return None
    return {k: int(v) for k, v in out.items() if v is not None}


def driver_totals(stats: dict[str, Any]) -> dict[str, int]:
    """goalloc's driver calls so far, from its memory_stats: every call and
    its time (goalloc.driver.<function>.count and .ns, summed), and the
    handle moves and growth of the VMM backend (cuMemUnmap and cuMemCreate
    calls). Taken after every training step, their differences say which
    steps went to the driver; all zero where the backend keeps no profile."""
    out = {"calls": 0, "ns": 0, "unmaps": 0, "creates": 0}
    for k, v in stats.items():
        if not k.startswith("goalloc.driver.") or not isinstance(v, int):
            continue
        if k.endswith(".count"):
            out["calls"] += v
        elif k.endswith(".ns"):
            out["ns"] += v
    out["unmaps"] = int(stats.get("goalloc.driver.cuMemUnmap.count", 0))
    out["creates"] = int(stats.get("goalloc.driver.cuMemCreate.count", 0))
    return out


def burst_plan() -> tuple[list[int], list[int]]:
    """The burst's sizes (multiples of 512 B) and the order they are freed in."""
    rng = random.Random(BURST_SEED)
    lo, hi = math.log(512), math.log(16 * MiB)
    sizes = [max(512, int(math.exp(rng.uniform(lo, hi))) // 512 * 512) for _ in range(BURST_LEN)]
    order = list(range(BURST_LEN))
    rng.shuffle(order)
    return sizes, order


def train_shapes(workload: str, repeat: int, count: int, limits: dict[str, int]) -> list[tuple[int, int]]:
    """The (batch, length) or (batch, resolution) of every step of a run.

    Drawn from a generator seeded by the repeat and the workload alone, so
    every configuration of one repeat trains on exactly the same shapes, and
    the repeats (those of a later call's --first-repeat too) differ.
    """
    rng = random.Random(7919 * (repeat + 1) + SHAPE_SEED[workload])
    shapes = []
    for _ in range(count):
        if workload in TOKEN_WORKLOADS:
            b = rng.randint(limits["batch_min"], limits["batch_max"])
            s = rng.randrange(limits["seq_min"], limits["seq_max"] + 1, 64)
        else:
            b = rng.randrange(limits["batch_min"], limits["batch_max"] + 1, 8)
            s = rng.randrange(limits["res_min"], limits["res_max"] + 1, 16)
        shapes.append((b, s))
    return shapes


# --- results --------------------------------------------------------------------


def write_json_atomic(path: str, data: Any) -> None:
    """Write data as JSON to path through a temporary file and a rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# --- the allocator of a configuration ---------------------------------------------


class Allocator:
    """The configuration's allocator in this process: set up, scoped, and read.

    setup() runs before CUDA starts (the allocator swaps need that), start()
    right after, scope() is entered around the workload, and figures() reads
    the allocator's own counters: reserved and allocated bytes, current and
    peak, and how many times it went to the driver.
    """

    def __init__(self, torch: Any, config: str):
        self.torch = torch
        self.config = config
        self.pool: Any = None
        self.cfloor: Optional[ctypes.CDLL] = None
        self.goalloc: Any = None
        self.pool_reserved_max = 0  # goalloc's driver pool, max of the readings so far

    def setup(self) -> None:
        torch = self.torch
        if self.config in GOALLOC_INSTALLED + ("goalloc-mempool",):
            import goalloc

            self.goalloc = goalloc
        if self.config == "goalloc":
            self.goalloc.install(async_conf(os.environ.get("GOALLOC_CONF", "")))
        elif self.config == "goalloc-vmm":
            self.goalloc.install(vmm_conf(os.environ.get("GOALLOC_CONF", "")))
        elif self.config == "c-floor":
            path = os.environ.get("BENCH_CFLOOR_LIB", "")
            if not path or not os.path.isfile(path):
                raise RuntimeError(f"c-floor: BENCH_CFLOOR_LIB={path!r} is not a built libcfloor.so")
            lib = ctypes.CDLL(path)
            lib.cfloor_stats.argtypes = [ctypes.POINTER(ctypes.c_longlong)]
            lib.cfloor_stats.restype = None
            alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "cfloor_malloc", "cfloor_free")
            raw = alloc.allocator()

            def addr(name: str) -> int:
                v = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                if not v:
                    raise RuntimeError(f"c-floor: {path} has no {name}")
                return int(v)

            raw.set_init_fn(addr("cfloor_init"))
            raw.set_reset_fn(addr("cfloor_empty_cache"))
            raw.set_record_stream_fn(addr("cfloor_record_stream"))
            torch.cuda.memory.change_current_allocator(alloc)
            self.cfloor = lib

    def start(self) -> None:
        """After CUDA has started: the goalloc MemPool, if this configuration uses one."""
        if self.config == "goalloc-mempool":
            self.pool = self.goalloc.mempool()

    def scope(self) -> Any:
        if self.pool is not None:
            return self.torch.cuda.use_mem_pool(self.pool)
        return contextlib.nullcontext()

    def read_pool(self) -> Optional[int]:
        """goalloc's driver pool reserved bytes now, kept as a running maximum.

        goalloc sets the pool's release threshold to its maximum, so the pool
        keeps what it reserved until goalloc trims it (empty_cache, or an
        out-of-memory retry): the maximum of these readings, taken after every
        step, is then the pool's reserved high-water mark.
        """
        if self.goalloc is None:
            return None
        f = self.goalloc.fragmentation(0)
        v = int(f.pool_reserved_bytes)
        # The pool's own high-water mark, when the library reports it, is
        # exact where the readings between steps could miss a peak.
        self.pool_reserved_max = max(self.pool_reserved_max, v, int(getattr(f, "pool_reserved_high_bytes", 0)))
        return v

    def call_clock(self, mode: str) -> None:
        """Start goalloc's call clock (goalloc._cxx.set_call_clock); the run
        fails if the class is not torch's allocator."""
        from goalloc import _cxx

        _cxx.set_call_clock(mode)

    def read_call_clock(self) -> dict[str, Any]:
        """Stop the call clock and read it: by kind, calls, ns and histogram."""
        from goalloc import _cxx

        _cxx.set_call_clock("off")
        return _cxx.read_call_clock()

    def device_allocs(self) -> Optional[int]:
        """How many allocations this allocator asked the driver for so far."""
        if self.cfloor is not None:
            return self._cfloor_stats()["device_allocs"]
        if self.config in GOALLOC_INSTALLED:
            return int(self.goalloc.memory_stats(0).get("num_device_alloc", 0))
        if self.config == "async":
            return None  # cudaMallocAsync goes to the driver's pool on every call; torch keeps no count
        return int(self.torch.cuda.memory_stats(0).get("num_device_alloc", 0))

    def _cfloor_stats(self) -> dict[str, int]:
        assert self.cfloor is not None
        out = (ctypes.c_longlong * 8)()
        self.cfloor.cfloor_stats(out)
        keys = ("reserved_current", "reserved_peak", "allocated_current", "allocated_peak",
                "device_allocs", "device_frees", "cache_hits", "cache_misses")
        return dict(zip(keys, (int(v) for v in out)))

    def figures(self) -> dict[str, Any]:
        """The allocator's own figures, in bytes (see the class doc)."""
        torch = self.torch
        if self.cfloor is not None:
            s = self._cfloor_stats()
            return {"source": "cfloor_stats", "reserved_peak": s["reserved_peak"],
                    "reserved_current": s["reserved_current"], "allocated_peak": s["allocated_peak"],
                    "allocated_current": s["allocated_current"], "stats": s}
        out: dict[str, Any]
        if self.config in GOALLOC_INSTALLED:
            s = self.goalloc.memory_stats(0)
            out = {"source": "goalloc.memory_stats"}
        else:
            s = torch.cuda.memory_stats(0)
            out = {"source": "torch.cuda.memory_stats"}
        out.update({
            "reserved_peak": s.get("reserved_bytes.all.peak"),
            "reserved_current": s.get("reserved_bytes.all.current"),
            "allocated_peak": s.get("allocated_bytes.all.peak"),
            "allocated_current": s.get("allocated_bytes.all.current"),
            "requested_peak": s.get("requested_bytes.all.peak"),
            "stats": s,
        })
        if self.goalloc is not None:
            f = self.goalloc.fragmentation(0)
            self.read_pool()
            out["pool_reserved_current"] = int(f.pool_reserved_bytes)
            out["pool_used_current"] = int(f.pool_used_bytes)
            out["pool_reserved_max_read"] = self.pool_reserved_max
            out["pool_reserved_high"] = int(getattr(f, "pool_reserved_high_bytes", 0))
            g = s
            if self.config == "goalloc-mempool":
                # goalloc's own view of the segments it handed torch's pool.
                g = self.goalloc.memory_stats(0)
                out["goalloc_reserved_peak"] = g.get("reserved_bytes.all.peak")
                out["goalloc_allocated_peak"] = g.get("allocated_bytes.all.peak")
                out["goalloc_stats"] = g
            lat = miss_latency(g)
            if lat is not None:
                out["device_alloc_ns"] = lat
        return out

    def verify(self) -> dict[str, Any]:
        """What this process really runs, to catch a configuration that did not take."""
        torch = self.torch
        v: dict[str, Any] = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        try:
            v["backend"] = torch.cuda.get_allocator_backend()
        except Exception as e:  # pluggable allocators may not answer
            v["backend"] = f"unknown ({type(e).__name__})"
        if self.config == "expandable":
            try:
                segs = torch.cuda.memory._snapshot()["segments"]
                v["expandable_segments"] = any(s.get("is_expandable") for s in segs) if segs else None
            except Exception as e:
                v["expandable_segments"] = f"unknown ({type(e).__name__}: {e})"
        if self.goalloc is not None:
            v["goalloc_library"] = self.goalloc.library_path()
            v["goalloc_conf"] = self.goalloc.config().get("conf")
        return v


# --- device memory, as the driver sees it ------------------------------------------


class DeviceMemory:
    """Peak device memory in use, from torch.cuda.mem_get_info (the driver's count).

    The baseline is taken right after CUDA starts, before any allocation; the
    peak is the largest reading from sample() (called after every training
    step) and from a background thread that samples every interval_ms while
    started. Memory the CUDA context grows into later (kernel modules loaded
    lazily, library handles) counts too, for every configuration alike.
    """

    def __init__(self, torch: Any, interval_ms: float):
        self.torch = torch
        self.interval = interval_ms / 1000.0
        self.lock = threading.Lock()
        free, total = torch.cuda.mem_get_info(0)
        self.total = int(total)
        self.baseline = int(total - free)
        self.peak = self.baseline
        self.samples = 0
        self.sample_seconds = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> int:
        t0 = time.perf_counter()
        free, total = self.torch.cuda.mem_get_info(0)
        used = int(total - free)
        with self.lock:
            self.samples += 1
            self.sample_seconds += time.perf_counter() - t0
            if used > self.peak:
                self.peak = used
        return used

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        if self.interval > 0 and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="mem-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def figures(self) -> dict[str, Any]:
        end = self.sample()
        with self.lock:
            return {
                "baseline_used": self.baseline,
                "peak_used": self.peak,
                "peak_over_baseline": self.peak - self.baseline,
                "end_over_baseline": end - self.baseline,
                "total": self.total,
                "samples": self.samples,
                "mean_sample_us": self.sample_seconds / self.samples * 1e6 if self.samples else None,
                "interval_ms": self.interval * 1000.0,
            }


# --- the workloads ---------------------------------------------------------------


def run_env(torch: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Versions and the GPU. Also brings every module the workloads import
    into the page cache (and compiles its bytecode) once, before timing."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda}
    for name in ("transformers", "torchvision"):
        try:
            mod = __import__(name)
            out[name] = mod.__version__
        except Exception as e:
            out[name] = f"unavailable ({type(e).__name__}: {e})"
    try:
        from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401
    except Exception as e:
        out["transformers_gpt2"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    except Exception as e:
        out["transformers_llama"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import torchvision.models  # noqa: F401
    except Exception as e:
        out["torchvision_models"] = f"unavailable ({type(e).__name__}: {e})"
    if not args.smoke_cpu:
        p = torch.cuda.get_device_properties(0)
        out.update({"gpu": p.name, "gpu_memory": int(p.total_memory),
                    "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                    "cudnn": torch.backends.cudnn.version(),
                    # Which physical GPU "cuda:0" is when CUDA_VISIBLE_DEVICES picks one.
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "gpu_uuid": str(getattr(p, "uuid", "")) or None})
        try:
            out["cuda_driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        except Exception:
            out["cuda_driver"] = None
    return out


def time_loop(torch: Any, body: Callable[[int], None], target_s: float, rounds: int,
              per_call: int) -> dict[str, Any]:
    """Time body(n), which does n iterations of per_call pairs each, in rounds.

    The iteration count is calibrated so that one round lasts about target_s;
    the result is the median over rounds of microseconds per pair.
    """
    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        body(n)
        t1 = time.perf_counter_ns()
        return (t1 - t0) / 1e9

    n = 16
    while True:
        t = timed(n)
        if t >= target_s / 8 or n >= 1 << 20:
            break
        n *= 4
    n = max(16, min(int(n * target_s / max(t, 1e-9)), 1 << 20))
    us = [timed(n) / (n * per_call) * 1e6 for _ in range(rounds)]
    return {"us_per_pair": median(us), "rounds_us": us, "iterations": n, "pairs_per_iteration": per_call}


def run_micro(torch: Any, alloc: Allocator, mem: DeviceMemory, args: argparse.Namespace,
              checkpoint: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The cross-stream loop first, on a fresh allocator, so that its memory
    figures are its own; then alloc+free pairs through torch.empty."""
    dev = torch.device("cuda", 0)
    empty, u8 = torch.empty, torch.uint8
    out: dict[str, Any] = {}

    def pair_body(size: int) -> Callable[[int], None]:
        def body(n: int) -> None:
            for _ in range(n):
                empty(size, dtype=u8, device=dev)  # made and freed at once: one pair
        return body

    sizes, order = burst_plan()

    def burst_body(n: int) -> None:
        hold: list[Any] = [None] * BURST_LEN
        for _ in range(n):
            for i, s in enumerate(sizes):
                hold[i] = empty(s, dtype=u8, device=dev)
            for j in order:
                hold[j] = None

    cases = [(name, pair_body(size), 1) for name, size in PAIR_SIZES]
    cases.append((f"burst{BURST_LEN}", burst_body, BURST_LEN))
    with alloc.scope():
        out["cross_stream"] = run_cross_stream(torch, alloc, mem, args)
        checkpoint(out)
        out["pairs"] = {}
        for name, body, per_call in cases:
            body(8)  # the first pairs fill the caches
            before = alloc.device_allocs()
            r = time_loop(torch, body, args.micro_round_s, args.micro_rounds, per_call)
            after = alloc.device_allocs()
            r["device_allocs_during"] = None if before is None or after is None else after - before
            out["pairs"][name] = r
            checkpoint(out)
        out["pairs_allocator"] = alloc.figures()
    return out


def run_cross_stream(torch: Any, alloc: Allocator, mem: DeviceMemory, args: argparse.Namespace) -> dict[str, Any]:
    """A producer stream allocates and fills buffers every iteration; a consumer
    stream reads them after it; Tensor.record_stream tells the allocator, so
    the freed buffers can be reused only once the consumer is done.

    Called inside the allocator's scope, first thing in the process, so the
    allocator's peaks and the device's peak over the idle baseline are this
    loop's (with its warm-up and accumulators). The sampler thread runs during
    the loop only. The accumulators' final values are checked: a buffer
    reused before its consumer had read it would show as a wrong sum.
    """
    dev = torch.device("cuda", 0)
    f32 = torch.float32
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    passes = args.cross_passes
    with torch.cuda.stream(consumer):
        accs = [torch.zeros(b // 4, dtype=f32, device=dev) for b in CROSS_SIZES]
    torch.cuda.synchronize()

    def iteration(i: int) -> None:
        with torch.cuda.stream(producer):
            bufs = [torch.empty(b // 4, dtype=f32, device=dev) for b in CROSS_SIZES]
            for x in bufs:
                x.fill_(float(i % 8))
        consumer.wait_stream(producer)
        with torch.cuda.stream(consumer):
            for _ in range(passes):
                for a, x in zip(accs, bufs):
                    a.add_(x)
        for x in bufs:
            x.record_stream(consumer)
        del bufs  # freed in the producer's stream order while the consumer may still read them

    mem.start()
    warm, iters = args.cross_warmup, args.cross_iters
    for i in range(warm):
        iteration(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(warm, warm + iters):
        iteration(i)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    mem.stop()
    expected = float(passes * sum(i % 8 for i in range(warm + iters)))
    wrong = [float(a.min().item()) != expected or float(a.max().item()) != expected for a in accs]
    return {
        "iterations": iters,
        "seconds": seconds,
        "iterations_per_s": iters / seconds,
        "buffers": list(CROSS_SIZES),
        "consumer_passes": passes,
        "correct": not any(wrong),
        "allocator": alloc.figures(),
        "device": mem.figures(),
    }


def causal_lm(torch: Any, dev: Any, model_cls: Any, cfg: Any) -> tuple[Any, Any, Callable[[tuple[int, int]], tuple[Any, int]]]:
    """A causal language model of model_cls from cfg, randomly initialised on
    the device (nothing is downloaded), with AdamW; forward((batch, length))
    draws random tokens and returns the loss and the tokens it took."""
    with dev:
        model = model_cls(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = cfg.vocab_size

    def forward(shape: tuple[int, int]) -> tuple[Any, int]:
        b, s = shape
        ids = torch.randint(0, vocab, (b, s), device=dev)
        loss = model(input_ids=ids, labels=ids).loss
        return loss, b * s

    return model, opt, forward


def build_gpt2(torch: Any, dev: Any, tiny: bool = False) -> tuple[Any, Any, Callable[[tuple[int, int]], tuple[Any, int]]]:
    """GPT-2 124M from its default config. tiny: 2 narrow layers (--smoke-cpu)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return causal_lm(torch, dev, GPT2LMHeadModel, GPT2Config(n_layer=2, n_head=2, n_embd=64) if tiny else GPT2Config())


# The LLaMA of the llama workload: 12 layers of hidden size 2048, 16 query
# heads sharing 4 key/value heads (grouped-query attention), a 32000-token
# vocabulary and untied embeddings: 672M parameters. --smoke-cpu's is tiny.
LLAMA_CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
LLAMA_TINY_CONFIG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)


def build_llama(torch: Any, dev: Any, tiny: bool = False) -> tuple[Any, Any, Callable[[tuple[int, int]], tuple[Any, int]]]:
    """LlamaForCausalLM from LLAMA_CONFIG (LLAMA_TINY_CONFIG with tiny)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return causal_lm(torch, dev, LlamaForCausalLM, LlamaConfig(**(LLAMA_TINY_CONFIG if tiny else LLAMA_CONFIG)))


BUILDERS = {"gpt2": build_gpt2, "llama": build_llama}


def build_resnet50(torch: Any, dev: Any, tiny: bool = False) -> tuple[Any, Any, Callable[[tuple[int, int]], tuple[Any, int]]]:
    """torchvision's ResNet-50, random weights, channels_last, SGD with momentum."""
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(dev, memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    def forward(shape: tuple[int, int]) -> tuple[Any, int]:
        b, r = shape
        x = torch.randn(b, 3, r, r, device=dev).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (b,), device=dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss, b

    return model, opt, forward


def planning_steps(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """One untimed step of every distinct shape of a run, in order of first
    use (--plan-shapes). cuDNN plans a convolution once per shape, on the
    host, in 100-250 ms a ResNet-50 step on the H200 (bench/steady.py), the
    same under every allocator and spread +-20% between processes; a long run
    trains each shape many times. With these first, the timed steps measure
    training, where an allocator's cost shows, not the first sight of a shape."""
    return list(dict.fromkeys(shapes))


def train_limits(args: argparse.Namespace, workload: str) -> dict[str, int]:
    if workload in TOKEN_WORKLOADS:
        batch, seq = (args.gpt2_batch, args.gpt2_seq) if workload == "gpt2" else (args.llama_batch, args.llama_seq)
        return {"batch_min": batch[0], "batch_max": batch[1], "seq_min": seq[0], "seq_max": seq[1]}
    return {"batch_min": args.resnet_batch[0], "batch_max": args.resnet_batch[1],
            "res_min": args.resnet_res[0], "res_max": args.resnet_res[1]}


def run_train(torch: Any, alloc: Optional[Allocator], mem: Optional[DeviceMemory],
              args: argparse.Namespace, host: Optional[HostCounters] = None) -> dict[str, Any]:
    """Training steps with a shape drawn per step; wall time per step between
    device synchronisations; the allocator's and the driver's peak memory;
    with host, what each step cost the host (bench/hostcount.py)."""
    workload = args.workload
    cuda = not args.smoke_cpu
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warmup, steps = args.warmup, args.steps
    shapes = train_shapes(workload, args.repeat, warmup + steps, train_limits(args, workload))
    planned = planning_steps(shapes) if args.plan_shapes else []
    warmup += len(planned)
    shapes = planned + shapes
    unit = "tokens" if workload in TOKEN_WORKLOADS else "images"
    scope = alloc.scope() if alloc is not None else contextlib.nullcontext()
    torch.manual_seed(1000 + args.repeat)  # the same weights and data for every configuration of a repeat
    log: list[dict[str, Any]] = []
    out: dict[str, Any] = {"unit": unit, "warmup": warmup, "steps": steps, "limits": train_limits(args, workload),
                           "planned_shapes": len(planned)}
    with scope:
        t_build = time.perf_counter()
        build = BUILDERS.get(workload, build_resnet50)
        model, opt, forward = build(torch, dev, tiny=not cuda)
        sync()
        out["build_s"] = time.perf_counter() - t_build
        if mem is not None:
            mem.start()
        history = getattr(args, "record_history", None)
        if history:
            # The run's allocations in torch's snapshot form, stack traces left
            # out, for `goalloc replay FILE` on the simulated device.
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, context=None)
        clock = getattr(args, "call_clock", "off")
        threads_before: Optional[dict[int, tuple[str, float]]] = None
        turns = Turns(args.turns) if args.turns else None
        for i, shape in enumerate(shapes):
            if turns is not None:
                turns.wait()
            sync()
            if clock != "off" and i == warmup:
                alloc.call_clock(clock)
            if args.pin_threads and i in (1, warmup):
                # After the first step (torch's autograd thread starts at the
                # first backward), and again before the timed steps, for
                # threads started meanwhile.
                cpus = args.pin_threads
                out["pinned_threads"] = pin_threads(cpus[0], cpus[1], set(cpus[2:]), threading.get_native_id())
            if host is not None and i == warmup:
                threads_before = thread_times()
            before = host.read() if host is not None else None
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss, units = forward(shape)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            dt = time.perf_counter() - t0
            entry = {"shape": list(shape), "seconds": dt, "units": units, "timed": i >= warmup,
                     "loss": float(loss.detach().float().item())}
            if host is not None and before is not None:
                entry["host"] = host.delta(before, host.read())
            del loss
            if mem is not None:
                entry["device_used"] = mem.sample()
            if alloc is not None and alloc.goalloc is not None:
                entry["pool_reserved"] = alloc.read_pool()
                if alloc.config in GOALLOC_INSTALLED:
                    entry["goalloc_driver"] = driver_totals(alloc.goalloc.memory_stats(0))
            log.append(entry)
            if turns is not None:
                entry["turn"] = turns.done()
        if turns is not None:
            turns.finish()
        if history:
            torch.cuda.memory._dump_snapshot(history)
            torch.cuda.memory._record_memory_history(enabled=None)
            out["history"] = history
        if threads_before is not None:
            # Per thread, over the timed steps: who spent the host's time.
            out["threads"] = thread_delta(threads_before, thread_times(), threading.get_native_id())
        if mem is not None:
            mem.stop()
        if clock != "off":
            out["call_clock"] = {"mode": clock, "steps": steps, "kinds": alloc.read_call_clock()}
        timed = [e for e in log if e["timed"]]
        seconds = sum(e["seconds"] for e in timed)
        out.update({
            "step_log": log,
            "timed_seconds": seconds,
            "timed_units": sum(e["units"] for e in timed),
            "units_per_s": sum(e["units"] for e in timed) / seconds if seconds > 0 else None,
            "median_step_s": median([e["seconds"] for e in timed]) if timed else None,
            "losses_finite": all(math.isfinite(e["loss"]) for e in log),
        })
        if alloc is not None:
            out["allocator"] = alloc.figures()
        if mem is not None:
            out["device"] = mem.figures()
        del model, opt, forward
    return out


class Turns:
    """Training in lockstep with another process (bench/lockstep.py): before
    each step, wait for the coordinator's go; after it, and after the step's
    own bookkeeping, say done. The two processes of a pair so take turns
    step by step on one GPU and one host, each step alone, and a slow
    stretch of the host falls on both configurations' steps alike.

    Bytes on two pipes inherited from the coordinator: it writes b"g" on
    ours; we answer b"d" after each step and b"e" after the last, then
    close, so that end of file without b"e" means this process died."""

    def __init__(self, fds: tuple[int, int]):
        self.go, self.reply = fds
        self.started = 0.0

    def wait(self) -> None:
        if os.read(self.go, 1) != b"g":
            raise RuntimeError("lockstep: the coordinator went away before the run's last step")
        self.started = time.monotonic()

    def done(self) -> list[float]:
        """Say done; the step's turn, [start, end] on the system's monotonic
        clock, which both processes of a pair read alike."""
        turn = [self.started, time.monotonic()]
        os.write(self.reply, b"d")
        return turn

    def finish(self) -> None:
        os.write(self.reply, b"e")
        os.close(self.reply)
        os.close(self.go)


def turn_fds(s: str) -> tuple[int, int]:
    try:
        go, reply = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: want GO,REPLY, two file descriptors") from None
    if go < 0 or reply < 0:
        raise argparse.ArgumentTypeError(f"{s!r}: file descriptors are not negative")
    return go, reply


# --- the process -----------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--config", default="native", choices=CONFIGS)
    p.add_argument("--repeat", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSON result file")
    p.add_argument("--sample-ms", type=float, default=5.0,
                   help="mem_get_info sampling interval of the background thread; 0 turns it off")
    p.add_argument("--micro-rounds", type=int, default=5)
    p.add_argument("--micro-round-s", type=float, default=0.05, help="seconds per timed round")
    p.add_argument("--cross-iters", type=int, default=1000)
    p.add_argument("--cross-warmup", type=int, default=50)
    p.add_argument("--cross-passes", type=int, default=2, help="consumer passes over each buffer")
    p.add_argument("--warmup", type=int, default=3, help="training steps before the timed ones")
    p.add_argument("--steps", type=int, default=10, help="timed training steps")
    p.add_argument("--gpt2-batch", type=int, nargs=2, default=(4, 8), metavar=("MIN", "MAX"))
    p.add_argument("--gpt2-seq", type=int, nargs=2, default=(256, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--llama-batch", type=int, nargs=2, default=(1, 8), metavar=("MIN", "MAX"))
    p.add_argument("--llama-seq", type=int, nargs=2, default=(512, 3072), metavar=("MIN", "MAX"),
                   help="sequence lengths, drawn in multiples of 64 from MIN")
    p.add_argument("--plan-shapes", action="store_true",
                   help="before the warm-up, one untimed step of every distinct shape the run trains")
    p.add_argument("--resnet-batch", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"))
    p.add_argument("--resnet-res", type=int, nargs=2, default=(160, 224), metavar=("MIN", "MAX"))
    p.add_argument("--call-clock", choices=("off", "on", "probe"), default="off",
                   help="goalloc's C++ class times its calls into Go over the timed steps (goalloc_clock.h); "
                        "probe: an empty call into Go before each, timed apart")
    p.add_argument("--turns", type=turn_fds, metavar="GO,REPLY",
                   help="training steps in lockstep with another process: the pipes bench/lockstep.py hands down")
    p.add_argument("--pin-threads", type=cpu_roles, metavar="MAIN,AUTOGRAD,OTHER[,OTHER...]",
                   help="training: pin the training thread, torch's autograd thread and the other threads to "
                        "these CPUs (bench/hostcount.py's pin_threads)")
    p.add_argument("--record-history", metavar="FILE.pickle",
                   help="training: record every allocation of the steps with torch's _record_memory_history and "
                        "dump the snapshot to FILE (goalloc replay reads it)")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="run the training loop on the CPU with no allocator (a check of the model code, no figures)")
    args = p.parse_args(argv)
    if args.smoke_cpu and (args.workload in ("micro",) or args.config != "native"):
        p.error("--smoke-cpu runs env, gpt2, llama or resnet50 with --config native only")
    if args.record_history and (args.smoke_cpu or args.workload in ("env", "micro")):
        p.error("--record-history: training on the GPU only (torch records the CUDA allocator's history)")
    if (args.turns or args.pin_threads) and args.workload in ("env", "micro"):
        p.error("--turns, --pin-threads: only the training workloads take turns or pin threads")
    if args.call_clock != "off" and args.config not in GOALLOC_INSTALLED:
        p.error(f"--call-clock needs a configuration with goalloc's class ({', '.join(GOALLOC_INSTALLED)})")
    return args


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Do the run, filling result; sections are checkpointed to args.out."""
    # Before torch: the perf counters count the threads started after them.
    host = HostCounters()
    result["host_counters"] = {"unavailable": host.unavailable}
    def checkpoint(section: dict[str, Any]) -> None:
        result["result"] = section
        write_json_atomic(args.out, result)

    t0 = time.perf_counter()
    import torch

    result["import_torch_s"] = time.perf_counter() - t0
    if args.workload == "env":
        result["result"] = run_env(torch, args)
        return
    if args.smoke_cpu:
        result["result"] = run_train(torch, None, None, args, host)
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    alloc = Allocator(torch, args.config)
    alloc.setup()  # before anything starts CUDA
    torch.cuda.init()
    torch.cuda.synchronize()  # the context exists from here on
    mem = DeviceMemory(torch, args.sample_ms)  # the idle baseline: nothing allocated yet
    alloc.start()
    result["ready_s"] = time.perf_counter() - t0
    if args.workload == "micro":
        checkpoint(run_micro(torch, alloc, mem, args, checkpoint))
    else:
        checkpoint(run_train(torch, alloc, mem, args, host))
    result["verify"] = alloc.verify()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = time.time()
    result: dict[str, Any] = {"workload": args.workload, "config": args.config, "repeat": args.repeat,
                              "ok": False, "pid": os.getpid(), "argv": sys.argv[1:]}
    try:
        run(args, result)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - whatever stops the run is reported in its result file
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        print(result["traceback"], file=sys.stderr)
    result["child_wall_s"] = time.time() - started
    write_json_atomic(args.out, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
