"""PyTorch's own CUDA tests under PyTorch's allocator and under goalloc.

    python3 tests/gpu/torch_suite.py PATH/test_cuda.py --allocator native
    python3 tests/gpu/torch_suite.py PATH/test_cuda.py --allocator goalloc \
        --merge tests/gpu/results/torch-suite.json

PATH/test_cuda.py is PyTorch's file (test/test_cuda.py of the revision that
matches the installed torch); it is not part of this repository. It imports
`expecttest` and `psutil`, which must be importable.

One pytest process runs the tests of the chosen classes in order, with
torch_suite_plugin.py loaded: it installs goalloc first (--allocator
goalloc), logs each test's start and outcome, and ends the process when a
test leaves CUDA unusable. When a process crashes, hangs (no test finished
for --test-timeout seconds) or ends broken, the runner starts a new one at
the next test, so one test cannot fail all that follow; so it does after a
test that failed, which may have skipped its own clean-up (a memory cap, an
allocator setting). Then every test that
did not pass or skip is run again alone, in a fresh process: its outcome in
the results is that one, and "sequence" keeps what it did in the first pass
where that differs.

The results file (--out) holds {"torch", "revision", "native": {test:
outcome}, "goalloc": {test: outcome}, "exceptions": {test: reason}, ...};
--merge takes the other allocator's outcomes from an earlier file, since
both rarely fit one GPU call, and this allocator's of the classes not run;
the file must come from the same revision of PyTorch's file (--revision),
else the run is refused. It prints how many of the tests that pass under
PyTorch's allocator pass under goalloc, and which do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CLASSES = ("TestCuda", "TestMemPool", "TestBlockStateAbsorption", "TestCudaMallocAsync",
           "TestCachingHostAllocatorCudaGraph")
FAILED = ("failed", "error", "crashed", "timeout", "broke")
NOT_RUN = "not run"

# Tests that pass under PyTorch's allocator and may fail under goalloc by
# design: the reason a PyTorch user would accept. At most five; each is in
# the README's limitations too.
EXCEPTIONS: dict[str, str] = {
    "TestCuda::test_graph_memory_stats_and_use_result_after_destroy_graph":
        "asserts PyTorch's own segment sizes (2 MiB small buffers, 20 MiB large buffers, 2 MiB rounding) in "
        "memory_stats deltas; goalloc carves 256-448 KiB small segments and maps 4 MiB handles",
    "TestCuda::test_graph_two_successive":
        "asserts that sharing a graph pool saves exactly one of PyTorch's 2 MiB small-buffer segments of reserved "
        "memory (the test marks the check as specific to PyTorch's allocator)",
    "TestCudaMallocAsync::test_max_split_expandable":
        "fills a 120 MiB cap to the byte; goalloc maps whole handles and never passes a cap: with 16 MiB handles "
        "the last 8 MiB under it stayed unmapped; 4 MiB ones, the default since, fill it on the simulated device",
}


def pytest_command(test_file: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "torch_suite_plugin",
            "-c", os.devnull, "--rootdir", str(test_file.parent), "-rN", "--tb=short", *args]


def child_env(allocator: str, log: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TORCH_SUITE_RESTART"] = "1"
    env["TORCH_SUITE_LOG"] = str(log)
    env["TORCH_SUITE_ALLOCATOR"] = allocator
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(HERE), str(ROOT / "python")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"  # the failure's own last lines, not how to rerun it
    return env


def collect(test_file: Path, allocator: str, classes: list[str], keyword: str) -> list[str]:
    """The node ids of the tests of classes, in file order."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "collect.jsonl"
        args = ["--collect-only", *[f"{test_file}::{c}" for c in classes]]
        if keyword:
            args += ["-k", keyword]
        p = subprocess.run(pytest_command(test_file, args), env=child_env(allocator, log), cwd=test_file.parent,
                           capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in p.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        sys.exit(f"torch_suite: collected no tests (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return ids


def read_log(log: Path) -> list[dict[str, Any]]:
    events = []
    if log.exists():
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut short by a crash
    return events


class Run:
    """One pass over tests, in as many processes as crashes make it take."""

    def __init__(self, test_file: Path, allocator: str, test_timeout: float, deadline: float, verbose: bool):
        self.test_file = test_file
        self.allocator = allocator
        self.test_timeout = test_timeout
        self.deadline = deadline
        self.verbose = verbose
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.processes = 0

    def run(self, tests: list[str]) -> None:
        remaining = list(tests)
        while remaining and time.time() < self.deadline:
            started = self._process(remaining)
            remaining = [t for t in remaining if t not in started]

    def _process(self, tests: list[str]) -> set[str]:
        """Run tests in one pytest process; return those it started."""
        self.processes += 1
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "events.jsonl"
            log.touch()
            out = open(Path(tmp) / "output.txt", "w+", encoding="utf-8")
            p = subprocess.Popen(pytest_command(self.test_file, tests), env=child_env(self.allocator, log),
                                 cwd=self.test_file.parent, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            last_size, last_change, why = -1, time.time(), ""
            while p.poll() is None:
                time.sleep(0.5)
                size = log.stat().st_size
                if size != last_size:
                    last_size, last_change = size, time.time()
                if time.time() - last_change > self.test_timeout:
                    why = "timeout"
                elif time.time() > self.deadline:
                    why = "deadline"
                if why:
                    os.killpg(p.pid, 9)
                    p.wait()
                    break
            events = read_log(log)
            out.seek(0)
            output = out.read()
            out.close()
        started, current, began = set(), None, 0.0
        for e in events:
            if e["ev"] == "start":
                started.add(e["test"])
                current, began = e["test"], e["t"]
            elif e["ev"] == "done":
                self.outcomes[e["test"]] = e["outcome"]
                self.seconds[e["test"]] = round(e["t"] - began, 1)
                if e.get("message"):
                    self.messages[e["test"]] = e["message"]
                current = None
            elif e["ev"] == "broken":
                self.outcomes[e["test"]] = "broke"
                self.messages[e["test"]] = ("left CUDA unusable: " + e["message"] + "\n" +
                                            self.messages.get(e["test"], ""))[-1500:]
        if current is not None:
            if why == "deadline":
                started.discard(current)
            else:
                self.outcomes[current] = why or "crashed"
                self.messages[current] = f"process {why or 'died'} (exit {p.returncode}): " + output[-1200:]
        if not started and why != "deadline":
            # Nothing started: the process could not even begin (import error).
            for t in tests:
                self.outcomes[t] = "error"
                self.messages[t] = f"pytest exited {p.returncode} before any test: " + output[-1200:]
            started = set(tests)
        if self.verbose:
            print(f"  process {self.processes}: {len(started)} started, exit {p.returncode}"
                  f"{', ' + why if why else ''}", flush=True)
        return started


PASSED = ("passed", "skipped", "xfailed")


def selected(tests: list[str], select: str, before: dict[str, str], native: dict[str, str]) -> list[str]:
    """The tests to run: all, those without an outcome in before (missing),
    those that did not pass there (unpassed), or of those the ones that
    passed under PyTorch's allocator (regressions)."""
    if select == "missing":
        return [t for t in tests if before.get(short(t), NOT_RUN) == NOT_RUN]
    if select == "unpassed":
        return [t for t in tests if before.get(short(t), NOT_RUN) not in PASSED]
    if select == "regressions":
        return [t for t in tests if before.get(short(t), NOT_RUN) not in PASSED and native.get(short(t)) == "passed"]
    return tests


def run_allocator(args: argparse.Namespace, deadline: float, before: dict[str, str],
                  native: dict[str, str]) -> dict[str, Any]:
    tests = selected(collect(args.test_file, args.allocator, args.classes, args.k), args.select, before, native)
    print(f"{args.allocator}: {len(tests)} tests ({args.select})", flush=True)
    first = Run(args.test_file, args.allocator, args.test_timeout, deadline, True)
    first.run(tests)
    outcomes = {t: first.outcomes.get(t, NOT_RUN) for t in tests}
    messages = dict(first.messages)
    sequence: dict[str, str] = {}
    rerun = [t for t in tests if outcomes[t] in FAILED]
    print(f"{args.allocator}: first pass done ({first.processes} processes); {len(rerun)} to run alone", flush=True)
    for t in rerun:
        if time.time() > deadline:
            break
        alone = Run(args.test_file, args.allocator, args.test_timeout, deadline, False)
        alone.run([t])
        if t in alone.outcomes:
            if alone.outcomes[t] != outcomes[t]:
                sequence[t] = outcomes[t]
            outcomes[t] = alone.outcomes[t]
            if t in alone.messages:
                messages[t] = alone.messages[t]
            elif alone.outcomes[t] not in FAILED:
                messages.pop(t, None)
    keep = {t: messages[t] for t in tests if outcomes[t] not in ("passed", "skipped") and t in messages}
    slowest = dict(sorted(first.seconds.items(), key=lambda kv: -kv[1])[:15])
    return {"outcomes": outcomes, "sequence": sequence, "messages": keep, "slowest": slowest}


def commit() -> str:
    """The commit of the working tree the runner is in, "" outside git."""
    p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else ""


def short(nodeid: str) -> str:
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def compare(native: dict[str, str], goalloc: dict[str, str]) -> tuple[list[str], list[str]]:
    """The tests that pass under native, and those of them that do not pass under goalloc."""
    passing = sorted(t for t, o in native.items() if o == "passed")
    missing = [t for t in passing if goalloc.get(t) != "passed"]
    return passing, missing


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("test_file", type=Path, help="PyTorch's test/test_cuda.py")
    ap.add_argument("--allocator", choices=("native", "goalloc"), required=True)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "torch-suite.json")
    ap.add_argument("--merge", type=Path, help="an earlier results file: keep its other allocator's outcomes")
    ap.add_argument("--revision", default="", help="the PyTorch revision test_file comes from")
    ap.add_argument("--commit", default="", help="goalloc's commit under test (default: git's HEAD, where there is git)")
    ap.add_argument("--classes", nargs="+", default=list(CLASSES))
    ap.add_argument("-k", default="", help="pytest -k expression, to run part of the classes")
    ap.add_argument("--select", choices=("all", "missing", "unpassed", "regressions"), default="all",
                    help="run all tests, or only those the --merge file has no outcome for (missing), that did "
                         "not pass there (unpassed) under this allocator, or of those the ones that passed under "
                         "PyTorch's allocator (regressions); the others keep their outcome")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--test-timeout", type=float, default=150, help="seconds one test may take (default 150)")
    args = ap.parse_args(argv)
    if not args.test_file.is_file():
        ap.error(f"{args.test_file}: no such file")
    args.test_file = args.test_file.resolve()
    deadline = time.time() + args.budget
    started = time.time()

    import torch  # the GPU machine's; only its version is read here

    result: dict[str, Any] = {"torch": torch.__version__, "revision": args.revision, "native": {}, "goalloc": {},
                              "exceptions": {}}
    old: dict[str, Any] = {}
    if args.merge and args.merge.is_file():
        old = json.loads(args.merge.read_text())
        # Outcomes of two versions of PyTorch's file are not one table: a
        # test may differ between them, or exist in one only.
        if args.revision and old.get("revision") and old["revision"] != args.revision:
            ap.error(f"{args.merge} holds outcomes of PyTorch's file at {old['revision']}, not {args.revision}: "
                     "merging them would mix two versions of the tests (write this run to another --out, "
                     "without --merge)")
        for k, v in old.items():
            if k != args.allocator and not k.startswith(args.allocator + "_") and k != "revision":
                result[k] = v
        result["revision"] = args.revision or old.get("revision", "")
    elif args.select != "all":
        ap.error("--select missing or unpassed needs a --merge file")
    got = run_allocator(args, deadline, old.get(args.allocator, {}), old.get("native", {}))
    ran = {short(t) for t in got["outcomes"]}
    # A run of all tests replaces this allocator's outcomes of the classes it
    # ran; those of other classes stay, with the runs that gave them.
    keep = old if args.select != "all" else {
        k: {t: o for t, o in v.items() if t.split("::")[0] not in args.classes}
        for k, v in old.items() if isinstance(v, dict)}

    def merged(key: str, new: dict[str, Any]) -> dict[str, Any]:
        kept = {t: v for t, v in keep.get(key, {}).items() if t not in ran}
        return {**kept, **{short(t): v for t, v in new.items()}}

    result[args.allocator] = merged(args.allocator, got["outcomes"])
    result[args.allocator + "_sequence"] = merged(args.allocator + "_sequence", got["sequence"])
    result[args.allocator + "_messages"] = merged(args.allocator + "_messages", got["messages"])
    result[args.allocator + "_seconds"] = round(time.time() - started, 1)
    result[args.allocator + "_slowest"] = {short(t): s for t, s in got["slowest"].items()}
    result["exceptions"] = dict(EXCEPTIONS)
    # Where each allocator's outcomes come from: every run merged into the
    # file, with its commit, classes and what it selected. A run of all tests
    # replaces this allocator's earlier runs of classes it covers (a run that
    # names none covered the file's classes).
    def replaced(r: dict[str, Any]) -> bool:
        return (args.select == "all" and r.get("allocator") == args.allocator
                and set(r.get("classes", old.get("classes", CLASSES))) <= set(args.classes))

    runs = [r for r in result.get("runs", []) if not replaced(r)]
    runs.append({"allocator": args.allocator, "select": args.select, "commit": args.commit or commit(), "tests": len(ran),
                 "classes": args.classes, "seconds": round(time.time() - started, 1)})
    result["runs"] = runs
    result["classes"] = list(dict.fromkeys([*old.get("classes", []), *args.classes]))
    passing, missing = compare(result["native"], result["goalloc"])
    excused = [t for t in missing if t in EXCEPTIONS]
    failing = [t for t in missing if t not in EXCEPTIONS]
    if result["native"] and result["goalloc"]:
        result["summary"] = {"native_passed": len(passing), "goalloc_passed_of_those": len(passing) - len(missing),
                             "excepted": len(excused), "regressions": failing}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")

    counts: dict[str, int] = {}
    for o in got["outcomes"].values():
        counts[o] = counts.get(o, 0) + 1
    print(f"{args.allocator}: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) +
          f" in {time.time() - started:.0f} s")
    for t, o in got["outcomes"].items():
        if o in FAILED or o == NOT_RUN:
            msg = got["messages"].get(t, "").strip().splitlines()
            print(f"  {o:8} {short(t)}  {msg[-1][:200] if msg else ''}")
    if "summary" in result:
        print(f"{len(passing) - len(missing)} of PyTorch's {len(passing)} passing tests pass under goalloc"
              f" ({len(excused)} excepted); not passing: {', '.join(failing) or 'none'}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
