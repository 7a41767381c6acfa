#!/usr/bin/env python3
"""One benchmark run: one workload under one allocator configuration, in this process.

    python3 bench/workloads.py --workload resnet50 --config goalloc-vmm --repeat 0 --out R.json

bench/suite.py starts it once per (workload, configuration, repeat), a fresh
process each, setting the configuration's environment (bench/README.md lists
them). torch and transformers are imported where needed: --help and the
tests run without them. Workloads: env (versions, the GPU), then steps of a
shape drawn per step: gpt2, llama, resnet50 (training), rollout (RL-style
generate then train), checkpoint (FSDP, activation checkpointing), serving
(generate per request), moe (a mixture of experts). The result is one JSON
object written to --out; "ok" is true only when the whole run finished.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import random
import re
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

CONFIGS = ("native", "expandable", "async", "goalloc", "goalloc-vmm")
GOALLOC_CONFIGS = ("goalloc", "goalloc-vmm")  # goalloc installed: figures from goalloc.memory_stats
# A variant of goalloc-vmm, "goalloc-vmm.LABEL": goalloc-vmm with the suite's
# --variant LABEL=CONF added to its GOALLOC_CONF, so that a setting runs
# beside the default in one suite, interleaved, and renders as its own row.
VARIANT = re.compile(r"goalloc-vmm\.[a-z0-9][a-z0-9_-]*")
# What each workload draws its steps' shapes from: (option, MIN, MAX, and
# the suite's --quick MIN, MAX); the suite has the same options (--NAME MIN
# MAX) and passes them on.
SHAPE_RANGES = {
    "gpt2": (("gpt2-batch", 4, 8, 2, 4), ("gpt2-seq", 256, 1024, 128, 256)),
    "llama": (("llama-batch", 1, 8, 1, 2), ("llama-seq", 512, 3072, 128, 256)),
    "resnet50": (("resnet-batch", 32, 64, 16, 32), ("resnet-res", 160, 224, 128, 160)),
    # ROLLOUT_GENERATES generate calls an iteration, each of a batch, prompt
    # and generated length; then micro-batches of the rows they made.
    "rollout": (("rollout-batch", 8, 32, 2, 4), ("rollout-prompt", 128, 768, 64, 128),
                ("rollout-new", 32, 160, 16, 32), ("rollout-micro", 2, 12, 2, 4)),
    "checkpoint": (("checkpoint-batch", 1, 8, 1, 2), ("checkpoint-seq", 512, 4096, 128, 256)),
    "serving": (("serving-batch", 1, 48, 1, 4), ("serving-prompt", 64, 2048, 64, 128), ("serving-new", 16, 256, 16, 32)),
    "moe": (("moe-batch", 4, 16, 1, 2), ("moe-seq", 512, 2048, 128, 256)),
}
WORKLOADS = ("env",) + tuple(SHAPE_RANGES)
UNITS = {"resnet50": "images"}  # the others: tokens (serving's generated, rollout's generated and trained)
SHAPE_SEED = {w: i for i, w in enumerate(("gpt2", "resnet50", "llama", "rollout", "checkpoint", "serving", "moe"), 1)}
ROLLOUT_GENERATES = 3
HISTORY_ENTRIES = 1 << 20  # --record-history: the most events the library's history ring (and torch's) keeps
MISS_LATENCY_KEYS = ("p50", "p99", "max", "count")  # goalloc.device_alloc_ns.*, ns


def base_config(config: str) -> str:
    """The configuration config runs: goalloc-vmm for its variants, else itself."""
    return "goalloc-vmm" if VARIANT.fullmatch(config) else config


def is_goalloc(config: str) -> bool:
    """Whether config installs goalloc (its figures come from goalloc.memory_stats)."""
    return base_config(config) in GOALLOC_CONFIGS


def config_name(s: str) -> str:
    """--config: one of CONFIGS, or a variant of goalloc-vmm."""
    if s in CONFIGS or VARIANT.fullmatch(s):
        return s
    raise argparse.ArgumentTypeError(f"{s!r}: want one of {', '.join(CONFIGS)}, or goalloc-vmm.LABEL")


def goalloc_conf(base: str, config: str) -> str:
    """GOALLOC_CONF of a goalloc configuration: the suite's --goalloc-conf, then its backend."""
    backend = "backend:vmm" if base_config(config) == "goalloc-vmm" else "backend:async"
    return ",".join(x for x in (base.strip(" ,"), backend) if x)


def miss_latency(stats: dict[str, Any]) -> Optional[dict[str, int]]:
    """goalloc's cache misses' latency (p50, p99, max ns, count) from its
    memory_stats; None from a library that does not report it."""
    out = {k: stats.get(f"goalloc.device_alloc_ns.{k}") for k in MISS_LATENCY_KEYS}
    if all(v is None for v in out.values()):
        return None
    return {k: int(v) for k, v in out.items() if v is not None}


def driver_totals(stats: dict[str, Any]) -> dict[str, int]:
    """goalloc's driver calls so far (goalloc.driver.<fn>.count and .ns,
    summed) and its cuMemUnmap and cuMemCreate calls; logged after every
    step, their differences say which steps went to the driver."""
    out = {"calls": 0, "ns": 0}
    for k, v in stats.items():
        if k.startswith("goalloc.driver.") and isinstance(v, int):
            if k.endswith(".count"):
                out["calls"] += v
            elif k.endswith(".ns"):
                out["ns"] += v
    out["unmaps"] = int(stats.get("goalloc.driver.cuMemUnmap.count", 0))
    out["creates"] = int(stats.get("goalloc.driver.cuMemCreate.count", 0))
    return out


def draw(rng: random.Random, limits: dict[str, int], key: str, step: int = 1) -> int:
    """A value of limits' key_min..key_max, in multiples of step from key_min."""
    return rng.randrange(limits[f"{key}_min"], limits[f"{key}_max"] + 1, step)


def rollout_iteration(rng: random.Random, limits: dict[str, int]) -> tuple[Any, ...]:
    """One rollout iteration: ((batch, prompt, new), ...) for each generate
    call, then the training micro-batches' row counts, which add up to all
    the rows generated."""
    gens = tuple((draw(rng, limits, "batch"), draw(rng, limits, "prompt", 64), draw(rng, limits, "new", 16))
                 for _ in range(ROLLOUT_GENERATES))
    rows, micro = sum(b for b, _, _ in gens), []
    while rows > 0:
        micro.append(min(rows, draw(rng, limits, "micro")))
        rows -= micro[-1]
    return gens, tuple(micro)


def train_shapes(workload: str, repeat: int, count: int, limits: dict[str, int]) -> list[Any]:
    """The shape of every step of a run, seeded by the repeat and the
    workload alone: every configuration of a repeat runs the same shapes,
    and the repeats differ. (batch, length) or (batch, resolution); serving
    (batch, prompt, new); moe (batch, length, router skew's seed); rollout
    rollout_iteration's."""
    rng = random.Random(7919 * (repeat + 1) + SHAPE_SEED[workload])
    shapes: list[Any] = []
    for _ in range(count):
        if workload == "resnet50":
            shapes.append((draw(rng, limits, "batch", 8), draw(rng, limits, "res", 16)))
        elif workload == "rollout":
            shapes.append(rollout_iteration(rng, limits))
        elif workload == "serving":
            shapes.append((draw(rng, limits, "batch"), draw(rng, limits, "prompt", 16), draw(rng, limits, "new")))
        else:
            shape = (draw(rng, limits, "batch"), draw(rng, limits, "seq", 64))
            shapes.append(shape + (rng.randrange(1 << 30),) if workload == "moe" else shape)
    return shapes


def write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


# --- threads: who spent the host's time, and pinning them by role -------------------


def task_file(task_dir: str, tid: object, name: str) -> str:
    """TASK_DIR/TID/NAME, a thread's file in /proc; "" where the thread has ended (or the kernel keeps no such file)."""
    try:
        with open(f"{task_dir}/{tid}/{name}") as f:
            return f.read()
    except OSError:
        return ""


def thread_times(task_dir: str = "/proc/self/task") -> dict[int, tuple[str, float]]:
    """Every thread of this process: tid -> (name, CPU ms so far: schedstat's
    run time where the kernel keeps it, else utime + stime)."""
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(task_dir):
        stat, sched = task_file(task_dir, tid, "stat"), task_file(task_dir, tid, "schedstat").split()
        if not stat:
            continue  # the thread ended meanwhile
        run_ns = int(sched[0]) if sched and sched[0].isdigit() else 0
        name = stat[stat.index("(") + 1:stat.rindex(")")]  # "tid (name) state ...": the name may hold ")"
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
        out[int(tid)] = (name, run_ns / 1e6 if run_ns > 0 else ticks * tick_ms)
    return out


def thread_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                 main: int) -> list[dict[str, object]]:
    """CPU ms each thread spent between two thread_times() readings, the
    busiest first; main is the training thread's id."""
    rows = [{"tid": tid, "name": name, "main": tid == main, "cpu_ms": ms - before.get(tid, (name, 0.0))[1]}
            for tid, (name, ms) in after.items()]
    return sorted(rows, key=lambda r: -float(r["cpu_ms"]))  # type: ignore[arg-type]


def cpu_roles(s: str) -> list[int]:
    """MAIN,AUTOGRAD,OTHER[,OTHER...]: CPUs of this process, for pin_threads (an argparse type)."""
    try:
        cpus = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: want MAIN,AUTOGRAD,OTHER[,OTHER...], CPU numbers") from None
    allowed = os.sched_getaffinity(0)
    if len(cpus) < 3 or not set(cpus) <= allowed:
        raise argparse.ArgumentTypeError(f"{s!r}: want at least three CPUs of this process's {sorted(allowed)}")
    return cpus


def pin_threads(main_cpu: int, autograd_cpu: int, other_cpus: set[int], main_tid: int,
                task_dir: str = "/proc/self/task") -> dict[str, list[int]]:
    """Pin this process's threads by role: the training thread (main_tid),
    torch's autograd threads (pt_autograd_*), the rest. Two processes pinned
    alike give each CPU the same role in both, so a CPU slowed for a while
    slows both alike. Returns the thread ids pinned, by role."""
    pinned: dict[str, list[int]] = {"main": [], "autograd": [], "others": []}
    for tid_s in os.listdir(task_dir):
        tid, name = int(tid_s), task_file(task_dir, tid_s, "comm").rstrip("\n")
        if not name:
            continue
        role = "main" if tid == main_tid else "autograd" if name.startswith("pt_autograd_") else "others"
        try:
            os.sched_setaffinity(tid, {main_cpu} if role == "main" else {autograd_cpu} if role == "autograd"
                                 else other_cpus)
        except ProcessLookupError:
            continue
        pinned[role].append(tid)
    return pinned


# --- the allocator of a configuration ---------------------------------------------


class Allocator:
    """The configuration's allocator: setup() before CUDA starts, figures()
    its own counters."""

    def __init__(self, torch: Any, config: str):
        self.torch, self.config = torch, config
        self.goalloc: Any = None

    def setup(self) -> None:
        if is_goalloc(self.config):
            import goalloc

            self.goalloc = goalloc
            goalloc.install(goalloc_conf(os.environ.get("GOALLOC_CONF", ""), self.config))

    def figures(self) -> dict[str, Any]:
        """The allocator's own figures, in bytes."""
        own = self.goalloc is not None
        s = self.goalloc.memory_stats(0) if own else self.torch.cuda.memory_stats(0)
        out: dict[str, Any] = {"source": "goalloc.memory_stats" if own else "torch.cuda.memory_stats", "stats": s,
                               "requested_peak": s.get("requested_bytes.all.peak")}
        out |= {f"{key}_{k}": s.get(f"{key}_bytes.all.{k}") for key in ("reserved", "allocated") for k in ("peak", "current")}
        if own:
            # What goalloc's memory source holds (the pool's reserved bytes, or
            # the physical memory mapped): now, and at its high-water mark.
            f = self.goalloc.fragmentation(0)
            out.update(pool_reserved_current=int(f.pool_reserved_bytes), pool_used_current=int(f.pool_used_bytes),
                       pool_reserved_max_read=max(int(f.pool_reserved_bytes), int(f.pool_reserved_high_bytes)))
            # On backend:vmm, what held the memory when held last peaked,
            # split by the device itself at that moment.
            out["held_split_at_peak"] = getattr(f, "held_split_at_peak", None)
            out["device_alloc_ns"] = miss_latency(s)  # None from a library that does not report it
        return out

    def split(self) -> dict[str, Any]:
        """What holds the device's memory now, by the allocator's counters:
        what it holds from the driver (held), what of that it counts as its
        own blocks and segments (own: goalloc's alone; the rest of held is
        mapped memory between them), and what is handed out (allocated)."""
        if self.goalloc is not None:
            s = self.goalloc.memory_stats(0)
            # On backend:vmm, also the device's handles span by span: what of
            # held lies in free ends of handles shared with live memory.
            return {"held": s.get("reserved_bytes.all.current"), "own": s.get("goalloc.own_reserved_bytes.current"),
                    "allocated": s.get("allocated_bytes.all.current"),
                    "held_split": getattr(self.goalloc.fragmentation(0), "held_split", None)}
        s = self.torch.cuda.memory_stats(0)
        return {"held": s.get("reserved_bytes.all.current"), "allocated": s.get("allocated_bytes.all.current")}

    def verify(self) -> dict[str, Any]:
        """What this process really runs, to catch a configuration that did not take."""
        v = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
             "backend": self.torch.cuda.get_allocator_backend()}
        if self.goalloc is not None:
            v.update(goalloc_library=self.goalloc.library_path(), goalloc_conf=self.goalloc.config().get("conf"))
        return v


class DeviceMemory:
    """Peak device memory in use by the driver's count (mem_get_info) over
    the baseline taken right after CUDA starts: the largest of sample()
    (after every step) and of a background thread sampling every interval_ms.
    At each new peak it also asks at_peak (Allocator.split) what holds the
    memory, so the peak's excess over what was allocated has its parts
    (read just after the peak's reading: the allocator may have moved on)."""

    def __init__(self, torch: Any, interval_ms: float, at_peak: Optional[Callable[[], dict[str, Any]]] = None):
        self.torch, self.interval, self.at_peak = torch, interval_ms / 1000.0, at_peak
        self.lock = threading.Lock()
        free, total = torch.cuda.mem_get_info(0)
        self.total, self.baseline = int(total), int(total - free)
        self.peak = self.baseline
        self.peak_split: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mem-sampler", daemon=True)

    def sample(self) -> int:
        free, total = self.torch.cuda.mem_get_info(0)
        used = int(total - free)
        with self.lock:
            if used > self.peak:
                self.peak = used
                if self.at_peak is not None:
                    self.peak_split = {"used_over_baseline": used - self.baseline, **self.at_peak()}
        return used

    def start(self) -> None:
        if self.interval > 0:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def figures(self) -> dict[str, Any]:
        end = self.sample()
        with self.lock:
            return {"baseline_used": self.baseline, "peak_used": self.peak,
                    "peak_over_baseline": self.peak - self.baseline, "end_over_baseline": end - self.baseline,
                    "total": self.total, "interval_ms": self.interval * 1000.0, "at_peak": self.peak_split}


# --- the workloads ---------------------------------------------------------------


def run_env(torch: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Versions and the GPU; also brings every module the workloads import
    into the page cache once, before any timing."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda}
    for name in ("transformers", "torchvision", "transformers.models.gpt2.modeling_gpt2",
                 "transformers.models.llama.modeling_llama", "torchvision.models", "torch.distributed.fsdp"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "imported")
        except Exception as e:
            out[name] = f"unavailable ({type(e).__name__}: {e})"
    if not args.smoke_cpu:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory=int(p.total_memory), capability=f"{p.major}.{p.minor}",
                   multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                   gpu_uuid=str(getattr(p, "uuid", "")) or None)
    return out


# step(shape) runs one step of a workload and returns its "units" (tokens or
# images), its "loss" (a tensor, or None) and any more figures to log.
Step = Callable[[Any], dict[str, Any]]


def trainer(torch: Any, dev: Any, opt: Any, forward: Callable[[Any], tuple[Any, int]]) -> Step:
    """A step of forward(shape) -> (loss, units) under bf16 autocast, its
    backward and an optimizer step."""
    def step(shape: Any) -> dict[str, Any]:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss, units = forward(shape)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "units": units}

    return step


def causal_lm(torch: Any, dev: Any, model_cls: Any, cfg: Any,
              prepare: Callable[[Any], None] = lambda model: None) -> tuple[Any, Any, Step]:
    """model_cls(cfg), randomly initialised on the device and given to
    prepare (checkpointing, sharding) before AdamW takes its parameters; the
    optimizer; a step that trains it on random tokens of a shape (batch, length)."""
    with dev:
        model = model_cls(cfg)
    prepare(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward(shape: tuple[int, int]) -> tuple[Any, int]:
        ids = torch.randint(0, cfg.vocab_size, shape, device=dev)
        return model(input_ids=ids, labels=ids).loss, shape[0] * shape[1]

    return model, opt, trainer(torch, dev, opt, forward)


def checkpointing(model: Any) -> None:
    """Activation checkpointing of every decoder layer (transformers' own, not reentrant)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_gpt2(torch: Any, dev: Any, tiny: bool = False) -> Step:
    """GPT-2 124M from its default config; tiny (--smoke-cpu): 2 narrow layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return causal_lm(torch, dev, GPT2LMHeadModel, GPT2Config(n_layer=2, n_head=2, n_embd=64) if tiny else GPT2Config())[2]


# 12 layers of hidden size 2048, 16 query heads sharing 4 key/value heads, a
# 32000-token vocabulary, untied embeddings: 672M parameters.
LLAMA_CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
LLAMA_TINY_CONFIG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
ROLLOUT_LAYERS = 10  # issue 33's RL-style loop: the LLaMA above with 10 layers, 582M parameters


def llama_config(tiny: bool, **more: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**(LLAMA_TINY_CONFIG if tiny else LLAMA_CONFIG | more), pad_token_id=0)


def build_llama(torch: Any, dev: Any, tiny: bool = False) -> Step:
    from transformers import LlamaForCausalLM

    return causal_lm(torch, dev, LlamaForCausalLM, llama_config(tiny))[2]


def build_resnet50(torch: Any, dev: Any, tiny: bool = False) -> Step:
    """torchvision's ResNet-50, random weights, channels_last, SGD with momentum."""
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(dev, memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    def forward(shape: tuple[int, int]) -> tuple[Any, int]:
        b, r = shape
        x = torch.randn(b, 3, r, r, device=dev).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (b,), device=dev)
        return torch.nn.functional.cross_entropy(model(x), y), b

    return trainer(torch, dev, opt, forward)


def generate(torch: Any, model: Any, batch: int, prompt: int, new: int) -> Any:
    """batch random prompts of prompt tokens, each given exactly new tokens
    by greedy decoding (transformers' generate: a key/value cache grown by a
    token a step): the [batch, prompt + new] token ids."""
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=model.device)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)


def build_serving(torch: Any, dev: Any, tiny: bool = False) -> Step:
    """The LLaMA above in bf16, no gradients; a step is one request,
    (batch, prompt, new): generate's tokens for a batch of prompts."""
    from transformers import LlamaForCausalLM

    torch.set_default_dtype(torch.bfloat16)  # made in bf16: no fp32 copy of the weights at any time
    with dev:
        model = LlamaForCausalLM(llama_config(tiny)).eval()
    torch.set_default_dtype(torch.float32)

    def step(shape: tuple[int, int, int]) -> dict[str, Any]:
        b, p, n = shape
        generate(torch, model, b, p, n)
        return {"loss": None, "units": b * n}

    return step


def build_rollout(torch: Any, dev: Any, tiny: bool = False) -> Step:
    """RL-style colocation in one process: a step is an iteration
    (rollout_iteration's shape) that generates from the model under bf16
    autocast, then trains it (AdamW, activation checkpointing) on the rows
    generated, in micro-batches padded to their longest row, one optimizer
    step an iteration. Units: the tokens generated and trained."""
    from transformers import LlamaForCausalLM

    model, opt, _ = causal_lm(torch, dev, LlamaForCausalLM, llama_config(tiny, num_hidden_layers=ROLLOUT_LAYERS),
                              checkpointing)
    pad = torch.nn.utils.rnn.pad_sequence

    def step(shape: tuple[Any, Any]) -> dict[str, Any]:
        gens, micro = shape
        model.eval()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            rows = [r for b, p, n in gens for r in generate(torch, model, b, p, n).unbind(0)]
        model.train()
        total, trained, loss = len(rows), 0, 0.0
        for k in micro:
            batch, rows = rows[:k], rows[k:]
            ids, labels = pad(batch, batch_first=True), pad(batch, batch_first=True, padding_value=-100)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                part = model(input_ids=ids, labels=labels).loss * (k / total)
            part.backward()
            loss, trained = loss + part.detach(), trained + sum(len(r) for r in batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss, "units": sum(b * n for b, _, n in gens) + trained}

    return step


def build_checkpoint(torch: Any, dev: Any, tiny: bool = False) -> Step:
    """The LLaMA above under FSDP (fully_shard on each decoder layer, then
    the whole; bf16 parameters, fp32 gradient reduction) in a process group
    of one, with activation checkpointing, trained like llama."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (the GPU machines' rule)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(model: Any) -> None:
        checkpointing(model)
        for module in [*model.model.layers, model]:
            fully_shard(module, mp_policy=policy)

    return causal_lm(torch, dev, LlamaForCausalLM, llama_config(tiny), shard)[2]


# hidden size, each expert's SwiGLU width, experts, experts per token, layers:
# 4 layers of 16 experts, 1.1B parameters, 2 experts (69M parameters) a token.
MOE_CONFIG, MOE_TINY_CONFIG = (2048, 2816, 16, 2, 4), (64, 96, 4, 2, 2)
MOE_SKEW = 1.5  # the spread of a per-step bias on the router's logits: hot experts change step by step


def build_moe(torch: Any, dev: Any, tiny: bool = False) -> Step:
    """Layers of a mixture of experts, each x + Σ gate·expert(x) over a
    token's top-k experts, trained with AdamW on random inputs of a shape
    (batch, length, seed); each step's router gets a bias drawn from seed, so
    the experts' token counts (logged) change every step. The tokens are
    sorted by expert and each expert's SwiGLU (weights of its own) runs on its own slice."""
    d, f, e, k, layers = MOE_TINY_CONFIG if tiny else MOE_CONFIG

    def weights(*shape: int) -> Any:
        return torch.nn.Parameter(torch.randn(*shape, device=dev) * shape[0] ** -0.5)

    router = [weights(d, e) for _ in range(layers)]
    w_in, w_out = ([[weights(*shape) for _ in range(e)] for _ in range(layers)] for shape in ((d, 2 * f), (f, d)))
    opt = torch.optim.AdamW(router + [w for ws in w_in + w_out for w in ws], lr=1e-4)

    def moe_layer(x: Any, i: int, bias: Any) -> tuple[Any, list[int]]:
        gate, expert = ((x @ router[i]).float() + bias).softmax(-1).topk(k, dim=-1)
        order = expert.flatten().argsort(stable=True)  # the token-expert pairs, by expert
        counts = torch.bincount(expert.flatten(), minlength=e).tolist()
        xs = x.unsqueeze(1).expand(-1, k, -1).reshape(-1, d)[order]
        outs = []
        for j, part in enumerate(xs.split(counts)):
            a, b = (part @ w_in[i][j]).chunk(2, dim=-1)
            outs.append((torch.nn.functional.silu(a) * b) @ w_out[i][j])
        y = torch.cat(outs)[order.argsort()].view(-1, k, d)
        return x + (y * gate.unsqueeze(-1).to(y.dtype)).sum(1), counts

    def step(shape: tuple[int, int, int]) -> dict[str, Any]:
        b, s, seed = shape
        bias = (torch.randn(e, generator=torch.Generator().manual_seed(seed)) * MOE_SKEW).to(dev)
        x, counts = torch.randn(b * s, d, device=dev), []
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            for i in range(layers):
                x, c = moe_layer(x, i, bias)
                counts.append(c)
            loss = x.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "units": b * s, "expert_tokens": counts}

    return step


BUILDERS = {"gpt2": build_gpt2, "llama": build_llama, "resnet50": build_resnet50, "rollout": build_rollout,
            "checkpoint": build_checkpoint, "serving": build_serving, "moe": build_moe}


def planning_steps(shapes: list[Any]) -> list[Any]:
    """One untimed step of every distinct shape, in order of first use
    (--plan-shapes): a shape's first step, cuDNN planning it on the host,
    stays out of the timed steps."""
    return list(dict.fromkeys(shapes))


def train_limits(args: argparse.Namespace, workload: str) -> dict[str, int]:
    """The workload's shape ranges, as {"batch_min": .., "batch_max": .., ...}."""
    out = {}
    for name, *_ in SHAPE_RANGES[workload]:
        lo, hi = getattr(args, name.replace("-", "_"))
        key = name.split("-", 1)[1]
        out |= {f"{key}_min": lo, f"{key}_max": hi}
    return out


def run_steps(torch: Any, alloc: Optional[Allocator], mem: Optional[DeviceMemory],
              args: argparse.Namespace) -> dict[str, Any]:
    """Steps of a shape drawn per step, each timed between device
    synchronisations; the allocator's and the driver's peak memory, and
    every thread's CPU time over the timed steps."""
    workload, cuda = args.workload, not args.smoke_cpu
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    limits = train_limits(args, workload)
    shapes = train_shapes(workload, args.repeat, args.warmup + args.steps, limits)
    planned = planning_steps(shapes) if args.plan_shapes else []
    warmup, shapes = args.warmup + len(planned), planned + shapes
    torch.manual_seed(1000 + args.repeat)  # the same weights and data for every configuration of a repeat
    out: dict[str, Any] = {"unit": UNITS.get(workload, "tokens"), "warmup": warmup,
                           "steps": args.steps, "limits": limits, "planned_shapes": len(planned)}
    log: list[dict[str, Any]] = []
    threads_before: dict[int, tuple[str, float]] = {}
    turns = Turns(args.turns) if args.turns else None
    # The history starts before the model is built: a replay of it holds
    # everything the process allocated, as the GPU's figures do.
    with recording_history(torch, alloc, args.record_history, out):
        t_build = time.perf_counter()
        step = BUILDERS[workload](torch, dev, tiny=not cuda)
        sync()
        out["build_s"] = time.perf_counter() - t_build
        if mem is not None:
            mem.start()
        for i, shape in enumerate(shapes):
            if turns is not None:
                turns.wait()
            sync()
            if args.pin_threads and i in (1, warmup):
                # After the first step (autograd's thread starts at the first
                # backward), and again for threads started since.
                cpus = args.pin_threads
                out["pinned_threads"] = pin_threads(cpus[0], cpus[1], set(cpus[2:]), threading.get_native_id())
            if i == warmup:
                threads_before = thread_times()
            t0 = time.perf_counter()
            entry = step(shape)
            sync()
            entry.update(shape=list(shape), seconds=time.perf_counter() - t0, timed=i >= warmup,
                         loss=None if entry["loss"] is None else float(entry["loss"].float().item()))
            if mem is not None:
                entry["device_used"] = mem.sample()
            if alloc is not None and alloc.goalloc is not None:
                entry["goalloc_driver"] = driver_totals(alloc.goalloc.memory_stats(0))
            if turns is not None:
                entry["turn"] = turns.done()
            log.append(entry)
    if turns is not None:
        turns.finish()
    if threads_before:
        out["threads"] = thread_delta(threads_before, thread_times(), threading.get_native_id())
    if mem is not None:
        mem.stop()
    timed = [e for e in log if e["timed"]]
    seconds, units = sum(e["seconds"] for e in timed), sum(e["units"] for e in timed)
    out.update(step_log=log, timed_seconds=seconds, timed_units=units,
               units_per_s=units / seconds if seconds > 0 else None,
               median_step_s=float(statistics.median(e["seconds"] for e in timed)) if timed else None,
               losses_finite=all(math.isfinite(e["loss"]) for e in log if e["loss"] is not None))
    if alloc is not None:
        out["allocator"] = alloc.figures()
    if mem is not None:
        out["device"] = mem.figures()
    return out


@contextlib.contextmanager
def recording_history(torch: Any, alloc: Optional[Allocator], stem: Optional[str], out: dict[str, Any]) -> Any:
    """--record-history STEM: the allocations made inside, for `goalloc
    replay` and the simulator's test set: with goalloc installed its trace
    (STEM.jsonl.gz, goalloc.record_trace), else torch's memory history
    (STEM.pickle, torch.cuda.memory._dump_snapshot); out["history"] names
    the file. No STEM: nothing recorded."""
    if not stem:
        yield
    elif alloc is not None and alloc.goalloc is not None:
        out["history"] = f"{stem}.jsonl.gz"
        with alloc.goalloc.record_trace(out["history"], max_entries=HISTORY_ENTRIES, workload=os.path.basename(stem)):
            yield
    else:
        out["history"] = f"{stem}.pickle"
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, context=None)
        try:
            yield
        finally:
            torch.cuda.memory._dump_snapshot(out["history"])
            torch.cuda.memory._record_memory_history(enabled=None)


class Turns:
    """Training in lockstep with another process (bench/lockstep.py): before
    each step wait for the coordinator's b"g" on one pipe; after it answer
    b"d" on the other, and b"e" after the last step, then close (end of file
    without b"e" means this process died)."""

    def __init__(self, fds: tuple[int, int]):
        self.go, self.reply = fds
        self.started = 0.0

    def wait(self) -> None:
        if os.read(self.go, 1) != b"g":
            raise RuntimeError("lockstep: the coordinator went away before the run's last step")
        self.started = time.monotonic()

    def done(self) -> list[float]:
        """Say done; the step's turn, [start, end] on the system's monotonic clock."""
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
    p.add_argument("--config", default="native", type=config_name)
    p.add_argument("--repeat", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSON result file")
    p.add_argument("--sample-ms", type=float, default=5.0, help="mem_get_info sampling interval; 0: off")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    p.add_argument("--steps", type=int, default=10, help="timed steps (rollout: iterations; serving: requests)")
    for name, lo, hi, _, _ in (r for ranges in SHAPE_RANGES.values() for r in ranges):
        p.add_argument(f"--{name}", type=int, nargs=2, default=(lo, hi), metavar=("MIN", "MAX"))
    p.add_argument("--record-history", metavar="STEM", help="record the steps' allocations: STEM.jsonl.gz "
                   "(goalloc's trace, goalloc installed) or STEM.pickle (torch's memory snapshot)")
    p.add_argument("--plan-shapes", action="store_true",
                   help="before the warm-up, one untimed step of every distinct shape the run trains")
    p.add_argument("--turns", type=turn_fds, metavar="GO,REPLY",
                   help="training steps in lockstep with another process: the pipes bench/lockstep.py hands down")
    p.add_argument("--pin-threads", type=cpu_roles, metavar="MAIN,AUTOGRAD,OTHER[,OTHER...]",
                   help="training: pin the training thread, torch's autograd thread and the others to these CPUs")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="train on the CPU with no allocator (a check of the model code, no figures)")
    args = p.parse_args(argv)
    if args.smoke_cpu and args.config != "native":
        p.error("--smoke-cpu runs with --config native only")
    if args.smoke_cpu and args.record_history:
        p.error("--record-history records a device's allocations: not with --smoke-cpu")
    if (args.turns or args.pin_threads) and args.workload == "env":
        p.error("--turns, --pin-threads: only the training workloads take turns or pin threads")
    return args


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Do the run, filling result."""
    t0 = time.perf_counter()
    import torch

    result["import_torch_s"] = time.perf_counter() - t0
    if args.workload == "env":
        result["result"] = run_env(torch, args)
        return
    if args.smoke_cpu:
        result["result"] = run_steps(torch, None, None, args)
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    alloc = Allocator(torch, args.config)
    alloc.setup()  # before anything starts CUDA
    torch.cuda.init()
    torch.cuda.synchronize()
    mem = DeviceMemory(torch, args.sample_ms, alloc.split)  # the idle baseline: nothing allocated yet
    result["ready_s"] = time.perf_counter() - t0
    result["result"] = run_steps(torch, alloc, mem, args)
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
