#!/usr/bin/env python3
"""Two configurations training in lockstep on one GPU, step by step in turns.

    python3 bench/lockstep.py OUTDIR --pair native,goalloc-vmm --workload resnet50 \\
        [--repeats 8] [--first-repeat 0] [--budget 480] [--pin-threads 1,2,3,4] [bench/suite.py options ...]
    python3 bench/lockstep.py OUTDIR --pair goalloc-vmm,goalloc-vmm.h4 --variant h4=vmm_handle:4M ...
    python3 bench/lockstep.py report OUTDIR/lockstep.json [MORE.json ...]

Host-bound steps drift with the host, so runs made one after another compare
hosts as much as allocators. Here the two configurations of a repeat run at
the same time, each a fresh process on one GPU, in turns: A takes one step
(timed between device synchronisations), then B the same shape, A, B, A, B.
With --pin-threads both pin their training thread, torch's autograd thread
and the rest alike, so a CPU slowed for a while slows both. Per repeat: B's
throughput over A's, the median over the steps of A's step time over B's.
Memory is not measured (the processes share the device); a pair of one
configuration (native,native) shows how far from 1 the method itself lands.

Writes OUTDIR/lockstep.json (bench/render.py --lockstep reads it),
OUTDIR/results/NAME.json per process (with its step log) and OUTDIR/NAME.log.
"""

from __future__ import annotations

import argparse
import os
import platform
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render  # noqa: E402  (bench/render.py: lockstep runs grouped and summed up)
import suite  # noqa: E402  (bench/suite.py: the processes' commands and environments)
from workloads import cpu_roles  # noqa: E402  (the CPUs --pin-threads takes)

TURN_TIMEOUT_S = 300.0  # a turn's reply; the first holds the process's start and, planned, a new shape
EXIT_TIMEOUT_S = 120.0  # after its last step a process reports and exits within this
PAIR_ESTIMATE_FACTOR = 1.6  # before a pair has run: the steps in series, the two starts at once


class Side:
    """One process of a pair: its configuration, its pipes, its files."""

    def __init__(self, label: str, config: str, repeat: int, workload: str, results: Path, logs: Path):
        self.label, self.config = label, config
        self.name = f"r{repeat}-{workload}-{label}-{config}"
        self.out = results / f"{self.name}.json"
        self.log = logs / f"{self.name}.log"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.go = self.reply = -1
        self.command = ""
        self.status = "ok"
        self.reason = ""

    def start(self, cmd: list[str], env: dict[str, str]) -> None:
        go_r, self.go = os.pipe()
        self.reply, reply_w = os.pipe()
        cmd = cmd + ["--turns", f"{go_r},{reply_w}"]
        self.command = shlex.join(cmd)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=suite.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(go_r, reply_w), start_new_session=True)
        os.close(go_r)
        os.close(reply_w)

    def turn(self, deadline: float) -> bytes:
        """One step: b"d" done, b"e" it had no more steps, b"" it died or
        did not answer in time (status says which)."""
        try:
            os.write(self.go, b"g")
        except BrokenPipeError:
            pass  # it closed its end: after its last step (b"e" waits to be read) or dying
        asked = time.monotonic()
        ready, _, _ = select.select([self.reply], [], [], max(0.0, deadline - asked))
        if not ready:
            self.fail("timeout", f"no answer to a turn within {time.monotonic() - asked:.0f} s")
            return b""
        b = os.read(self.reply, 1)
        if b not in (b"d", b"e"):
            self.fail("died", "its turns ended before its last step")
            return b""
        return b

    def fail(self, status: str, reason: str) -> None:
        if self.status == "ok":
            self.status, self.reason = status, reason

    def close(self) -> None:
        for fd in (self.go, self.reply):
            if fd >= 0:
                os.close(fd)
        self.go = self.reply = -1

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            suite.kill_group(self.proc)  # type: ignore[arg-type]

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"label": self.label, "config": self.config, "name": self.name,
                               "command": self.command, "status": self.status}
        if self.proc is not None:
            rec["returncode"] = self.proc.returncode
        child = suite.read_json(self.out)
        rec["result"] = child.pop("result", None) if child else None
        rec["meta"] = child
        if self.status == "ok" and (child is None or not child.get("ok")):
            self.status = rec["status"] = "failed"
            self.reason = (child or {}).get("error") or f"exit status {rec.get('returncode')}; no result"
        if self.reason:
            rec["reason"] = self.reason
        try:
            rec["output_tail"] = self.log.read_text(errors="replace")[-suite.TAIL_CHARS:]
        except OSError:
            pass
        return rec


def run_pair(sides: list[Side], cmds: list[list[str]], envs: list[dict[str, str]], repeat: int,
             timeout: float) -> None:
    """Start both processes and give them turns until both are done, the
    first turn of every step to A in even repeats, to B in odd ones."""
    try:
        for side, cmd, env in zip(sides, cmds, envs):
            side.start(cmd, env)
        end = time.monotonic() + timeout
        alive = [0, 1]
        first = repeat % 2
        while alive:
            for k in sorted(alive, key=lambda k: (k - first) % 2):
                b = sides[k].turn(min(end, time.monotonic() + TURN_TIMEOUT_S))
                if b == b"d":
                    continue
                alive.remove(k)
                if b == b"":  # it died or hangs: the pair is spoilt
                    for other in sides:
                        if other is not sides[k]:
                            other.fail("failed", f"its partner ({sides[k].label}) {sides[k].status}")
                    return
        for side in sides:
            assert side.proc is not None
            try:
                side.proc.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                side.fail("timeout", f"still running {EXIT_TIMEOUT_S:.0f} s after its last step")
    finally:
        for side in sides:
            side.kill()
            if side.proc is not None:
                side.proc.wait()
            side.close()


def compare(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str]) -> dict[str, Any]:
    """B against A over the timed steps both took, from the two processes'
    step logs (each entry: shape, seconds, units, timed, turn)."""
    la, lb = a.get("step_log") or [], b.get("step_log") or []
    if len(la) != len(lb) or any(x["shape"] != y["shape"] for x, y in zip(la, lb)):
        return {"error": "the two processes did not take the same steps"}
    # Two steps that ran at the same time: the coordinator failed.
    overlaps = sum(1 for x, y in zip(la, lb) if (tx := x.get("turn")) and (ty := y.get("turn"))
                   and tx[0] < ty[1] and ty[0] < tx[1])
    both = [(x, y) for x, y in zip(la, lb) if x["timed"] and y["timed"] and x["seconds"] > 0 and y["seconds"] > 0]
    if not both:
        return {"error": "no timed steps"}
    sec_a, sec_b, units_a, units_b = (sum(p[i][key] for p in both) for key in ("seconds", "units") for i in (0, 1))
    return {
        "steps": len(both),
        "throughput": (units_b / sec_b) / (units_a / sec_a),
        "step_median": median(x["seconds"] / y["seconds"] for x, y in both),
        "median_step_s": {labels[0]: median([e["seconds"] for e in la if e["timed"]]),
                          labels[1]: median([e["seconds"] for e in lb if e["timed"]])},
        "overlapping_steps": overlaps,
    }


def slim(doc: dict[str, Any]) -> dict[str, Any]:
    """doc without the processes' step logs and output (results/NAME.json and NAME.log keep them)."""
    out = dict(doc, pairs=[])
    for p in doc.get("pairs", []):
        q = dict(p)
        if "sides" in p:
            q["sides"] = [{k: v for k, v in side.items() if k != "output_tail"}
                          | ({"result": {k: v for k, v in side["result"].items() if k != "step_log"}}
                             if isinstance(side.get("result"), dict) else {}) for side in p["sides"]]
        out["pairs"].append(q)
    return out


def thread_cpu(result: dict[str, Any]) -> Optional[dict[str, float]]:
    """CPU ms a timed step of one process, by thread: the training thread, torch's autograd thread, the others."""
    threads, steps = result.get("threads"), result.get("steps")
    if not threads or not steps:
        return None
    out = {"training": 0.0, "autograd": 0.0, "others": 0.0}
    for t in threads:
        role = "training" if t.get("main") else "autograd" if str(t.get("name")).startswith("pt_autograd_") else "others"
        out[role] += float(t.get("cpu_ms") or 0.0) / steps
    return out


def report(docs: list[dict[str, Any]]) -> str:
    """Several lockstep.json documents merged by workload and pair: the comparison
    over all their repeats, each repeat's line, and each configuration's
    median step and CPU a step by thread (medians over its processes)."""
    lines = []
    for (workload, a, b), pairs in render.lockstep_groups({"lockstep": docs}).items():
        m = render.Agg([p["compare"]["step_median"] for p in pairs])
        lines.append(f"{workload}: b={b} against a={a}: throughput {render.lockstep_summary([p['compare'] for p in pairs])}"
                     f", step median {m.median:.3f} ({m.lo:.3f}-{m.hi:.3f})")
        lines += [report_line(p["repeat"], p, ("a", "b")) for p in pairs]
        for k, label in enumerate(("a", "b")):
            cpu = [c for c in (thread_cpu(p["sides"][k]["result"] or {}) for p in pairs) if c]
            step = [p["compare"]["median_step_s"][label] * 1e3 for p in pairs]
            line = f"  {label}={(a, b)[k]}: median step {median(step):.2f} ms"
            if cpu:
                line += ", CPU ms a step: " + ", ".join(f"{r} {median([c[r] for c in cpu]):.2f}"
                                                        for r in ("training", "autograd", "others"))
            lines.append(line)
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other option goes to bench/suite.py (steps, shapes, --resnet-plan-shapes, "
                                       "--goalloc-conf, --goalloc-library, ...).")
    p.add_argument("outdir")
    p.add_argument("--pair", required=True, metavar="A,B", help="the two configurations (the same twice: an A/A check)")
    p.add_argument("--workload", required=True, choices=suite.TRAIN_WORKLOADS)
    p.add_argument("--repeats", type=suite.positive_int, default=3)
    p.add_argument("--first-repeat", type=suite.nonneg_int, default=0)
    p.add_argument("--budget", type=float, default=suite.DEFAULT_BUDGET_S,
                   help="seconds for all pairs: a pair that no longer fits is skipped")
    p.add_argument("--pin-threads", type=cpu_roles, metavar="MAIN,AUTOGRAD,OTHER[,OTHER...]",
                   help="both processes pin their training thread, autograd thread and other threads to these CPUs")
    p.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)  # the processes train on the CPU
    args, rest = p.parse_known_args(argv)
    pair = [c.strip() for c in args.pair.split(",")]
    vp = argparse.ArgumentParser(add_help=False)
    vp.add_argument("--variant", action="append", default=[])
    named = list(suite.CONFIGS) + [f"goalloc-vmm.{v.partition('=')[0]}" for v in vp.parse_known_args(rest)[0].variant]
    if len(pair) != 2 or any(c not in named for c in pair):
        p.error(f"--pair {args.pair!r}: want two of {', '.join(named)}, comma-separated "
                "(goalloc-vmm.LABEL: a --variant LABEL=CONF)")
    if args.budget <= 0:
        p.error("--budget must be positive")
    args.pair = pair
    configs = sorted({c for c in pair if c in suite.CONFIGS}) or ["goalloc-vmm"]  # variants: bench/suite.py adds them
    sargs = suite.parse_args([args.outdir, "--workloads", args.workload, "--train-configs", ",".join(configs),
                              "--repeats", str(args.repeats), "--first-repeat", str(args.first_repeat), *rest])
    sargs.sample_ms = 0.0  # two processes on one device: mem_get_info cannot tell them apart
    return args, sargs


def report_line(rep: int, pair: dict[str, Any], labels: tuple[str, str]) -> str:
    c = pair.get("compare") or {}
    if pair["status"] != "ok" or "error" in c:
        return f"  r{rep:<3} {pair['status']}: {pair.get('reason') or c.get('error')}"
    ms = c["median_step_s"]
    return (f"  r{rep:<3} steps {c['steps']:>3}  {labels[0]} {ms[labels[0]] * 1e3:6.2f} ms  {labels[1]} "
            f"{ms[labels[1]] * 1e3:6.2f} ms  throughput {c['throughput']:.3f}  step median {c['step_median']:.3f}"
            f"  ({labels[rep % 2]} first)")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # lockstep.json files merged: python3 bench/lockstep.py report FILE...
        if len(argv) < 2:
            print("usage: python3 bench/lockstep.py report LOCKSTEP.json ...", file=sys.stderr)
            return 2
        docs = [render.read_lockstep(path) for path in argv[1:]]
        if any(d is None for d in docs):
            return 1
        print(report(docs))  # type: ignore[arg-type]
        return 0
    args, sargs = parse_args(argv)
    out = Path(args.outdir).resolve()
    results, logs = out / "results", out
    results.mkdir(parents=True, exist_ok=True)
    a, b = args.pair
    doc: dict[str, Any] = {
        "schema": 1, "kind": "lockstep", "command": shlex.join(["python3", "bench/lockstep.py", *argv]),
        "started": suite.now_iso(), "workload": args.workload, "pair": args.pair, "labels": [f"a:{a}", f"b:{b}"],
        "options": {k: v for k, v in vars(sargs).items() if k not in ("outdir", "command", "dry_run")},
        "host": {"hostname": platform.node(), "cpus": os.cpu_count(), "cpus_allowed": sorted(os.sched_getaffinity(0)),
                 "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
        "git_commit": suite.git_commit(), "goalloc_library": suite.library_build(sargs.goalloc_library), "pairs": [],
    }
    if not args.smoke_cpu:
        doc["nvidia_smi"] = suite.nvidia_smi()
    start = time.monotonic()
    walls: list[float] = []
    est = PAIR_ESTIMATE_FACTOR * suite.estimate(args.workload, sargs)

    def save() -> None:
        doc["elapsed_s"] = round(time.monotonic() - start, 1)
        suite.write_json_atomic(out / "lockstep.json", slim(doc))

    print(f"lockstep: {args.workload}, B={b} against A={a}, repeats {args.first_repeat}.."
          f"{args.first_repeat + args.repeats - 1}, budget {args.budget:.0f} s, results in {out}", flush=True)
    status = 0
    for rep in range(args.first_repeat, args.first_repeat + args.repeats):
        need = max(walls[-3:]) if walls else est
        left = args.budget - (time.monotonic() - start)
        pair: dict[str, Any] = {"repeat": rep}
        if need > left:
            pair.update(status="skipped", reason=f"budget: {need:.0f} s needed, {max(left, 0):.0f} s left")
        else:
            sides = [Side(lab, cfg, rep, args.workload, results, logs) for lab, cfg in zip("ab", args.pair)]
            extra = (["--smoke-cpu"] if args.smoke_cpu else []) + (
                ["--pin-threads", ",".join(map(str, args.pin_threads))] if args.pin_threads else [])
            cmds = [suite.workload_command(suite.Run(0, args.workload, s.config, rep), sargs, s.out) + extra for s in sides]
            envs = [suite.child_env(s.config, sargs) for s in sides]
            t0 = time.monotonic()
            run_pair(sides, cmds, envs, rep, max(suite.MIN_TIMEOUT_S, suite.TIMEOUT_FACTOR * need))
            wall = time.monotonic() - t0
            recs = [s.record() for s in sides]
            bad = [r for r in recs if r["status"] != "ok"]
            pair.update(status="ok" if not bad else bad[0]["status"], wall_s=round(wall, 3), first="ab"[rep % 2],
                        sides=recs)
            if bad:
                pair["reason"] = "; ".join(f"{r['label']}: {r.get('reason')}" for r in bad)
                status = 1
            else:
                walls.append(wall)
                pair["compare"] = compare(recs[0]["result"], recs[1]["result"], (sides[0].label, sides[1].label))
        doc["pairs"].append(pair)
        save()
        print(report_line(rep, pair, ("a", "b")), flush=True)
    doc["finished"] = suite.now_iso()
    save()
    compared = [p["compare"] for p in doc["pairs"] if "error" not in p.get("compare", {"error": None})]
    print(report([slim(doc)]) + f"\nsteps that overlapped: {sum(c['overlapping_steps'] for c in compared)}"
          if compared else "lockstep: no repeat compared", flush=True)
    return status if compared else 1


if __name__ == "__main__":
    sys.exit(main())
