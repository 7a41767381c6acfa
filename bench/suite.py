#!/usr/bin/env python3
"""The goalloc GPU benchmark suite: plan, run every (workload, config, repeat)
in its own process, and keep every result.

    python3 bench/suite.py OUTDIR [options]        # normally through bench/run.sh OUTDIR
    python3 bench/suite.py OUTDIR --dry-run        # the plan and its estimated time, nothing run

An 'env' process first (versions, the GPU, every module imported once: no
timed process pays for a cold page cache); then the plan, repeat by repeat,
each workload's configurations in an order rotated by the repeat, each run a
fresh process of bench/workloads.py with its own timeout. A run that fails,
crashes or times out is recorded with the tail of its output. A run whose
estimate (the longest of the last three of its kind, else the default) no
longer fits the budget is skipped. After every run OUTDIR/results/NAME.json
and OUTDIR/bench.json are rewritten, so a suite stopped at any point
(SIGTERM, SIGINT) keeps all it finished. Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import workloads  # noqa: E402  (bench/workloads.py: the configurations, the workloads and their shape ranges)
from workloads import CONFIGS, VARIANT, is_goalloc, write_json_atomic  # noqa: E402

DEFAULT_TRAIN_CONFIGS = CONFIGS
WORKLOADS = TRAIN_WORKLOADS = tuple(workloads.SHAPE_RANGES)
DEFAULT_WORKLOADS = ("gpt2", "llama", "resnet50")  # issue 33's rollout, checkpoint, serving and moe by name
DEFAULT_BUDGET_S = 480.0

# Per workload: its options' prefix (--PREFIX-steps, --PREFIX-warmup), default
# timed and warm-up steps, and a run's estimated seconds on an H200 (a start,
# then a cost per step; rollout's and serving's from runs of 2 and 3 steps,
# their steps' cost varying with the shapes drawn).
STEPS = {"gpt2": ("gpt2", 45, 5, 9.0, 0.15), "llama": ("llama", 27, 3, 15.0, 0.35),
         "resnet50": ("resnet", 35, 5, 6.5, 0.12), "rollout": ("rollout", 4, 1, 25.0, 25.0),
         "checkpoint": ("checkpoint", 60, 3, 20.0, 0.35), "serving": ("serving", 12, 2, 20.0, 8.0),
         "moe": ("moe", 200, 5, 15.0, 0.1)}
ENV_ESTIMATE_S = 20.0
# The most tokens a sequence may hold: GPT-2's context, LlamaConfig's
# max_position_embeddings in bench/workloads.py.
CONTEXT = {"gpt2": 1024, "llama": 4096, "rollout": 4096, "checkpoint": 4096, "serving": 4096}
# A run is stopped after this many times its estimate (at least MIN_TIMEOUT_S).
TIMEOUT_FACTOR, MIN_TIMEOUT_S, ENV_TIMEOUT_S = 5.0, 45.0, 150.0
# Seconds a run may still start within past the budget's end, for its timeout.
GRACE_S = 15.0
TAIL_CHARS = 3000
SHAPE_RANGES = tuple(r for ranges in workloads.SHAPE_RANGES.values() for r in ranges)


@dataclass
class Run:
    """One planned process: a workload under a configuration in one repeat."""

    id: int
    workload: str
    config: str
    repeat: int
    estimate_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.id:03d}-{self.workload}-{self.config}-r{self.repeat}"

    def record(self, **more: Any) -> dict[str, Any]:
        """The run's record for bench.json, with more."""
        return {"id": self.id, "name": self.name, "workload": self.workload, "config": self.config,
                "repeat": self.repeat} | more


class Stopped(Exception):
    """SIGTERM or SIGINT: stop the current run, keep everything, exit."""


# --- options and the plan ---------------------------------------------------------


def csv_list(choices: tuple[str, ...]) -> Any:
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{s!r}: want a comma-separated list of {', '.join(choices)}" + (f" (unknown: {', '.join(bad)})" if bad else ""))
        return items
    return parse


def int_from(least: int) -> Any:
    """An argparse type: an int of least or more."""
    def parse(s: str) -> int:
        if int(s) < least:
            raise argparse.ArgumentTypeError(f"{s}: must be " + ("at least 1" if least == 1 else f"{least} or more"))
        return int(s)
    return parse


positive_int, nonneg_int = int_from(1), int_from(0)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", help="where results/, bench.json and logs go (one per suite running at once)")
    p.add_argument("--repeats", type=positive_int, default=3, help="repeats of every run (default 3)")
    p.add_argument("--first-repeat", type=nonneg_int, default=0,
                   help="the first repeat's index (default 0): the runs are repeats N..N+REPEATS-1, so another "
                        "call (or GPU) given the next N draws other shapes and its runs merge without colliding")
    p.add_argument("--train-configs", type=csv_list(CONFIGS), default=list(DEFAULT_TRAIN_CONFIGS),
                   help=f"configurations of the training workloads (default: {','.join(DEFAULT_TRAIN_CONFIGS)})")
    p.add_argument("--workloads", type=csv_list(WORKLOADS), default=list(DEFAULT_WORKLOADS),
                   help=f"default {','.join(DEFAULT_WORKLOADS)}")
    for prefix, steps, warmup, _, _ in STEPS.values():
        p.add_argument(f"--{prefix}-steps", type=positive_int, default=steps, help=f"timed steps per run (default {steps})")
        p.add_argument(f"--{prefix}-warmup", type=nonneg_int, default=warmup)
    for name, lo, hi, _, _ in SHAPE_RANGES:
        p.add_argument(f"--{name}", type=positive_int, nargs=2, default=[lo, hi], metavar=("MIN", "MAX"))
    for w in ("resnet", "llama"):
        p.add_argument(f"--{w}-plan-shapes", action="store_true",
                       help=f"{w} runs first take one untimed step of every shape they train (a shape's first "
                            "step plans it, on the host, under every allocator)")
    p.add_argument("--sample-ms", type=float, default=5.0, help="mem_get_info sampling interval (ms)")
    p.add_argument("--record-history", action="store_true",
                   help="every run records its allocations in OUTDIR/history/ (bench/workloads.py --record-history)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=CONF",
                   help="also run goalloc-vmm.LABEL: goalloc-vmm with CONF added to its GOALLOC_CONF (e.g. "
                        "h4=vmm_handle:4M), interleaved with the others; may be given more than once")
    p.add_argument("--goalloc-conf", default="",
                   help="GOALLOC_CONF for the goalloc configurations (default: none, goalloc's defaults); "
                        "no backend: goalloc-vmm adds backend:vmm to it")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds the whole suite may take (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--timeout", type=float, help="a fixed per-run timeout in seconds (default: from the estimates)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 repeat, 1+2 training steps, small shapes")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time; run nothing")
    p.add_argument("--python", default=sys.executable, help="interpreter for the workload processes")
    p.add_argument("--goalloc-library", default=os.environ.get("GOALLOC_LIBRARY") or str(REPO / "build" / "libgoalloc.so"))
    p.add_argument("--workloads-script", default=str(BENCH / "workloads.py"), help=argparse.SUPPRESS)
    p.add_argument("--command", help="the command line to record (bench/run.sh passes its own)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
        for prefix, _, _, _, _ in STEPS.values():
            setattr(args, f"{prefix}_steps", 2)
            setattr(args, f"{prefix}_warmup", 1)
        for name, _, _, lo, hi in SHAPE_RANGES:
            setattr(args, name.replace("-", "_"), [lo, hi])
    for name, *_ in SHAPE_RANGES:
        lo, hi = getattr(args, name.replace("-", "_"))
        if lo > hi:
            p.error(f"--{name}: MIN {lo} is above MAX {hi}")
    for w, limit in CONTEXT.items():
        names = [n for n, *_ in workloads.SHAPE_RANGES[w] if n.endswith(("-seq", "-prompt", "-new"))]
        if sum(getattr(args, n.replace("-", "_"))[1] for n in names) > limit:
            p.error(f"--{' + --'.join(names)}: {w}'s model holds {limit} tokens (its context)")
    if "backend" in (kv.split(":", 1)[0].strip() for kv in args.goalloc_conf.split(",")):
        p.error("--goalloc-conf: no backend here: goalloc runs backend:async and goalloc-vmm backend:vmm")
    args.variants = {}
    for v in args.variant:
        label, _, conf = v.partition("=")
        name = f"goalloc-vmm.{label}"
        if not VARIANT.fullmatch(name) or not conf.strip() or name in args.variants:
            p.error(f"--variant {v!r}: want LABEL=CONF, a new LABEL of lower-case letters, digits, - and _")
        if "backend" in (kv.split(":", 1)[0].strip() for kv in conf.split(",")):
            p.error(f"--variant {v!r}: no backend here: a variant is of goalloc-vmm (backend:vmm)")
        args.variants[name] = conf.strip(" ,")
    args.train_configs = list(args.train_configs) + [c for c in args.variants if c not in args.train_configs]
    if args.budget <= 0:
        p.error("--budget must be positive")
    if args.sample_ms < 0:
        p.error("--sample-ms must be 0 (off) or positive")
    return args


def step_counts(workload: str, args: argparse.Namespace) -> tuple[int, int]:
    """A workload's timed and warm-up steps."""
    prefix = STEPS[workload][0]
    return getattr(args, f"{prefix}_steps"), getattr(args, f"{prefix}_warmup")


def plans_shapes(workload: str, args: argparse.Namespace) -> bool:
    return bool(getattr(args, f"{STEPS[workload][0]}_plan_shapes", False))


def estimate(workload: str, args: argparse.Namespace) -> float:
    """The default estimate of one run of a workload, in seconds."""
    _, _, _, fixed, per_step = STEPS[workload]
    steps = sum(step_counts(workload, args))
    # Planning: at most one step per distinct shape: per step drawn (llama), 25 (resnet50's default ranges).
    planned = (25 if workload == "resnet50" else steps) if plans_shapes(workload, args) else 0
    return fixed + per_step * (steps + planned)


def rotated(items: list[str], r: int) -> list[str]:
    """items starting at index r (mod len): repeat r's order."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def build_plan(args: argparse.Namespace) -> list[Run]:
    """Every run, repeat by repeat, configurations rotated within each workload."""
    plan: list[Run] = []
    for r in range(args.first_repeat, args.first_repeat + args.repeats):
        for w in WORKLOADS:  # in this order, whatever --workloads's
            if w not in args.workloads:
                continue
            for c in rotated(list(args.train_configs), r):
                plan.append(Run(len(plan) + 1, w, c, r, estimate_s=estimate(w, args)))
    return plan


def print_plan(plan: list[Run], args: argparse.Namespace) -> float:
    """Print the plan with its estimates; return the estimated total."""
    total = ENV_ESTIMATE_S + sum(run.estimate_s for run in plan)
    first = f" (repeats {args.first_repeat}..{args.first_repeat + args.repeats - 1})" if args.first_repeat else ""
    print(f"plan: {len(plan)} runs + 1 env run, {args.repeats} repeat(s){first}")
    print(f"  {'#':>3}  {'workload':<10} {'config':<16} {'repeat':>6} {'est s':>6}")
    print(f"  {'':>3}  {'env':<10} {'-':<16} {'-':>6} {ENV_ESTIMATE_S:>6.1f}")
    for run in plan:
        print(f"  {run.id:>3}  {run.workload:<10} {run.config:<16} {run.repeat:>6} {run.estimate_s:>6.1f}")
    each = {run.workload: run.estimate_s for run in plan}
    parts = ", ".join(f"{w} {n} x {each[w]:.1f} s" for w, n in collections.Counter(r.workload for r in plan).items())
    fits = total <= args.budget
    print(f"estimated total: {total:.0f} s (env {ENV_ESTIMATE_S:.0f} s, {parts}); "
          f"budget {args.budget:.0f} s: {'fits' if fits else 'OVER BUDGET'}")
    return total


# --- running ------------------------------------------------------------------------


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def child_env(config: str, args: argparse.Namespace) -> dict[str, str]:
    """The environment of a workload process under a configuration."""
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GOALLOC_CONF", "GOALLOC_DEVICE",
              "GOALLOC_SIM_DEVICES", "GOALLOC_SIM_MEMORY"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "python"), os.environ.get("PYTHONPATH")]))
    env["GOALLOC_LIBRARY"] = args.goalloc_library
    env["PYTHONUNBUFFERED"] = "1"
    # Nothing can be fetched on the GPU machine; transformers must not try.
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                "TOKENIZERS_PARALLELISM": "false"})
    if config == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif config == "async":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    elif is_goalloc(config):
        # goalloc-vmm adds its backend to it (bench/workloads.py).
        conf = ",".join(filter(None, (args.goalloc_conf, args.variants.get(config, ""))))
        if conf:
            env["GOALLOC_CONF"] = conf
    return env


def workload_command(run: Run, args: argparse.Namespace, out: Path) -> list[str]:
    """The command of one run."""
    cmd = [args.python, args.workloads_script, "--workload", run.workload, "--config", run.config,
           "--repeat", str(run.repeat), "--out", str(out), "--sample-ms", str(args.sample_ms)]
    steps, warmup = step_counts(run.workload, args)
    cmd += ["--steps", str(steps), "--warmup", str(warmup)]
    for name, *_ in workloads.SHAPE_RANGES[run.workload]:
        cmd += [f"--{name}", *map(str, getattr(args, name.replace("-", "_")))]
    if plans_shapes(run.workload, args):
        cmd.append("--plan-shapes")
    if args.record_history and run.config != "async":  # torch's cudaMallocAsync backend keeps no history
        cmd += ["--record-history", str(Path(args.outdir).resolve() / "history" / run.name)]
    return cmd


_current: Optional[subprocess.Popen[str]] = None


def kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill a run's process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def execute(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[str, Optional[int], str, float]:
    """Run cmd; returns (status, return code, output, seconds). Status is
    'ok', 'failed' or 'timeout'. The process gets a session of its own, so
    that a timeout kills it and anything it started."""
    global _current
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
    except OSError as e:
        return "failed", None, f"cannot start {cmd[0]}: {e}", time.monotonic() - t0
    _current = proc
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        status = "timeout"
    except BaseException:
        kill_group(proc)
        proc.communicate()
        raise
    finally:
        _current = None
    return status, proc.returncode, out or "", time.monotonic() - t0


def run_one(run: Run, args: argparse.Namespace, results: Path, timeout: float) -> dict[str, Any]:
    """Run one planned process and return its record for bench.json."""
    out = results / f"{run.name}.json"
    cmd = workload_command(run, args, out)
    rec = run.record(timeout_s=round(timeout, 1), command=shlex.join(cmd))
    status, rc, output, seconds = execute(cmd, child_env(run.config, args), timeout)
    child = read_json(out)
    rec.update(status=status, returncode=rc, wall_s=round(seconds, 3), output_tail=output[-TAIL_CHARS:],
               result=child.pop("result", None) if child else None)
    if child is not None:
        rec["meta"] = child
    if status == "ok" and not (child or {}).get("ok"):
        rec["status"] = "failed"
    if rec["status"] != "ok":
        rec["reason"] = failure_reason(status, rc, child, timeout)
    write_json_atomic(out, rec)
    return rec


def read_json(path: Path) -> Any:
    """The JSON in a file, or None where it is missing or not JSON (a run that died writing it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def failure_reason(status: str, rc: Optional[int], child: Optional[dict[str, Any]], timeout: float) -> str:
    """Why a run did not finish: its own error, its timeout, or how it exited."""
    if child and child.get("error"):
        return str(child["error"])
    if status == "timeout":
        return f"timed out after {timeout:.0f} s"
    if status == "ok" and child is None:
        return "no result file"
    why = f"exit status {rc}"
    if rc is not None and rc < 0:
        with contextlib.suppress(ValueError):
            why += f" ({signal.Signals(-rc).name})"
    return why + ("; no result file" if child is None else "")


def visible_gpu() -> Optional[str]:
    """The first entry of CUDA_VISIBLE_DEVICES (an index or a UUID), cuda:0 to the runs; None if unset or empty."""
    v = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return v or None


def nvidia_smi() -> dict[str, Any]:
    """The GPU as nvidia-smi reports it (name, driver, memory, UUID), or why
    it could not. nvidia-smi ignores CUDA_VISIBLE_DEVICES: it is asked (-i)
    for the first GPU that names."""
    gpu, fields = visible_gpu(), "name,driver_version,memory.total,uuid"
    out: dict[str, Any] = {"selected": gpu} if gpu else {}
    try:
        p = subprocess.run(["nvidia-smi", *(["-i", gpu] if gpu else []), f"--query-gpu={fields}",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return out | {"error": str(e)}
    if p.returncode != 0:
        return out | {"error": (p.stderr or p.stdout).strip()[-500:]}
    first = p.stdout.strip().splitlines()[0] if p.stdout.strip() else ""
    return out | dict(zip(fields.split(","), (v.strip() for v in first.split(","))))


def library_build(path: str) -> dict[str, Any]:
    """The commit goalloc's library was built from, as Go stamps it (`make lib` builds with
    -buildvcs=auto): vcs.revision and vcs.modified, read from the file's bytes. The repository's
    commit (git_commit) says what the tree was when the suite ran; a library carried from elsewhere
    may be older, or built from a tree with changes not committed."""
    out: dict[str, Any] = {"path": path}
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return out | {"error": f"{type(e).__name__}: {e}"}
    for key in ("revision", "modified"):
        m = re.search(rb"vcs\." + key.encode() + rb"=([0-9a-zA-Z]+)", data)
        if m:
            out[key] = m.group(1).decode()
    if "revision" not in out:
        out["error"] = "no vcs.revision in the library (built outside a git checkout, or with -buildvcs=false)"
    return out


def git_commit() -> Optional[str]:
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return p.stdout.strip() or None if p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def summary_line(rec: dict[str, Any]) -> str:
    """A few figures of a finished run, for the console; why it did not finish."""
    r, gib = rec.get("result"), float(1 << 30)
    if rec.get("status") != "ok" or not isinstance(r, dict):
        return (rec.get("reason") or "")[:120]
    a, d = r.get("allocator") or {}, r.get("device") or {}
    mem = a.get("pool_reserved_max_read") if is_goalloc(rec["config"]) else a.get("reserved_peak")
    return (f"{r.get('units_per_s') or 0:.0f} {r.get('unit')}/s  mem {(mem or 0) / gib:.2f} GiB  "
            f"live {(a.get('allocated_peak') or 0) / gib:.2f} GiB  device {(d.get('peak_over_baseline') or 0) / gib:.2f} GiB")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    plan = build_plan(args)
    if args.dry_run:
        total = print_plan(plan, args)
        return 0 if total <= args.budget else 3

    out = Path(args.outdir).resolve()
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    if args.record_history:
        (out / "history").mkdir(exist_ok=True)
    start = time.monotonic()
    runs: list[dict[str, Any]] = []  # bench.json's, as they finish
    measured: dict[str, list[float]] = {}  # wall times of the runs finished, per workload
    doc: dict[str, Any] = {
        "schema": 1, "command": args.command or shlex.join([sys.executable, *sys.argv]),
        "argv": sys.argv[1:] if argv is None else argv, "outdir": str(out), "started": now_iso(), "finished": None,
        "status": "running", "budget_s": args.budget,
        "options": {k: v for k, v in vars(args).items() if k not in ("outdir", "command", "dry_run")},
        "host": {"hostname": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                 "suite_python": sys.version.split()[0], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
        "git_commit": git_commit(), "goalloc_library": library_build(args.goalloc_library),
        "plan": [asdict(r) | {"name": r.name} for r in plan], "runs": runs}

    def save() -> None:
        doc["elapsed_s"] = round(time.monotonic() - start, 1)
        write_json_atomic(out / "bench.json", doc)

    def on_signal(signum: int, _frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"goalloc bench: {len(plan)} runs, budget {args.budget:.0f} s, results in {out}", flush=True)
    exit_status = 0
    in_flight: Optional[Run] = None
    try:
        doc["nvidia_smi"] = nvidia_smi()
        doc["env"] = run_env(args, results)
        print(f"env: {json.dumps(doc['env'])[:400]}", flush=True)
        save()
        for i, run in enumerate(plan):
            elapsed = time.monotonic() - start
            kind = run.workload
            # The longest of the last three runs of its kind, else the default.
            est = max(measured[kind][-3:]) if measured.get(kind) else run.estimate_s
            left = args.budget - elapsed
            if est > left:
                rec = run.record(status="skipped", result=None, reason=f"budget: {elapsed:.0f} s spent, "
                                 f"{est:.0f} s needed, {max(left, 0):.0f} s left")
            else:
                timeout = args.timeout or max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * est)
                timeout = min(timeout, left + GRACE_S)
                in_flight = run
                rec = run_one(run, args, results, timeout)
                in_flight = None
                if rec.get("wall_s") is not None and rec["status"] == "ok":
                    measured.setdefault(kind, []).append(float(rec["wall_s"]))
            runs.append(rec)
            save()
            print(f"[{i + 1:3d}/{len(plan)} {time.monotonic() - start:5.0f}s] {kind:<8} {run.config:<16} "
                  f"r{run.repeat} {rec['status']:<7} {rec.get('wall_s', 0) or 0:5.1f}s  {summary_line(rec)}", flush=True)
        doc["status"] = "complete"
    except Stopped as e:
        doc["status"] = f"stopped ({e})"
        print(f"goalloc bench: stopped by {e}; keeping what finished", flush=True)
        exit_status = 124
    except Exception as e:  # a bug in the suite itself: keep what finished, say what broke
        doc["status"] = f"crashed ({type(e).__name__}: {e})"
        traceback.print_exc()
        exit_status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if _current is not None:
            kill_group(_current)
        done = {r["id"] for r in runs}
        for run in plan:
            if run.id not in done:
                killed = in_flight is not None and run.id == in_flight.id
                runs.append(run.record(status="killed" if killed else "skipped", result=None, reason=(
                    "the suite was stopped while it ran" if killed else "the suite was stopped")))
        doc["finished"] = now_iso()
        save()
    counts = collections.Counter(r["status"] for r in runs)
    print(f"goalloc bench: {doc['status']} in {doc['elapsed_s']:.0f} s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), flush=True)
    if exit_status == 0 and any(r["status"] != "ok" for r in runs):
        exit_status = 1
    return exit_status


def run_env(args: argparse.Namespace, results: Path) -> dict[str, Any]:
    """The env process: versions, the GPU, and a warm page cache."""
    out = results / "000-env.json"
    cmd = [args.python, args.workloads_script, "--workload", "env", "--out", str(out)]
    status, rc, output, seconds = execute(cmd, child_env("native", args), ENV_TIMEOUT_S)
    child = read_json(out)
    env: dict[str, Any] = {"status": status, "wall_s": round(seconds, 3)} | ((child or {}).get("result") or {})
    if child is None or child.get("error"):
        env["error"] = child["error"] if child else output[-TAIL_CHARS:]
    return env


if __name__ == "__main__":
    sys.exit(main())
