"""bench/lockstep.py: two configurations training in turns, tested without a
GPU over a stand-in workload program that speaks the real turn protocol
(bench/workloads.py's Turns)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from goalloc_testing import load_bench

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


lockstep = load_bench("lockstep")

# A training process in miniature: STUB_SLOW_MS per step under configuration
# native, STUB_FAST_MS under any other; STUB_MODE=die makes the goalloc-vmm
# process exit in its third step, hang makes it stop answering there.
STUB = r'''
import argparse, json, os, sys, time
sys.path.insert(0, os.environ["STUB_BENCH"])
from workloads import Turns, turn_fds
p = argparse.ArgumentParser()
p.add_argument("--config"); p.add_argument("--repeat", type=int); p.add_argument("--out")
p.add_argument("--turns", type=turn_fds)
args, _ = p.parse_known_args()
mode = os.environ.get("STUB_MODE", "")
ms = float(os.environ["STUB_SLOW_MS"] if args.config == "native" else os.environ["STUB_FAST_MS"])
turns = Turns(args.turns)
log = []
for i in range(8):
    turns.wait()
    if i == 2 and args.config == "goalloc-vmm" and mode == "die":
        os._exit(3)
    if i == 2 and args.config == "goalloc-vmm" and mode == "hang":
        time.sleep(60)
    t0 = time.perf_counter()
    time.sleep(ms / 1e3)
    log.append({"shape": [32, 160 + 8 * (i % 3)], "seconds": time.perf_counter() - t0, "units": 32, "timed": i >= 2})
    log[-1]["turn"] = turns.done()
turns.finish()
res = {"ok": True, "config": args.config, "repeat": args.repeat, "conf": os.environ.get("GOALLOC_CONF", ""),
       "result": {"unit": "images", "step_log": log}}
json.dump(res, open(args.out, "w"))
'''


def run_lockstep(tmp_path: Path, *argv: str, mode: str = "", slow_ms: float = 30, fast_ms: float = 10,
                 timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    env = dict(os.environ, STUB_MODE=mode, STUB_BENCH=str(BENCH), STUB_SLOW_MS=str(slow_ms), STUB_FAST_MS=str(fast_ms))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(BENCH / "lockstep.py"), str(out), "--workload", "resnet50",
                        "--smoke-cpu", "--workloads-script", str(stub), *argv],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    doc = json.loads((out / "lockstep.json").read_text()) if (out / "lockstep.json").exists() else {}
    return p, doc


def test_pairs_take_turns_step_by_step(tmp_path: Path):
    p, doc = run_lockstep(tmp_path, "--pair", "native,goalloc-vmm", "--repeats", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [q["status"] for q in doc["pairs"]] == ["ok", "ok"]
    for q in doc["pairs"]:
        # The step logs stay in each process's result file; lockstep.json keeps the rest.
        assert all("step_log" not in s["result"] and "output_tail" not in s for s in q["sides"])
        a, b = (json.loads((tmp_path / "out" / "results" / f"{s['name']}.json").read_text())["result"]["step_log"]
                for s in q["sides"])
        assert len(a) == len(b) == 8
        # Never at once: every turn of either process lies outside every turn of the other.
        turns = sorted([tuple(e["turn"]) + ("a",) for e in a] + [tuple(e["turn"]) + ("b",) for e in b])
        assert all(x[1] <= y[0] for x, y in zip(turns, turns[1:])), turns
        # A, B, A, B: every step follows one of the other process; which starts alternates by repeat.
        assert q["first"] == "ab"[q["repeat"] % 2]
        assert "".join(t[2] for t in turns) == ("ab" if q["repeat"] % 2 == 0 else "ba") * 8
        for ea, eb in zip((e["turn"] for e in a), (e["turn"] for e in b)):
            assert (ea[1] <= eb[0]) == (q["first"] == "a") and (eb[1] <= ea[0]) == (q["first"] == "b")
        c = q["compare"]
        assert c["steps"] == 6 and c["overlapping_steps"] == 0
        # b (10 ms a step) against a (30 ms): three times as fast, whichever went first.
        assert 2.0 < c["step_median"] < 3.6 and 2.0 < c["throughput"] < 3.6, c
    assert "resnet50: b=goalloc-vmm against a=native: throughput " in p.stdout
    assert "n=2; faster in 2 of 2)" in p.stdout and "steps that overlapped: 0" in p.stdout


def test_a_pair_of_one_configuration_lands_near_one(tmp_path: Path):
    p, doc = run_lockstep(tmp_path, "--pair", "native,native", "--repeats", "1", "--pin-threads", "0,0,0", slow_ms=20)
    assert p.returncode == 0, p.stdout + p.stderr
    c = doc["pairs"][0]["compare"]
    assert 0.7 < c["step_median"] < 1.4, c
    sides = doc["pairs"][0]["sides"]
    assert [s["name"] for s in sides] == ["r0-resnet50-a-native", "r0-resnet50-b-native"]
    assert all(s["command"].endswith("--pin-threads 0,0,0 --turns " + s["command"].split()[-1]) for s in sides)


PIN = r'''
import ctypes, json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from workloads import pin_threads
libc = ctypes.CDLL(None)
ready, stop, tids = threading.Barrier(3), threading.Event(), {}
def worker(name):
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: the thread's name in /proc, as torch's is
    tids[name] = threading.get_native_id()
    ready.wait(); stop.wait()
for name in ("pt_autograd_0", "helper"):
    threading.Thread(target=worker, args=(name,)).start()
ready.wait()
got = pin_threads(0, 1, {0, 1}, threading.get_native_id())
aff = {n: sorted(os.sched_getaffinity(t)) for n, t in tids.items()}
aff["main"] = sorted(os.sched_getaffinity(0))
stop.set()
print(json.dumps({"pinned": got, "affinity": aff, "tids": tids}))
'''


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_pin_threads_pins_each_role():
    p = subprocess.run([sys.executable, "-c", PIN, str(BENCH)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["affinity"] == {"pt_autograd_0": [1], "helper": [0, 1], "main": [0]}
    assert r["pinned"]["autograd"] == [r["tids"]["pt_autograd_0"]] and len(r["pinned"]["main"]) == 1
    assert r["tids"]["helper"] in r["pinned"]["others"]


@pytest.mark.parametrize("mode, status", [("die", "died"), ("hang", "timeout")])
def test_a_process_that_dies_or_hangs_spoils_only_its_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          mode: str, status: str):
    if mode == "hang":  # a short turn timeout, through the module run in-process
        monkeypatch.setattr(lockstep, "TURN_TIMEOUT_S", 2.0)
        stub = tmp_path / "stub.py"
        stub.write_text(STUB)
        monkeypatch.setenv("STUB_MODE", mode)
        monkeypatch.setenv("STUB_BENCH", str(BENCH))
        monkeypatch.setenv("STUB_SLOW_MS", "5")
        monkeypatch.setenv("STUB_FAST_MS", "5")
        rc = lockstep.main([str(tmp_path / "out"), "--workload", "resnet50", "--smoke-cpu", "--pair",
                            "native,goalloc-vmm", "--repeats", "1", "--workloads-script", str(stub)])
        doc = json.loads((tmp_path / "out" / "lockstep.json").read_text())
    else:
        p, doc = run_lockstep(tmp_path, "--pair", "native,goalloc-vmm", "--repeats", "2", mode=mode)
        rc = p.returncode
    assert rc == 1
    q = doc["pairs"][0]
    a, b = q["sides"]
    assert b["status"] == status, b
    assert ("before its last step" if mode == "die" else "no answer to a turn") in b["reason"], b
    assert a["status"] == "failed" and a["reason"] == f"its partner (b) {status}", a
    assert "compare" not in q and q["status"] in (status, "failed")
    assert not [r for r in doc["pairs"] if "compare" in r]
    # Nothing is left running: both process groups were killed and reaped.
    assert a["returncode"] is not None and b["returncode"] is not None


def test_compare_needs_the_same_steps():
    a = {"step_log": [{"shape": [1, 2], "seconds": 1.0, "units": 1, "timed": True}]}
    b = {"step_log": [{"shape": [1, 3], "seconds": 1.0, "units": 1, "timed": True}]}
    assert lockstep.compare(a, b, ("a", "b")) == {"error": "the two processes did not take the same steps"}
    c = lockstep.compare(a, {"step_log": [{"shape": [1, 2], "seconds": 0.5, "units": 1, "timed": True}]}, ("a", "b"))
    assert c["step_median"] == 2.0 and c["throughput"] == 2.0


def test_a_variant_of_goalloc_vmm_is_one_side(tmp_path: Path):
    p, doc = run_lockstep(tmp_path, "--pair", "goalloc-vmm,goalloc-vmm.h4", "--variant", "h4=vmm_handle:4M",
                          "--repeats", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    (pair,) = doc["pairs"]
    assert pair["status"] == "ok"
    confs = {s["config"]: s["meta"]["conf"] for s in pair["sides"]}
    assert "vmm_handle:4M" in confs["goalloc-vmm.h4"] and "vmm_handle" not in confs["goalloc-vmm"], confs


@pytest.mark.parametrize("argv, message", [
    (["--pair", "native"], "want two of"),
    (["--pair", "goalloc-vmm,goalloc-vmm.h4"], "want two of"),
    (["--pair", "native,tcmalloc"], "want two of"),
    (["--pair", "native,goalloc", "--budget", "0"], "--budget must be positive"),
    (["--pair", "native,goalloc", "--resnet-batch", "64", "32"], "MIN 64 is above MAX 32"),
    (["--pair", "native,goalloc", "--pin-threads", "0,0"], "want at least three CPUs of this process's"),
    (["--pair", "native,goalloc", "--pin-threads", "0,x,1"], "want MAIN,AUTOGRAD,OTHER"),
])
def test_bad_arguments_are_usage_errors(tmp_path: Path, argv: list[str], message: str):
    p = subprocess.run([sys.executable, str(BENCH / "lockstep.py"), str(tmp_path / "o"), "--workload", "resnet50", *argv],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_workloads_takes_turns_only_when_training():
    p = subprocess.run([sys.executable, str(BENCH / "workloads.py"), "--workload", "env", "--out", "x.json",
                        "--turns", "3,4"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "only the training workloads take turns or pin threads" in p.stderr
    p = subprocess.run([sys.executable, str(BENCH / "workloads.py"), "--workload", "resnet50", "--out", "x.json",
                        "--turns", "3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "want GO,REPLY" in p.stderr
    p = subprocess.run([sys.executable, str(BENCH / "workloads.py"), "--workload", "resnet50", "--out", "x.json",
                        "--pin-threads", "0,0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "want at least three CPUs of this process's" in p.stderr


def test_the_written_file_has_no_step_logs(tmp_path: Path):
    doc = {"kind": "lockstep", "pairs": [
        {"repeat": 0, "status": "ok", "compare": {"throughput": 1.0},
         "sides": [{"label": "a", "output_tail": "...", "result": {"step_log": [1, 2], "units_per_s": 5.0}}]},
        {"repeat": 1, "status": "skipped"}]}
    assert lockstep.slim(doc) == {"kind": "lockstep", "pairs": [
        {"repeat": 0, "status": "ok", "compare": {"throughput": 1.0},
         "sides": [{"label": "a", "result": {"units_per_s": 5.0}}]},
        {"repeat": 1, "status": "skipped"}]}
    assert doc["pairs"][0]["sides"][0]["result"]["step_log"] == [1, 2]  # the input is left as it was


def test_report_merges_files_by_pair_with_cpu_by_thread(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    def side(label: str, main_ms: float, others_ms: float) -> dict[str, Any]:
        return {"label": label, "result": {"steps": 10, "threads": [
            {"name": "python3", "main": True, "cpu_ms": main_ms * 10},
            {"name": "pt_autograd_0", "main": False, "cpu_ms": 50.0},
            {"name": "python3", "main": False, "cpu_ms": others_ms * 5}, {"name": "x", "main": False, "cpu_ms": others_ms * 5}]}}

    def doc(ts: list[float]) -> dict[str, Any]:
        return {"kind": "lockstep", "workload": "resnet50", "pair": ["native", "goalloc-vmm"], "pairs": [
            {"repeat": i, "status": "ok", "sides": [side("a", 10.0, 0.0), side("b", 9.0 + t, 1.0)],
             "compare": {"steps": 100, "throughput": t, "step_median": t, "by_first": {"a": t - 0.1, "b": t + 0.1},
                         "median_step_s": {"a": 0.02, "b": 0.02 / t}, "overlapping_steps": 0}}
            for i, t in enumerate(ts)] + [{"repeat": len(ts), "status": "died"}]}

    for i, ts in enumerate(([0.9, 1.1], [1.0])):
        (tmp_path / f"{i}.json").write_text(json.dumps(doc(ts)))
    assert lockstep.main(["report", str(tmp_path / "0.json"), str(tmp_path / "1.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("resnet50: b=goalloc-vmm against a=native: throughput 1.000× (0.900–1.100, n=3; faster in 1 of 3), "
                      "step median 1.000 (0.900-1.100)")
    assert [line.split()[0] for line in out[1:4]] == ["r0", "r1", "r0"]  # every repeat of both files
    assert "throughput 0.900  step median 0.900  (a first)" in out[1] and "(b first)" in out[2]
    assert out[4:] == ["  a=native: median step 20.00 ms, CPU ms a step: training 10.00, autograd 5.00, others 0.00",
                       "  b=goalloc-vmm: median step 20.00 ms, CPU ms a step: training 10.00, autograd 5.00, others 1.00"]
    assert lockstep.main(["report"]) == 2


def test_report_refuses_what_is_not_a_lockstep_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "bench.json").write_text(json.dumps({"runs": []}))
    (tmp_path / "bad.json").write_text("{")
    for argv, why in ((["report", str(tmp_path / "bench.json")], "is not a bench/lockstep.py lockstep.json"),
                      (["report", str(tmp_path / "bad.json")], "cannot read"),
                      (["report", str(tmp_path / "missing.json")], "cannot read")):
        assert lockstep.main(argv) == 1
        assert why in capsys.readouterr().err

