"""The GPU benchmark suite (bench/), tested without a GPU.

What runs here: the plan and its time budget (suite.py --dry-run), argument
handling, the whole suite driving a stand-in workload program
(failures, crashes, timeouts, the budget, SIGTERM: every run recorded, partial
results kept), and the renderer on a bench.json with known numbers. Only the
CPU smoke run of the training code needs torch, and skips without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Optional

import pytest

from goalloc_testing import load_bench

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
GiB = 1 << 30


suite = load_bench("suite")
render = load_bench("render")
workloads = load_bench("workloads")
# issue 33's workloads
NEW_WORKLOADS = ("rollout", "checkpoint", "serving", "moe")
# Tiny shapes for the CPU smoke run (the models are tiny there too).
NEW_WORKLOAD_CPU_SHAPES = [
    ("rollout", ["--rollout-batch", "2", "3", "--rollout-prompt", "8", "16", "--rollout-new", "4", "8",
                 "--rollout-micro", "1", "3"]),
    ("checkpoint", ["--checkpoint-batch", "1", "2", "--checkpoint-seq", "64", "128"]),
    ("serving", ["--serving-batch", "1", "3", "--serving-prompt", "8", "32", "--serving-new", "2", "6"]),
    ("moe", ["--moe-batch", "1", "2", "--moe-seq", "64", "128"]),
]


def run_py(*args: str, env: Optional[dict[str, str]] = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout)


# --- the plan and the options -----------------------------------------------------


def dry_run(*argv: str) -> tuple[int, list[str], float]:
    p = run_py(str(BENCH / "suite.py"), "OUT", "--dry-run", *argv)
    assert p.returncode in (0, 3), p.stdout + p.stderr
    lines = p.stdout.splitlines()
    last = lines[-1]
    assert last.startswith("estimated total: ")
    assert last.endswith("fits") == (p.returncode == 0) and last.endswith("OVER BUDGET") == (p.returncode == 3)
    return p.returncode, lines, float(last.split()[2])


def test_dry_run_lists_every_run():
    rc, lines, total = dry_run()
    assert lines[0] == "plan: 45 runs + 1 env run, 3 repeat(s)"
    rows = [ln.split() for ln in lines if ln.strip()[:1].isdigit()]
    assert len(rows) == 45
    count: dict[str, int] = {}
    for r in rows:
        count[r[1]] = count.get(r[1], 0) + 1
    # 5 (native, expandable, async, goalloc, goalloc-vmm) x 3 per training model.
    assert count == {"gpt2": 15, "llama": 15, "resnet50": 15}
    # Everything is more than one 10-minute call holds: the README splits it over GPUs or calls.
    assert rc == 3 and total > suite.DEFAULT_BUDGET_S


def test_dry_run_of_a_split_fits_the_budget():
    rc, lines, total = dry_run("--workloads", "gpt2,resnet50")
    assert rc == 0 and total <= suite.DEFAULT_BUDGET_S <= 9 * 60
    # The issue's step counts: GPT-2 5 + 45, ResNet-50 5 + 35.
    assert "gpt2 15 x 16.5 s" in lines[-1] and "resnet50 15 x 11.3 s" in lines[-1]


def test_dry_run_over_budget_says_so_and_exits_3():
    p = run_py(str(BENCH / "suite.py"), "OUT", "--dry-run", "--repeats", "9")
    assert p.returncode == 3
    assert "OVER BUDGET" in p.stdout.splitlines()[-1]


def test_quick_is_one_short_repeat():
    args = suite.parse_args(["OUT", "--quick"])
    plan = suite.build_plan(args)
    assert args.repeats == 1 and args.gpt2_steps == 2 and args.resnet_steps == 2 and args.llama_steps == 2
    assert args.llama_seq == [128, 256]
    assert len(plan) == 5 + 5 + 5
    assert sum(r.estimate_s for r in plan) + suite.ENV_ESTIMATE_S < 240


def test_plan_interleaves_configs_in_a_rotated_order():
    args = suite.parse_args(["OUT", "--workloads", "gpt2", "--repeats", "3", "--train-configs", ",".join(suite.CONFIGS)])
    plan = suite.build_plan(args)
    by_repeat = [[r.config for r in plan if r.repeat == k] for k in range(3)]
    assert by_repeat[0] == list(suite.CONFIGS)
    assert by_repeat[1] == list(suite.CONFIGS[1:]) + [suite.CONFIGS[0]]
    assert by_repeat[2] == list(suite.CONFIGS[2:]) + list(suite.CONFIGS[:2])
    assert [r.id for r in plan] == list(range(1, 16))
    assert len({r.name for r in plan}) == 15


def test_steps_and_repeats_are_options_and_change_the_estimate():
    short = suite.parse_args(["OUT", "--workloads", "gpt2", "--gpt2-steps", "5", "--gpt2-warmup", "1"])
    long = suite.parse_args(["OUT", "--workloads", "gpt2", "--gpt2-steps", "40"])
    assert suite.estimate("gpt2", short) < suite.estimate("gpt2", long)
    assert len(suite.build_plan(suite.parse_args(["OUT", "--workloads", "gpt2", "--repeats", "5"]))) == 25


@pytest.mark.parametrize("argv, message", [
    (["OUT", "--train-configs", "native,bogus"], "unknown: bogus"),
    (["OUT", "--workloads", "gpt2,micro"], "unknown: micro"),
    (["OUT", "--workloads", ""], "comma-separated"),
    (["OUT", "--repeats", "0"], "at least 1"),
    (["OUT", "--gpt2-seq", "512", "256"], "above MAX"),
    (["OUT", "--gpt2-seq", "256", "2048"], "1024 tokens"),
    (["OUT", "--llama-seq", "512", "8192"], "4096 tokens"),
    (["OUT", "--llama-batch", "8", "1"], "above MAX"),
    (["OUT", "--first-repeat", "-1"], "0 or more"),
    (["OUT", "--goalloc-conf", "large_cache:512M,backend:vmm"], "no backend"),
    (["OUT", "--train-configs", "goalloc-vm"], "unknown: goalloc-vm"),
    (["OUT", "--budget", "0"], "positive"),
    ([], "outdir"),
])
def test_bad_arguments_are_usage_errors(argv: list[str], message: str):
    p = run_py(str(BENCH / "suite.py"), *argv)
    assert p.returncode == 2
    assert message in p.stderr


def test_child_environments():
    args = suite.parse_args(["OUT"])
    base = suite.child_env("native", args)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in base
    assert base["PYTHONPATH"].split(os.pathsep)[0] == str(REPO / "python")
    assert base["HF_HUB_OFFLINE"] == "1"
    assert suite.child_env("expandable", args)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert suite.child_env("async", args)["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert "GOALLOC_CONF" not in suite.child_env("goalloc", args)
    tuned = suite.parse_args(["OUT", "--goalloc-conf", "large_cache:512M"])
    assert suite.child_env("goalloc", tuned)["GOALLOC_CONF"] == "large_cache:512M"
    assert "GOALLOC_CONF" not in suite.child_env("native", tuned)
    assert suite.child_env("goalloc-vmm", tuned)["GOALLOC_CONF"] == "large_cache:512M"
    assert "GOALLOC_CONF" not in suite.child_env("goalloc-vmm", args)
    # workloads.py adds the backend to what the suite passes (goalloc.install(conf) replaces GOALLOC_CONF).
    assert workloads.goalloc_conf("", "goalloc-vmm") == "backend:vmm"
    assert workloads.goalloc_conf("large_cache:512M", "goalloc-vmm") == "large_cache:512M,backend:vmm"
    assert workloads.goalloc_conf("", "goalloc") == "backend:async"
    assert workloads.goalloc_conf("large_cache:512M,", "goalloc") == "large_cache:512M,backend:async"


def test_plan_has_llama_and_goalloc_vmm_and_the_issue_step_counts():
    args = suite.parse_args(["OUT"])
    assert args.train_configs == ["native", "expandable", "async", "goalloc", "goalloc-vmm"]
    assert (args.gpt2_warmup, args.gpt2_steps) == (5, 45)
    assert (args.llama_warmup, args.llama_steps) == (3, 27)
    assert (args.resnet_warmup, args.resnet_steps) == (5, 35)
    assert args.llama_batch == [1, 8] and args.llama_seq == [512, 3072]
    plan = suite.build_plan(args)
    llama = [r for r in plan if r.workload == "llama"]
    assert sorted({r.config for r in llama}) == sorted(args.train_configs) and len(llama) == 15
    assert all(r.estimate_s == pytest.approx(15 + 0.35 * 30) for r in llama)
    named = suite.parse_args(["OUT", "--workloads", "llama", "--train-configs", "goalloc-vmm"])
    assert {r.config for r in suite.build_plan(named)} == {"goalloc-vmm"}
    cmd = suite.workload_command(llama[0], args, Path("r.json"))
    assert cmd[cmd.index("--workload") + 1] == "llama"
    assert cmd[cmd.index("--steps") + 1:cmd.index("--steps") + 4] == ["27", "--warmup", "3"]
    assert cmd[cmd.index("--llama-batch") + 1:cmd.index("--llama-batch") + 3] == ["1", "8"]
    assert cmd[cmd.index("--llama-seq") + 1:cmd.index("--llama-seq") + 3] == ["512", "3072"]
    assert workloads.parse_args(cmd[2:]).llama_seq == [512, 3072]  # workloads.py takes what the suite passes


def test_first_repeat_shifts_repeats_rotation_and_shapes():
    base = suite.build_plan(suite.parse_args(["OUT", "--workloads", "llama", "--repeats", "2"]))
    later = suite.build_plan(suite.parse_args(["OUT", "--workloads", "llama", "--repeats", "2", "--first-repeat", "2"]))
    assert sorted({r.repeat for r in base}) == [0, 1] and sorted({r.repeat for r in later}) == [2, 3]
    # Repeat 2 of a later call starts where repeat 2 of one long call would.
    whole = suite.build_plan(suite.parse_args(["OUT", "--workloads", "llama", "--repeats", "4"]))
    assert [r.config for r in later] == [r.config for r in whole if r.repeat >= 2]
    assert not {(r.config, r.repeat) for r in base} & {(r.config, r.repeat) for r in later}
    cmd = suite.workload_command(later[0], suite.parse_args(["OUT"]), Path("r.json"))
    assert cmd[cmd.index("--repeat") + 1] == "2"
    limits = {"batch_min": 1, "batch_max": 8, "seq_min": 512, "seq_max": 3072}
    shapes = {r: workloads.train_shapes("llama", r, 30, limits) for r in range(4)}
    assert len({tuple(v) for v in shapes.values()}) == 4  # every repeat draws its own shapes
    assert shapes[2] == workloads.train_shapes("llama", 2, 30, limits)  # and the same for every config
    assert all(1 <= b <= 8 and 512 <= s <= 3072 and s % 64 == 0 for v in shapes.values() for b, s in v)
    # Not GPT-2's draws with other limits: each workload has a seed of its own.
    g = workloads.train_shapes("gpt2", 2, 30, limits)
    assert g != shapes[2]


def test_miss_latency_is_read_when_the_library_reports_it():
    stats = {"goalloc.device_alloc_ns.p50": 1200, "goalloc.device_alloc_ns.p99": 9000,
             "goalloc.device_alloc_ns.max": 31000, "goalloc.device_alloc_ns.count": 17, "num_device_alloc": 17}
    assert workloads.miss_latency(stats) == {"p50": 1200, "p99": 9000, "max": 31000, "count": 17}
    assert workloads.miss_latency({"num_device_alloc": 3}) is None  # an older library


def test_goalloc_vmm_figures_on_the_simulated_device():
    """goalloc-vmm's conf reaches the library, and its figures read the physical
    memory it holds (whole 2 MiB granules) and, where the library reports it,
    its miss latency; in a fresh interpreter (the library reads its conf once)."""
    from goalloc_testing import run_python

    code = f"""
        import importlib.util, json, goalloc
        from goalloc import _lib
        spec = importlib.util.spec_from_file_location("w", {str(BENCH / "workloads.py")!r})
        w = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(w)
        goalloc.configure(w.goalloc_conf("quiet:true", "goalloc-vmm"))  # what Allocator.setup gives install()
        a = w.Allocator(None, "goalloc-vmm")
        a.goalloc = goalloc                          # setup() without torch
        L = _lib.lib()
        malloc = getattr(L, "goalloc_malloc", None) or L.my_malloc
        p = malloc(5 << 19, 0, 0x1000)               # 2.5 MiB
        f = a.figures()
        print(json.dumps({{"conf": goalloc.config()["conf"], "pool": f["pool_reserved_max_read"],
                          "live": f["allocated_current"], "lat": f.get("device_alloc_ns"),
                          "reported": any(k.startswith("goalloc.device_alloc_ns.") for k in f["stats"]),
                          "allocs": f["stats"]["num_device_alloc"], "source": f["source"]}}))
    """
    out = json.loads(run_python(code).stdout)
    assert "backend:vmm" in out["conf"] and "quiet:true" in out["conf"]
    assert out["source"] == "goalloc.memory_stats"
    assert out["pool"] == 4 << 20 and out["live"] >= 5 << 19  # one 4 MiB handle (the default) for 2.5 MiB
    assert out["allocs"] >= 1
    if out["reported"]:
        assert out["lat"]["count"] >= 1 and out["lat"]["p50"] <= out["lat"]["p99"] <= out["lat"]["max"]
    else:
        assert out["lat"] is None


def test_nvidia_smi_is_asked_for_the_visible_gpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert suite.visible_gpu() == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " GPU-abc ,0")
    assert suite.visible_gpu() == "GPU-abc"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert suite.visible_gpu() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert suite.visible_gpu() is None


def test_workloads_help_and_shapes_need_no_torch():
    p = run_py(str(BENCH / "workloads.py"), "--help")
    assert p.returncode == 0 and "goalloc-vmm" in p.stdout and "--record-history" in p.stdout
    limits = {"batch_min": 4, "batch_max": 8, "seq_min": 256, "seq_max": 1024}
    a = workloads.train_shapes("gpt2", 1, 13, limits)
    assert a == workloads.train_shapes("gpt2", 1, 13, limits)  # the same for every config of a repeat
    assert a != workloads.train_shapes("gpt2", 2, 13, limits)
    assert all(4 <= b <= 8 and 256 <= s <= 1024 and s % 64 == 0 for b, s in a)


def test_workloads_records_a_failure_as_json(tmp_path: Path):
    """Without a GPU (and here maybe without torch) a run fails, and says why in its result file."""
    out = tmp_path / "r.json"
    p = run_py(str(BENCH / "workloads.py"), "--workload", "gpt2", "--config", "goalloc", "--out", str(out))
    assert p.returncode == 1
    res = json.loads(out.read_text())
    assert res["ok"] is False and res["workload"] == "gpt2" and res["config"] == "goalloc"
    assert res["error"] and "Traceback" in res["traceback"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (the CPU build will do)")
@pytest.mark.parametrize("workload, shape", [("gpt2", ["--gpt2-batch", "1", "2", "--gpt2-seq", "64", "128"]),
                                             pytest.param("llama", ["--llama-batch", "1", "2", "--llama-seq", "64", "128"],
                                                          marks=pytest.mark.skipif(
                                                              importlib.util.find_spec("transformers") is None,
                                                              reason="needs transformers")),
                                             ("resnet50", ["--resnet-batch", "2", "2", "--resnet-res", "32", "32"])]
                         + [pytest.param(w, shape, marks=pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                                                             and w != "moe", reason="needs transformers"))
                            for w, shape in NEW_WORKLOAD_CPU_SHAPES])
def test_training_code_runs_on_the_cpu(tmp_path: Path, workload: str, shape: list[str]):
    out = tmp_path / "r.json"
    p = run_py(str(BENCH / "workloads.py"), "--workload", workload, "--smoke-cpu", "--out", str(out),
               "--warmup", "1", "--steps", "1", *shape, timeout=600)
    res = json.loads(out.read_text())
    assert res["ok"], res.get("traceback") or p.stderr
    r = res["result"]
    assert r["losses_finite"] and r["units_per_s"] > 0 and len(r["step_log"]) == 2
    assert [e["loss"] is None for e in r["step_log"]] == [workload == "serving"] * 2
    # Every thread's CPU time over the timed steps, the training thread's marked.
    assert [t["main"] for t in r["threads"]].count(True) == 1 and all(t["cpu_ms"] >= 0 for t in r["threads"])


# --- issue 33's workloads: rollout, checkpoint, serving, moe ------------------------------

def default_limits(workload: str) -> dict[str, int]:
    """The workload's default shape ranges, as train_limits gives them to train_shapes."""
    return workloads.train_limits(workloads.parse_args(["--workload", workload, "--out", "R.json"]), workload)


def test_suite_lists_and_dispatches_the_new_workloads():
    args = suite.parse_args(["OUT", "--workloads", ",".join(NEW_WORKLOADS)])
    plan = suite.build_plan(args)
    assert [r.workload for r in plan if r.repeat == 0] == [w for w in NEW_WORKLOADS for _ in suite.CONFIGS]
    assert {(r.workload, r.config) for r in plan} == {(w, c) for w in NEW_WORKLOADS for c in suite.CONFIGS}
    assert len(plan) == 3 * 4 * 5
    # Not in the default suite: it stays the three training workloads BENCHMARKS.md quotes.
    assert {r.workload for r in suite.build_plan(suite.parse_args(["OUT"]))} == {"gpt2", "llama", "resnet50"}
    for w in NEW_WORKLOADS:
        run = next(r for r in plan if r.workload == w)
        cmd = suite.workload_command(run, args, Path("R.json"))
        wargs = workloads.parse_args(cmd[2:])  # workloads.py takes what the suite passes
        assert wargs.workload == w and wargs.config == run.config
        assert (wargs.steps, wargs.warmup) == suite.step_counts(w, args) and wargs.steps >= 4
        assert workloads.train_limits(wargs, w) == default_limits(w)
        assert w in workloads.BUILDERS and "--plan-shapes" not in cmd and "--record-history" not in cmd
        assert 15 <= suite.estimate(w, args) <= 160, (w, suite.estimate(w, args))  # runs of 15-110 s on an H200


def test_new_workloads_options_pass_through_and_quick_shrinks_them():
    args = suite.parse_args(["OUT", "--workloads", "serving", "--serving-steps", "7", "--serving-warmup", "0",
                             "--serving-batch", "2", "5", "--serving-new", "8", "16"])
    cmd = suite.workload_command(suite.build_plan(args)[0], args, Path("R.json"))
    wargs = workloads.parse_args(cmd[2:])
    assert (wargs.steps, wargs.warmup, wargs.serving_batch, wargs.serving_new) == (7, 0, [2, 5], [8, 16])
    quick = suite.parse_args(["OUT", "--quick", "--workloads", ",".join(NEW_WORKLOADS)])
    assert all(suite.step_counts(w, quick) == (2, 1) for w in NEW_WORKLOADS)
    assert quick.rollout_new == [16, 32] and quick.serving_prompt == [64, 128] and quick.moe_seq == [128, 256]
    assert suite.estimate("rollout", quick) < suite.estimate("rollout", suite.parse_args(["OUT"]))


@pytest.mark.parametrize("argv, message", [
    (["--serving-prompt", "64", "4000"], "serving's model holds 4096 tokens"),
    (["--rollout-prompt", "128", "4000"], "rollout's model holds 4096 tokens"),
    (["--checkpoint-seq", "512", "8192"], "checkpoint's model holds 4096 tokens"),
    (["--rollout-micro", "8", "2"], "above MAX"),
    (["--moe-batch", "0", "4"], "at least 1"),
    (["--workloads", "moe,sleep"], "unknown: sleep"),
])
def test_new_workloads_bad_arguments_are_usage_errors(argv: list[str], message: str):
    p = run_py(str(BENCH / "suite.py"), "OUT", *argv)
    assert p.returncode == 2 and message in p.stderr, p.stderr


@pytest.mark.parametrize("workload", NEW_WORKLOADS)
def test_new_workloads_draw_the_same_shapes_per_repeat_and_vary_them(workload: str):
    limits = default_limits(workload)
    shapes = workloads.train_shapes(workload, 3, 12, limits)
    assert shapes == workloads.train_shapes(workload, 3, 12, limits)  # every configuration of a repeat
    assert shapes != workloads.train_shapes(workload, 4, 12, limits)  # another repeat, other shapes
    assert len(set(shapes)) >= 6  # the shapes change from step to step
    assert workloads.planning_steps(shapes) == list(dict.fromkeys(shapes))  # hashable, as --plan-shapes needs
    json.dumps(shapes)  # they go to the step log


def test_rollout_iterations_train_every_row_they_generate():
    limits = default_limits("rollout")
    its = workloads.train_shapes("rollout", 0, 20, limits)
    for gens, micro in its:
        assert len(gens) == workloads.ROLLOUT_GENERATES
        for b, p, n in gens:
            assert 8 <= b <= 32 and 128 <= p <= 768 and p % 64 == 0 and 32 <= n <= 160 and (n - 32) % 16 == 0
        assert sum(micro) == sum(b for b, _, _ in gens)  # the micro-batches train each generated row once
        assert all(1 <= k <= 12 for k in micro) and all(k >= 2 for k in micro[:-1])  # the last takes what is left
    assert len({len(micro) for _, micro in its}) > 1 and len({m for _, micro in its for m in micro}) > 3


def test_serving_checkpoint_and_moe_shapes_keep_to_their_ranges():
    for b, p, n in workloads.train_shapes("serving", 1, 40, default_limits("serving")):
        assert 1 <= b <= 48 and 64 <= p <= 2048 and (p - 64) % 16 == 0 and 16 <= n <= 256
    for b, s in workloads.train_shapes("checkpoint", 1, 40, default_limits("checkpoint")):
        assert 1 <= b <= 8 and 512 <= s <= 4096 and s % 64 == 0
    moe = workloads.train_shapes("moe", 1, 40, default_limits("moe"))
    assert all(4 <= b <= 16 and 512 <= s <= 2048 and s % 64 == 0 for b, s, _ in moe)
    assert len({seed for _, _, seed in moe}) == 40  # every step's router gets its own bias
    # The workloads of one repeat draw apart from each other.
    assert [x[:2] for x in moe] != workloads.train_shapes("checkpoint", 1, 40, default_limits("moe"))


class FakeTorchMemory:
    """torch.cuda.memory's history calls, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def _record_memory_history(self, enabled: Any = "all", **kw: Any) -> None:
        self.calls.append(("record", enabled if enabled is None else kw.get("max_entries")))

    def _dump_snapshot(self, path: str) -> None:
        self.calls.append(("dump", path))


def test_recording_history_uses_goallocs_trace_or_torchs_snapshot(tmp_path: Path):
    torch = type("T", (), {})()
    torch.cuda = type("C", (), {})()
    torch.cuda.memory = FakeTorchMemory()
    out: dict[str, Any] = {}
    with workloads.recording_history(torch, None, str(tmp_path / "h"), out):
        assert torch.cuda.memory.calls == [("record", workloads.HISTORY_ENTRIES)]
    assert torch.cuda.memory.calls[1:] == [("dump", f"{tmp_path}/h.pickle"), ("record", None)]
    assert out["history"] == f"{tmp_path}/h.pickle"

    traced: list[tuple[str, int, str]] = []

    class FakeGoalloc:
        @staticmethod
        @contextlib.contextmanager
        def record_trace(path: str, max_entries: int, workload: str) -> Any:
            traced.append((path, max_entries, workload))
            yield

    alloc = workloads.Allocator(torch, "goalloc-vmm")
    alloc.goalloc = FakeGoalloc
    out = {}
    with workloads.recording_history(torch, alloc, str(tmp_path / "003-moe-goalloc-vmm-r0"), out):
        pass
    assert traced == [(f"{tmp_path}/003-moe-goalloc-vmm-r0.jsonl.gz", workloads.HISTORY_ENTRIES, "003-moe-goalloc-vmm-r0")]
    assert out["history"].endswith(".jsonl.gz") and len(torch.cuda.memory.calls) == 3  # torch's left alone
    out = {}
    with workloads.recording_history(torch, alloc, None, out):  # no --record-history: nothing recorded
        pass
    assert out == {} and len(traced) == 1


def test_recording_history_writes_goallocs_trace_on_the_simulated_device(tmp_path: Path):
    """The goalloc branch of --record-history with the library itself: a
    trace of what was allocated inside, named after the run, that the
    replay's format reads; in a fresh interpreter (device 0 is its own)."""
    from goalloc_testing import run_python

    stem = tmp_path / "007-moe-goalloc-vmm-r0"
    code = f"""
        import importlib.util, json, goalloc
        from goalloc_testing import Raw
        spec = importlib.util.spec_from_file_location("w", {str(BENCH / "workloads.py")!r})
        w = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(w)
        a = w.Allocator(None, "goalloc-vmm")
        a.goalloc = goalloc                          # setup() without torch
        raw, out = Raw(), {{}}
        with w.recording_history(None, a, {str(stem)!r}, out):
            ps = [raw.must_malloc(s, 0) for s in (1 << 20, 3 << 20, 512)]
            raw.free(ps[1], 3 << 20, 0)
        print(json.dumps(out))
    """
    out = json.loads(run_python(code).stdout.splitlines()[-1])
    assert out == {"history": f"{stem}.jsonl.gz"}
    import gzip

    lines = [json.loads(line) for line in gzip.open(f"{stem}.jsonl.gz", "rt")]
    assert lines[0]["workload"] == stem.name and lines[0]["allocator"] == "goalloc"
    allocs = sorted(e["size"] for e in lines[1:] if e["a"] == "alloc")
    assert allocs == [512, 1 << 20, 3 << 20] and [e["size"] for e in lines if e.get("a") == "free_requested"] == [3 << 20]


def test_device_memory_samples_in_a_thread_between_the_steps():
    """The sampler's thread sees a peak that no reading after a step sees."""
    used = iter([5, 5] + [5, 9, 9, 6] + [6] * 10_000)  # GiB in use by the driver's count, reading after reading

    class Cuda:
        @staticmethod
        def mem_get_info(_: int) -> tuple[int, int]:
            return (100 - next(used)) * GiB, 100 * GiB

    splits = []

    def split() -> dict[str, int]:  # what the allocator's counters say, asked at each new peak
        splits.append(len(splits))
        return {"held": 8 * GiB, "allocated": 7 * GiB}

    mem = workloads.DeviceMemory(type("T", (), {"cuda": Cuda})(), interval_ms=1.0, at_peak=split)
    assert mem.sample() == 5 * GiB  # after a step
    mem.start()
    time.sleep(0.2)
    mem.stop()
    assert not mem._thread.is_alive()
    f = mem.figures()
    assert f["baseline_used"] == 5 * GiB and f["peak_over_baseline"] == 4 * GiB and f["end_over_baseline"] == GiB
    assert splits == [0], "asked once: at the one reading that raised the peak"
    assert f["at_peak"] == {"used_over_baseline": 4 * GiB, "held": 8 * GiB, "allocated": 7 * GiB}
    off = workloads.DeviceMemory(type("T", (), {"cuda": Cuda})(), interval_ms=0)
    off.start()
    off.stop()  # sampling off: no thread to start or stop
    assert not off._thread.is_alive()


def test_record_history_reaches_every_run_and_not_the_cpu_smoke():
    args = suite.parse_args(["OUT", "--workloads", "moe", "--record-history"])
    for run in suite.build_plan(args):
        cmd = suite.workload_command(run, args, Path("R.json"))
        if run.config == "async":  # torch's cudaMallocAsync backend records no history
            assert "--record-history" not in cmd
            continue
        stem = cmd[cmd.index("--record-history") + 1]
        assert stem == str(Path("OUT").resolve() / "history" / run.name)
        assert workloads.parse_args(cmd[2:]).record_history == stem
    p = run_py(str(BENCH / "workloads.py"), "--workload", "moe", "--smoke-cpu", "--out", "R.json", "--record-history", "X")
    assert p.returncode == 2 and "not with --smoke-cpu" in p.stderr


def test_suite_runs_and_renders_the_new_workloads_over_a_stand_in(tmp_path: Path):
    proc, out = stub_suite(tmp_path, "--workloads", "moe,serving", "--repeats", "1", "--record-history")
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    doc = json.loads((out / "bench.json").read_text())
    assert sorted((r["workload"], r["config"]) for r in doc["runs"]) == sorted(
        (w, c) for w in ("moe", "serving") for c in suite.CONFIGS)
    assert all(r["status"] == "ok" and ("--record-history" in r["command"]) == (r["config"] != "async")
               for r in doc["runs"])
    assert (out / "history").is_dir()
    text = render.render(doc)
    assert "## 3f. Serving, LLaMA 672M (bf16)" in text and "## 3g. Training: Mixture of experts 1.1B" in text
    assert "## 3d. Training: RL-style rollout, LLaMA 582M" not in text  # not planned, not shown
    assert "- Mixture of experts 1.1B peak memory ≤ 1.03 × peak live: **met**" in text
    assert "moe 5 warm-up + 200 timed steps, batch 4–16, seq 512–2048" in text


# --- the whole suite, over stand-in programs --------------------------------------------

STUB_WORKLOADS = r'''
import argparse, json, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--workload"); p.add_argument("--config", default="native"); p.add_argument("--repeat", type=int, default=0)
p.add_argument("--out")
args, _ = p.parse_known_args()
res = {"workload": args.workload, "config": args.config, "repeat": args.repeat, "ok": True}
mode = os.environ.get("STUB_MODE", "")
if args.workload == "env":
    res["result"] = {"torch": "2.11.0+stub", "gpu": "Stub GPU", "python": "3.12"}
elif args.config == "async" and args.workload == "gpt2":
    res.update(ok=False, error="RuntimeError: stub failure")
    json.dump(res, open(args.out, "w")); sys.exit(1)
elif args.config == "goalloc" and args.workload == "resnet50":
    os.abort()                      # a crash: no result file at all
elif args.config == "expandable" and args.workload == "resnet50" and "hang" in mode:
    time.sleep(60)                  # a hang: the suite's timeout must stop it
else:
    res["result"] = {"unit": "tokens", "units_per_s": 1000.0 + args.repeat * 100, "median_step_s": 0.05,
                     "allocator": {"reserved_peak": 11 << 30, "allocated_peak": 10 << 30,
                                   "pool_reserved_max_read": 10 << 30},
                     "device": {"peak_over_baseline": 11 << 30}}
json.dump(res, open(args.out, "w"))
'''

def stub_suite(tmp_path: Path, *extra: str, mode: str = "") -> tuple[subprocess.Popen[str], Path]:
    stub = tmp_path / "stub_workloads.py"
    stub.write_text(STUB_WORKLOADS)
    out = tmp_path / "out"
    env = dict(os.environ, STUB_MODE=mode)
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "suite.py"), str(out), "--workloads-script", str(stub), "--repeats", "2", "--command", "bash bench/run.sh OUTDIR", *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def test_suite_records_every_run_and_goes_on_after_failures(tmp_path: Path):
    proc, out = stub_suite(tmp_path, "--timeout", "3", mode="hang")
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, log  # some runs failed
    doc = json.loads((out / "bench.json").read_text())
    assert doc["status"] == "complete" and doc["command"] == "bash bench/run.sh OUTDIR"
    assert doc["env"]["gpu"] == "Stub GPU"
    runs = {r["name"]: r for r in doc["runs"]}
    assert len(runs) == len(doc["plan"]) == 30
    status = {(r["workload"], r["config"]): r["status"] for r in doc["runs"]}
    assert status[("gpt2", "async")] == "failed"
    assert status[("resnet50", "expandable")] == "timeout"
    assert status[("gpt2", "goalloc")] == "ok"
    crashed = [r for r in doc["runs"] if r["config"] == "goalloc" and r["workload"] == "resnet50"]
    assert crashed and all(r["status"] == "failed" for r in crashed)
    assert all(r["reason"] == "exit status -6 (SIGABRT); no result file" for r in crashed), crashed[0]["reason"]
    failed = next(r for r in doc["runs"] if r["workload"] == "gpt2" and r["config"] == "async")
    assert failed["reason"] == "RuntimeError: stub failure"
    # One file per run as well, the same record.
    files = sorted(p.name for p in (out / "results").glob("0*.json"))
    assert len(files) == 31  # 30 runs and env
    one = json.loads((out / "results" / f"{failed['name']}.json").read_text())
    assert one["status"] == "failed"
    # And it renders, with the failures listed and the goals computed.
    text = render.render(doc)
    assert "gpt2-async-r" in text and "stub failure" in text
    assert "| goalloc-vmm | 1,050 (1,000–1,100, n=2) | 1.000× | 10.00 GiB | 1.000× |" in text


def test_suite_runs_a_later_call_with_its_own_repeats(tmp_path: Path):
    """--first-repeat: a second call (or a second GPU) runs repeats that the first did not."""
    proc, out = stub_suite(tmp_path, "--workloads", "llama", "--repeats", "1", "--first-repeat", "4")
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log
    doc = json.loads((out / "bench.json").read_text())
    assert doc["options"]["first_repeat"] == 4
    assert [(r["config"], r["repeat"], r["status"]) for r in doc["runs"]] == [
        (c, 4, "ok") for c in suite.rotated(list(suite.DEFAULT_TRAIN_CONFIGS), 4)]
    assert all(r["meta"]["repeat"] == 4 and r["name"].endswith("-r4") for r in doc["runs"])
    assert "cuda_visible_devices" in doc["host"]


def test_suite_skips_what_the_budget_cannot_hold(tmp_path: Path):
    proc, out = stub_suite(tmp_path, "--budget", "1", "--workloads", "gpt2")
    log, _ = proc.communicate(timeout=120)
    doc = json.loads((out / "bench.json").read_text())
    assert doc["status"] == "complete"
    assert {r["status"] for r in doc["runs"]} == {"skipped"}
    assert all(r["reason"].startswith("budget:") for r in doc["runs"])
    assert proc.returncode == 1
    render.render(doc)  # nothing measured still renders


def test_sigterm_keeps_what_finished(tmp_path: Path):
    proc, out = stub_suite(tmp_path, "--workloads", "resnet50", "--timeout", "60", mode="hang")
    bench = out / "bench.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # native is done: expandable, which hangs, has started
        if bench.exists() and json.loads(bench.read_text()).get("runs"):
            break
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 124, log
    doc = json.loads(bench.read_text())
    assert doc["status"] == "stopped (SIGTERM)" and doc["finished"]
    st = [(r["config"], r["status"]) for r in doc["runs"]]
    assert st[:2] == [("native", "ok"), ("expandable", "killed")]
    assert len(st) == 10 and all(s == "skipped" for _, s in st[2:])
    assert (out / "results" / f"{doc['runs'][0]['name']}.json").is_file()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_run_sh_leaves_four_files(tmp_path: Path):
    """The device tool brings back few files: run.sh packs the per-run files into one."""
    stub = tmp_path / "stub_workloads.py"
    stub.write_text(STUB_WORKLOADS)
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(BENCH / "run.sh"), str(out), "--repeats", "1", "--workloads", "gpt2",
                        "--train-configs", "native,async", "--workloads-script", str(stub)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 1, p.stdout + p.stderr  # gpt2 under async fails in the stub
    assert sorted(x.name for x in out.iterdir()) == ["BENCHMARKS.md", "bench.json", "console.log", "results.tar.gz"]
    names = subprocess.run(["tar", "-tzf", str(out / "results.tar.gz")], capture_output=True, text=True).stdout.split()
    assert "results/000-env.json" in names and len([n for n in names if n.endswith(".json")]) == 1 + 2
    doc = json.loads((out / "bench.json").read_text())
    assert doc["command"] == ("bash bench/run.sh OUTDIR --repeats 1 --workloads gpt2 --train-configs native,async "
                              f"--workloads-script {stub}")
    assert (out / "BENCHMARKS.md").read_text().startswith("# goalloc benchmarks")
    assert "# goalloc benchmarks" in p.stdout and "suite exit status 1" in (out / "console.log").read_text()


# --- aggregation and the renderer on known numbers ----------------------------------------


def fake_doc() -> dict[str, Any]:
    """A bench.json with known numbers: 3 repeats of everything, one failure."""
    runs: list[dict[str, Any]] = []
    plan: list[dict[str, Any]] = []

    def add(workload: str, config: str, repeat: int, result: Optional[dict[str, Any]], status: str = "ok") -> None:
        rec = {"id": len(runs) + 1, "name": f"{len(runs) + 1:03d}-{workload}-{config}-r{repeat}", "workload": workload,
               "config": config, "repeat": repeat, "status": status, "result": result}
        if status != "ok":
            rec["reason"] = "RuntimeError: boom"
        runs.append(rec)
        plan.append({k: rec[k] for k in ("id", "workload", "config", "repeat")})

    # GPT-2: goalloc 10.4 GiB pool over 10 GiB live (1.04), goalloc-vmm 10.2 GiB mapped (1.02: the
    # better one, and the goal met); goalloc-vmm at 0.975 x native speed (missed), goalloc 0.985.
    # goalloc-mempool: a configuration the suite has since dropped; its runs in an older file still render.
    speed = {"native": 1000.0, "expandable": 990.0, "async": 995.0, "goalloc": 985.0, "goalloc-vmm": 975.0,
             "goalloc-mempool": 1001.0}
    for r in range(3):
        for c, s in speed.items():
            alloc = {"reserved_peak": 12 * GiB, "allocated_peak": 10 * GiB, "requested_peak": int(9.9 * GiB)}
            if c == "goalloc":
                alloc.update(reserved_peak=int(10.2 * GiB), pool_reserved_max_read=int(10.4 * GiB))
            if c == "goalloc-vmm":
                alloc.update(reserved_peak=int(10.1 * GiB), pool_reserved_max_read=int(10.2 * GiB))
            add("gpt2", c, r, {"unit": "tokens", "units_per_s": s, "median_step_s": 1 / s,
                               "allocator": alloc, "device": {"peak_over_baseline": 13 * GiB}})
    add("gpt2", "async", 3, None, status="failed")
    return {"schema": 1, "command": "bash bench/run.sh OUTDIR", "started": "2026-01-01T00:00:00Z", "elapsed_s": 400,
            "budget_s": 480, "options": {"repeats": 3}, "env": {"gpu": "Stub GPU", "torch": "2.11.0"},
            "nvidia_smi": {"name": "NVIDIA H200", "driver_version": "580.0"}, "plan": plan, "runs": runs,
            "git_commit": "abc123"}


def test_aggregation_medians_and_ratios():
    doc = fake_doc()
    a = render.collect(render.runs_of(doc, "gpt2", "goalloc-vmm"), lambda r: r["units_per_s"])
    assert a.values == [975.0] * 3 and a.median == 975.0 and (a.lo, a.hi, a.n) == (975.0, 975.0, 3)
    a = render.Agg([3.0, 2.8, 3.4])
    assert a.median == 3.0 and (a.lo, a.hi, a.n) == (2.8, 3.4, 3)
    assert render.Agg([1.0, 4.0]).median == 2.5 and render.Agg([]).median is None
    assert render.ratio(3.6, 3.4) == pytest.approx(1.0588, abs=1e-4)
    assert render.ratio(None, 1.0) is None and render.ratio(1.0, 0) is None
    # A run without a result (failed) is not counted; NaN and booleans are not numbers.
    assert render.train_aggs(doc, "gpt2", "async")["speed"].n == 3
    assert render.number(float("nan")) is None and render.number(True) is None
    assert render.memory_of_record("goalloc", {"allocator": {"pool_reserved_max_read": 5, "reserved_peak": 4}}) == 5
    assert render.memory_of_record("native", {"allocator": {"pool_reserved_max_read": 5, "reserved_peak": 4}}) == 4


def test_library_build_read_from_the_library(tmp_path):
    # Go stamps a library built in a git checkout (make lib: -buildvcs=auto) with its commit; the
    # suite records it beside the repository's, which a carried library may not match.
    lib = tmp_path / "libgoalloc.so"
    lib.write_bytes(b"\x7fELF..." + b"build\tvcs=git\nbuild\tvcs.revision=0123abcd\nbuild\tvcs.modified=true\n" + b"\0" * 64)
    assert suite.library_build(str(lib)) == {"path": str(lib), "revision": "0123abcd", "modified": "true"}
    lib.write_bytes(b"\x7fELF no stamp")
    assert "no vcs.revision" in suite.library_build(str(lib))["error"]
    assert "FileNotFoundError" in suite.library_build(str(tmp_path / "missing.so"))["error"]


def test_render_says_when_the_library_is_not_the_repositorys_commit():
    doc = fake_doc()
    doc["goalloc_library"] = {"path": "build/libgoalloc.so", "revision": "abc123", "modified": "false"}
    assert "library built" not in render.render(doc)  # the same commit: nothing to say
    doc["goalloc_library"] = {"path": "build/libgoalloc.so", "revision": "fedcba9876543210", "modified": "false"}
    assert "repository commit abc123; goalloc's library built at fedcba987654" in render.render(doc)
    doc["goalloc_library"] = {"path": "build/libgoalloc.so", "revision": "abc123", "modified": "true"}
    assert "goalloc's library built at abc123 with changes not committed" in render.render(doc)


def test_render_tables_and_goals():
    doc = fake_doc()
    text = render.render(doc)
    for heading in ("## 3a. Training: GPT-2 124M", "## Goals"):
        assert heading in text
    assert "Training: ResNet-50" not in text  # not planned, not shown
    assert "NVIDIA H200; driver 580.0" in text and "`bash bench/run.sh OUTDIR`" in text
    assert "repository commit abc123" in text
    # GPT-2 goalloc: 985 tokens/s, 0.985x native; 10.40 GiB, 1.040x live, 0.867x native's 12 GiB.
    assert "| goalloc | 985 (985–985, n=3) | 0.985× | 10.40 GiB | 1.040× | 0.867× | 13.00 GiB | 10.00 GiB |" in text
    assert "| goalloc-vmm | 975 (975–975, n=3) | 0.975× | 10.20 GiB | 1.020× | 0.850× |" in text
    assert "physical memory mapped, high-water mark" in text
    _, goals = render.goals(doc)
    by = {g["goal"]: g for g in goals}
    live = by["GPT-2 124M peak memory ≤ 1.03 × peak live"]
    assert live["met"] is True
    assert live["text"].startswith("goalloc-vmm (the better goalloc configuration) 10.20 GiB over peak live 10.00 GiB = "
                                   "1.020×; goalloc 10.40 GiB, 1.040×")
    for other in ("native", "expandable", "async", "goalloc-mempool"):  # the lowest of every configuration
        assert by[f"GPT-2 124M peak memory below {other}"]["met"] is True
    assert "GPT-2 124M peak memory below goalloc" not in by
    assert by["GPT-2 124M goalloc (backend:async) peak memory ≤ async"]["met"] is True
    thr = by["GPT-2 124M throughput ≥ 0.98 × native"]
    assert thr["met"] is False and "goalloc-vmm 975 vs native 1,000 tokens/s = 0.975×" in thr["text"]
    assert "0.5 points under the goal" in thr["text"] and "; goalloc 0.985×" in thr["text"]
    assert "RuntimeError: boom" in text  # the failed run is listed
    assert ("  - where goalloc-vmm's goes (its own counters; differences of peaks): mapped physical memory over "
            "goalloc's own reserved peak 102.4 MiB;") in text
    # No miss-latency figures in these runs (an older library): the table says so.
    assert "Cache-miss latency: not reported" in text


def test_render_per_repeat_ratios():
    doc = fake_doc()
    for r in doc["runs"]:
        if r["config"] == "goalloc-vmm" and r["repeat"] == 1:
            r["result"]["allocator"]["allocated_peak"] = 5 * GiB  # repeat 1 drew other shapes
    text = render.render(doc)
    assert "Peak device memory ÷ peak live, by repeat" in text
    assert "| config | repeat 0 | repeat 1 | repeat 2 |" in text
    assert "| goalloc-vmm | 1.0200 | 2.0400 | 1.0200 |" in text  # pool_reserved_max_read over allocated_peak
    assert "| native | 1.2000 | 1.2000 | 1.2000 |" in text  # max reserved over allocated_peak
    doc["runs"] = [r for r in doc["runs"] if r["repeat"] == 0]
    assert "by repeat" not in render.render(doc)  # one repeat: the medians say it all


LLAMA_CONFIGS = ("native", "expandable", "async", "goalloc", "goalloc-vmm")


def suite_doc(gpu: str, first: int, repeats: int, workloads: list[str], bogus: bool = False) -> dict[str, Any]:
    """A bench.json of training runs on one GPU, repeats first..first+repeats-1.

    LLaMA: 40 GiB live; native 48, expandable 42, async 44, goalloc 43, goalloc-vmm 41 GiB (1.025x live,
    the lowest); goalloc-vmm at 0.99x native's 20000 tokens/s; miss latency reported for the goalloc
    configurations. ResNet-50 (no miss-latency keys: an older library): 10 GiB live, goalloc 10.6,
    goalloc-vmm 10.4 GiB. bogus: every run's speed is 1 (a run a later file must replace).
    """
    mem = {"llama": {"native": 48, "expandable": 42, "async": 44, "goalloc": 43, "goalloc-vmm": 41},
           "resnet50": {"native": 12, "expandable": 11, "async": 11.5, "goalloc": 10.6, "goalloc-vmm": 10.4}}
    live = {"llama": 40, "resnet50": 10}
    speed = {"llama": {"native": 20000.0, "goalloc-vmm": 19800.0}, "resnet50": {"native": 2000.0}}
    runs, plan = [], []
    for r in range(first, first + repeats):
        for w in workloads:
            for c in LLAMA_CONFIGS:
                alloc: dict[str, Any] = {"reserved_peak": int(mem[w][c] * GiB), "allocated_peak": live[w] * GiB}
                if c in ("goalloc", "goalloc-vmm"):
                    alloc.update(pool_reserved_max_read=int(mem[w][c] * GiB), reserved_peak=live[w] * GiB)
                    if w == "llama":
                        alloc["device_alloc_ns"] = ({"p50": 12000 + 1000 * r, "p99": 80000, "max": 200000, "count": 40}
                                                    if c == "goalloc-vmm" else
                                                    {"p50": 3000, "p99": 9000, "max": 15000, "count": 25})
                ups = 1.0 if bogus else speed[w].get(c, speed[w]["native"])
                rec = {"id": len(runs) + 1, "name": f"{len(runs) + 1:03d}-{w}-{c}-r{r}", "workload": w, "config": c,
                       "repeat": r, "status": "ok", "result": {"unit": "tokens", "units_per_s": ups,
                                                               "median_step_s": 0.5, "allocator": alloc,
                                                               "device": {"peak_over_baseline": 50 * GiB}}}
                runs.append(rec)
                plan.append({k: rec[k] for k in ("id", "workload", "config", "repeat")})
    return {"schema": 1, "command": f"bash bench/run.sh OUT{gpu} --workloads {','.join(workloads)}",
            "started": "2026-01-01T00:00:00Z", "elapsed_s": 450, "budget_s": 480,
            "host": {"cuda_visible_devices": gpu},
            "options": {"repeats": repeats, "first_repeat": first, "workloads": workloads, "llama_warmup": 3,
                        "llama_steps": 27, "llama_batch": [1, 8], "llama_seq": [512, 3072], "resnet_warmup": 5,
                        "resnet_steps": 35, "resnet_batch": [32, 64], "resnet_res": [160, 224]},
            "env": {"gpu": "NVIDIA H200", "torch": "2.11.0"}, "nvidia_smi": {"name": "NVIDIA H200", "driver_version": "580.0"},
            "plan": plan, "runs": runs}


def test_variants_run_beside_goalloc_vmm():
    """--variant LABEL=CONF adds goalloc-vmm.LABEL: planned and rotated with
    the others, run with CONF added to GOALLOC_CONF and backend:vmm; bad
    labels, a backend and a label given twice are refused."""
    args = suite.parse_args(["OUT", "--workloads", "serving", "--train-configs", "native,goalloc-vmm",
                             "--goalloc-conf", "large_cache:0", "--variant", "h2=vmm_handle:2M",
                             "--variant", "h4=vmm_handle:4M", "--repeats", "3"])
    configs = ["native", "goalloc-vmm", "goalloc-vmm.h2", "goalloc-vmm.h4"]
    assert args.train_configs == configs
    plan = suite.build_plan(args)
    assert sorted(r.config for r in plan) == sorted(configs * 3)
    assert len({tuple(r.config for r in plan if r.repeat == k) for k in range(3)}) == 3, "rotated by the repeat"
    assert suite.child_env("goalloc-vmm.h2", args)["GOALLOC_CONF"] == "large_cache:0,vmm_handle:2M"
    assert suite.child_env("goalloc-vmm", args)["GOALLOC_CONF"] == "large_cache:0"
    assert workloads.goalloc_conf("vmm_handle:4M", "goalloc-vmm.h4") == "vmm_handle:4M,backend:vmm"
    assert workloads.is_goalloc("goalloc-vmm.h4") and workloads.base_config("goalloc-vmm.h4") == "goalloc-vmm"
    assert workloads.parse_args(["--workload", "serving", "--config", "goalloc-vmm.h4", "--out", "x"]).config == \
        "goalloc-vmm.h4"
    for bad in ("goalloc.h4", "native.x", "goalloc-vmm.", "goalloc-vmm.H4"):
        with pytest.raises(SystemExit):
            workloads.parse_args(["--workload", "serving", "--config", bad, "--out", "x"])
    for bad in (["--variant", "Big=vmm_handle:4M"], ["--variant", "x"], ["--variant", "x=backend:async"],
                ["--variant", "x=vmm_handle:4M", "--variant", "x=vmm_handle:2M"]):
        with pytest.raises(SystemExit):
            suite.parse_args(["OUT", *bad])


def test_render_shows_a_variant_as_goallocs_own_row():
    """A variant's row reads goalloc's figures (the physical memory mapped),
    the options name what it adds, and the goals compare it with nobody."""
    doc = suite_doc("0", 0, 1, ["llama"])
    vmm = next(r for r in doc["runs"] if r["config"] == "goalloc-vmm")
    variant = json.loads(json.dumps(vmm)) | {"config": "goalloc-vmm.h2", "id": 99, "name": "099-llama-goalloc-vmm.h2-r0"}
    variant["result"]["allocator"]["pool_reserved_max_read"] = 42 * GiB
    doc["runs"].append(variant)
    doc["plan"].append({k: variant[k] for k in ("id", "workload", "config", "repeat")})
    doc["options"]["variants"] = {"goalloc-vmm.h2": "vmm_handle:2M"}
    text = render.render(doc)
    row = next(line for line in text.splitlines() if line.startswith("| goalloc-vmm.h2 |"))
    assert "42.00 GiB" in row and "physical memory mapped" in row, row
    assert "goalloc-vmm.h2 adds `vmm_handle:2M`" in text
    assert "below goalloc-vmm.h2" not in text
    assert "goalloc-vmm (the better goalloc configuration)" in text


def test_render_merges_suites_and_computes_the_issue_goals():
    a = suite_doc("0", 0, 2, ["llama"])
    a["runs"] = [r for r in a["runs"] if r["repeat"] == 0] + suite_doc("0", 1, 1, ["llama"], bogus=True)["runs"]
    b = suite_doc("1", 1, 2, ["llama", "resnet50"])
    said: list[str] = []
    doc = render.merge([a, b], ["A/bench.json", "B/bench.json"], warn=said.append)
    # Repeat 1 of LLaMA is in both: B's is kept, and each replacement is said.
    assert len(said) == 5 and all("keeping B/bench.json's" in w for w in said)
    assert said[0] == ("render: run 001-llama-native-r1 is in A/bench.json (ok) and in B/bench.json (ok): "
                       "keeping B/bench.json's")
    assert doc["replaced"] == 5
    native = render.train_aggs(doc, "llama", "native")["speed"]
    assert native.n == 3 and native.lo == native.hi == 20000.0  # no bogus run of A's left
    assert sorted((r["workload"], r["repeat"]) for r in doc["runs"]).count(("llama", 1)) == 5
    assert len(doc["runs"]) == 5 * 3 + 5 * 2

    text = render.render(doc)
    assert "`bench.json` files (2, merged)" in text
    assert "Input 1: `A/bench.json`" in text and "Input 2: `B/bench.json`" in text
    assert "CUDA_VISIBLE_DEVICES=0" in text and "CUDA_VISIBLE_DEVICES=1" in text
    assert "- options: workloads llama,resnet50; repeats 2 (repeats 1–2); llama 3 warm-up + 27 timed steps, batch " \
           "1–8, seq 512–3072; resnet50 5 warm-up + 35 timed steps" in text
    assert "5 run(s) of an earlier input replaced by a later one's" in text
    assert "## 3b. Training: LLaMA 672M (GQA)" in text and "## 3c. Training: ResNet-50" in text
    assert "`transformers.LlamaForCausalLM`, 12 layers" in text
    assert "| goalloc-vmm | 19,800 (19,800–19,800, n=3) | 0.990× | 41.00 GiB | 1.025× | 0.854× |" in text
    # The miss-latency table: medians over the three repeats, in microseconds.
    assert "| config | misses | p50 µs | p99 µs | max µs |" in text
    assert "| goalloc-vmm | 40 (40–40, n=3) | 13.0 | 80.0 | 200.0 |" in text
    assert "| goalloc | 25 (25–25, n=3) | 3.0 | 9.0 | 15.0 |" in text
    assert text.count("Cache-miss latency: not reported") == 1  # ResNet-50's runs have none

    _, goals = render.goals(doc)
    by = {g["goal"]: g for g in goals}
    assert by["LLaMA 672M (GQA) peak memory ≤ 1.03 × peak live"]["met"] is True
    assert "goalloc-vmm (the better goalloc configuration) 41.00 GiB" in \
        by["LLaMA 672M (GQA) peak memory ≤ 1.03 × peak live"]["text"]
    for other in ("native", "expandable", "async"):
        assert by[f"LLaMA 672M (GQA) peak memory below {other}"]["met"] is True
    assert by["LLaMA 672M (GQA) goalloc (backend:async) peak memory ≤ async"]["met"] is True
    thr = by["LLaMA 672M (GQA) throughput ≥ 0.98 × native"]
    assert thr["met"] is True and "= 0.990×" in thr["text"]
    # ResNet-50's goal is 1.05: goalloc-vmm's 1.04 meets it, goalloc's 1.06 would not.
    rn = by["ResNet-50 peak memory ≤ 1.05 × peak live"]
    assert rn["met"] is True and "goalloc 10.60 GiB, 1.060×" in rn["text"]
    assert by["ResNet-50 goalloc (backend:async) peak memory ≤ async"]["met"] is True
    assert not any(g.startswith("GPT-2") for g in by)  # not planned in either input

    # goalloc above async on a workload, and over the live goal: both missed, by how much.
    for r in b["runs"]:
        if r["workload"] == "llama" and r["config"] in ("goalloc", "goalloc-vmm"):
            r["result"]["allocator"]["pool_reserved_max_read"] = int(45 * GiB)
    _, goals = render.goals(render.merge([b], ["B/bench.json"]))
    by = {g["goal"]: g for g in goals}
    assert by["LLaMA 672M (GQA) goalloc (backend:async) peak memory ≤ async"]["met"] is False
    live = by["LLaMA 672M (GQA) peak memory ≤ 1.03 × peak live"]
    assert live["met"] is False and "1.125×, +9.2% over the goal" in live["text"]
    assert by["LLaMA 672M (GQA) peak memory below expandable"]["met"] is False


def test_render_command_line_merges_files(tmp_path: Path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(suite_doc("0", 0, 2, ["llama"])))
    b.write_text(json.dumps(suite_doc("1", 1, 2, ["resnet50", "llama"])))
    out = tmp_path / "B.md"
    p = run_py(str(BENCH / "render.py"), str(a), str(b), "--output", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("keeping") == 5 and f"{b}'s" in p.stderr
    text = out.read_text()
    assert f"Input 1: `{a}`" in text and f"Input 2: `{b}`" in text and "## 3b. Training: LLaMA" in text
    p = run_py(str(BENCH / "render.py"), str(a), str(tmp_path / "missing.json"))
    assert p.returncode == 1 and "cannot read" in p.stderr


def test_render_counts_the_runs_of_every_input(tmp_path: Path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(suite_doc("0", 0, 3, ["llama"])))
    b.write_text(json.dumps(suite_doc("1", 3, 3, ["llama"])))
    out = tmp_path / "B.md"
    p = run_py(str(BENCH / "render.py"), str(a), str(b), "--output", str(out))
    assert p.returncode == 0, p.stderr
    row = next(ln for ln in out.read_text().splitlines() if ln.startswith("| goalloc | ") and "GiB" in ln)
    assert "n=6" in row, row  # both files' goalloc runs count


def test_render_prefers_the_default_backend_on_a_memory_tie():
    doc = suite_doc("0", 0, 3, ["resnet50"])
    for r in doc["runs"]:
        if r["config"] == "goalloc":
            r["result"]["allocator"]["pool_reserved_max_read"] = int(10.4 * GiB)  # goalloc-vmm's
    best, _ = render.best_goalloc(doc, "resnet50")
    assert best == "goalloc-vmm"
    for r in doc["runs"]:
        if r["config"] == "goalloc":
            r["result"]["allocator"]["pool_reserved_max_read"] = int(10.3 * GiB)
    assert render.best_goalloc(doc, "resnet50")[0] == "goalloc"
    # Compared over the repeats both ran: goalloc-vmm's extra repeats 3-6, of
    # larger shapes (20 GiB, its median over all seven), must not make
    # goalloc look lower.
    doc = suite_doc("0", 0, 3, ["resnet50"])
    extra = suite_doc("0", 3, 4, ["resnet50"])["runs"]
    for r in extra:
        r["result"]["allocator"]["pool_reserved_max_read"] = 20 * GiB
    doc["runs"] += [r for r in extra if r["config"] == "goalloc-vmm"]
    assert render.best_goalloc(doc, "resnet50")[0] == "goalloc-vmm"  # 10.4 vs 10.6 GiB on repeats 0-2


def test_render_command_line_writes_a_file(tmp_path: Path):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(fake_doc()))
    out = tmp_path / "B.md"
    p = run_py(str(BENCH / "render.py"), str(src), "--output", str(out))
    assert p.returncode == 0, p.stderr
    first = out.read_text()
    assert first.startswith("# goalloc benchmarks")
    p = run_py(str(BENCH / "render.py"), str(src), "--output", str(out))
    assert out.read_text() == first  # replaced, not appended
    p = run_py(str(BENCH / "render.py"), str(tmp_path / "missing.json"))
    assert p.returncode == 1 and "cannot read" in p.stderr


def test_breakdown_prefers_goallocs_own_reserved_key():
    """With backend:vmm the library reports the physical memory as
    reserved_bytes.all; the breakdown then takes goalloc's own reserved peak
    from goalloc.own_reserved_bytes.peak."""
    doc = fake_doc()
    for run in doc["runs"]:
        if run.get("workload") == "gpt2" and run.get("config") == "goalloc-vmm" and run.get("status") == "ok":
            al = run["result"]["allocator"]
            own = al["reserved_peak"] - (50 << 20)
            al["reserved_peak"] = al["pool_reserved_max_read"]  # reserved is the physical figure now
            al.setdefault("stats", {})["goalloc.own_reserved_bytes.peak"] = own
    text = render.render(doc)
    assert ("  - where goalloc-vmm's goes (its own counters; differences of peaks): mapped physical memory over "
            "goalloc's own reserved peak 152.4 MiB;") in text


def test_memory_goals_compare_the_repeats_both_ran():
    """Each repeat's shapes set its peak: when a configuration lacks a repeat
    (skipped for the budget), the memory goals compare medians over the
    repeats both configurations ran, and say so."""
    doc = suite_doc("0", 0, 3, ["llama"])
    peaks = {"goalloc-vmm": [44, 39, 46], "expandable": [46, 41, 48], "goalloc": [50, 50, 50]}
    for r in doc["runs"]:
        if r["config"] in peaks:
            r["result"]["allocator"]["pool_reserved_max_read"] = peaks[r["config"]][r["repeat"]] << 30
            r["result"]["allocator"]["reserved_peak"] = peaks[r["config"]][r["repeat"]] << 30
    _, goals = render.goals(doc)
    below = {g["goal"]: g for g in goals}["LLaMA 672M (GQA) peak memory below expandable"]
    assert below["met"] is True and "44.00 GiB vs expandable 46.00 GiB: 0.957×" in below["text"], below["text"]
    assert "repeat(s) both ran" not in below["text"]
    # Without expandable's largest repeat, the medians of all runs would say
    # 44 against 43.5 (missed); over the repeats both ran it is 41.5 against 43.5.
    doc["runs"] = [r for r in doc["runs"] if not (r["config"] == "expandable" and r["repeat"] == 2)]
    _, goals = render.goals(doc)
    below = {g["goal"]: g for g in goals}["LLaMA 672M (GQA) peak memory below expandable"]
    assert below["met"] is True, below["text"]
    assert "41.50 GiB vs expandable 43.50 GiB (over the 2 repeat(s) both ran, 0, 1: goalloc-vmm ran 3, expandable 2)" \
        in below["text"], below["text"]
    # The driver's count is compared over the same repeats.
    for r in doc["runs"]:
        if r["config"] in peaks:
            r["result"]["device"]["peak_over_baseline"] = (peaks[r["config"]][r["repeat"]] + 1) << 30
    _, goals = render.goals(doc)
    below = {g["goal"]: g for g in goals}["LLaMA 672M (GQA) peak memory below expandable"]
    assert f"by the driver's count (device peak over idle), {42.5 / 44.5:.3f}×" in below["text"], below["text"]


def test_throughput_goal_gives_the_ratios_repeat_by_repeat():
    """Each repeat draws its own shapes, the same for every configuration:
    the throughput goal also says the ratio on the same shapes, repeat by
    repeat, and their median."""
    doc = suite_doc("0", 0, 3, ["llama"])
    for r in doc["runs"]:
        if r["config"] == "native":
            r["result"]["units_per_s"] = [20000.0, 40000.0, 10000.0][r["repeat"]]
        elif r["config"] == "goalloc-vmm":
            r["result"]["units_per_s"] = [18000.0, 42000.0, 9500.0][r["repeat"]]
    assert [round(x, 3) for x in render.paired_speed_ratios(doc, "llama", "goalloc-vmm")] == [0.9, 1.05, 0.95]
    _, goals = render.goals(doc)
    thr = {g["goal"]: g for g in goals}["LLaMA 672M (GQA) throughput ≥ 0.98 × native"]
    assert thr["met"] is False and "= 0.900×" in thr["text"]  # the verdict: medians 18,000 / 20,000
    assert "per repeat, on the same shapes, 0.900, 1.050, 0.950× (median 0.950×)" in thr["text"]
    doc["runs"] = [r for r in doc["runs"] if not (r["config"] == "native" and r["repeat"] == 1)]
    assert [round(x, 3) for x in render.paired_speed_ratios(doc, "llama", "goalloc-vmm")] == [0.9, 0.95], \
        "a repeat without native's run is left out"


def test_resnet_plan_shapes_puts_every_shape_first_untimed():
    # The steps of planning: every distinct shape once, in order of first use.
    shapes = [(32, 160), (40, 176), (32, 160), (64, 224), (40, 176)]
    assert workloads.planning_steps(shapes) == [(32, 160), (40, 176), (64, 224)]
    plain = suite.parse_args(["OUT", "--workloads", "resnet50"])
    planned = suite.parse_args(["OUT", "--workloads", "resnet50", "--resnet-plan-shapes"])
    assert suite.estimate("resnet50", planned) > suite.estimate("resnet50", plain)
    run = next(r for r in suite.build_plan(planned) if r.workload == "resnet50")
    assert "--plan-shapes" in suite.workload_command(run, planned, Path("R.json"))
    assert "--plan-shapes" not in suite.workload_command(run, plain, Path("R.json"))
    args = workloads.parse_args(["--workload", "resnet50", "--out", "R.json", "--plan-shapes"])
    assert args.plan_shapes and not workloads.parse_args(["--workload", "resnet50", "--out", "R.json"]).plan_shapes


def test_driver_totals_sum_goallocs_driver_profile():
    stats = {"goalloc.driver.cuMemCreate.count": 3, "goalloc.driver.cuMemCreate.ns": 30_000,
             "goalloc.driver.cuMemUnmap.count": 2, "goalloc.driver.cuMemUnmap.ns": 80_000,
             "goalloc.driver.cuEventRecord.count": 5, "goalloc.driver.cuEventRecord.ns": 9_000,
             "allocated_bytes.all.current": 1 << 30, "goalloc.cache_misses": 7}
    assert workloads.driver_totals(stats) == {"calls": 10, "ns": 119_000, "unmaps": 2, "creates": 3}
    assert workloads.driver_totals({"num_device_alloc": 4}) == {"calls": 0, "ns": 0, "unmaps": 0, "creates": 0}


def test_miss_table_gives_the_driver_time_of_the_timed_steps():
    """With goalloc's driver totals logged after every step, the miss table
    adds what the timed steps alone spent in the driver, and how many
    handles they unmapped; without them (older runs) it has no such columns."""
    doc = suite_doc("0", 0, 3, ["llama"])
    text = render.render(doc)
    assert "driver ms, timed steps" not in text
    for r in doc["runs"]:
        if r["config"] == "goalloc-vmm":
            totals = [(5_000_000, 2), (9_000_000, 4), (9_500_000, 4), (12_500_000, 7)]
            r["result"]["step_log"] = [
                {"timed": i >= 2, "seconds": 0.1, "goalloc_driver": {"ns": ns, "calls": 1, "unmaps": u, "creates": 0}}
                for i, (ns, u) in enumerate(totals)]
    assert render.timed_driver(next(r["result"] for r in doc["runs"] if r["config"] == "goalloc-vmm"), "ns") == 3_500_000
    text = render.render(doc)
    assert "| driver ms, timed steps | unmaps, timed steps |" in text
    rows = [line.rstrip() for line in text.splitlines() if line.startswith(("| goalloc-vmm |", "| goalloc |"))]
    assert any(r.startswith("| goalloc-vmm |") and r.endswith("| 3.5 | 3 |") for r in rows), rows
    assert any(r.startswith("| goalloc |") and r.endswith("| — | — |") for r in rows), rows


def test_driver_totals_read_the_librarys_own_keys(raw, device):
    """The names driver_totals looks for are the ones goalloc's memory_stats
    gives: a miss that maps memory on the VMM backend (the default) shows up
    as creates, calls and time."""
    import goalloc

    before = workloads.driver_totals(goalloc.memory_stats(device))
    p = raw.must_malloc(64 << 20, device)
    after = workloads.driver_totals(goalloc.memory_stats(device))
    raw.free(p, 64 << 20, device)
    assert after["creates"] > before["creates"], after
    assert after["calls"] - before["calls"] >= after["creates"] - before["creates"] and after["ns"] > before["ns"], after


def test_thread_times_say_which_thread_spent_the_cpu(tmp_path: Path):
    import threading

    stop = threading.Event()

    def spin() -> None:
        deadline = time.thread_time() + 0.08
        while time.thread_time() < deadline:
            pass
        stop.wait()

    before = workloads.thread_times()
    t = threading.Thread(target=spin)
    t.start()
    deadline = time.thread_time() + 0.03
    while time.thread_time() < deadline:
        pass
    time.sleep(0.2)  # the other thread's 80 ms
    rows = workloads.thread_delta(before, workloads.thread_times(), threading.get_native_id())
    stop.set()
    t.join()
    mine = next(r for r in rows if r["main"])
    other = next(r for r in rows if r["tid"] == t.native_id)
    assert mine["cpu_ms"] >= 25 and other["cpu_ms"] >= 70, rows
    assert rows[0]["cpu_ms"] >= rows[-1]["cpu_ms"] and not other["main"], rows
    # A name with spaces and parentheses, and the clock ticks where schedstat says 0.
    task = tmp_path / "task" / "42"
    task.mkdir(parents=True)
    stat = "42 (a (b) c) S " + " ".join(["0"] * 10) + " 7 3 " + " ".join(["0"] * 30)
    (task / "stat").write_text(stat)
    (task / "schedstat").write_text("0 0 0\n")
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    assert workloads.thread_times(str(tmp_path / "task")) == {42: ("a (b) c", 10 * tick_ms)}
    (task / "schedstat").write_text("5000000 1 2\n")
    assert workloads.thread_times(str(tmp_path / "task")) == {42: ("a (b) c", 5.0)}
    (task / "schedstat").unlink()  # a kernel without schedstat
    assert workloads.thread_times(str(tmp_path / "task")) == {42: ("a (b) c", 10 * tick_ms)}


def test_llama_plan_shapes_passes_plan_shapes_to_llama_runs_only():
    plain = suite.parse_args(["OUT", "--workloads", "llama,resnet50"])
    planned = suite.parse_args(["OUT", "--workloads", "llama,resnet50", "--llama-plan-shapes"])
    assert suite.estimate("llama", planned) > suite.estimate("llama", plain)
    assert suite.estimate("resnet50", planned) == suite.estimate("resnet50", plain)
    for run in suite.build_plan(planned):
        cmd = suite.workload_command(run, planned, Path("R.json"))
        assert ("--plan-shapes" in cmd) == (run.workload == "llama"), run.name
    assert all("--plan-shapes" not in suite.workload_command(r, plain, Path("R.json")) for r in suite.build_plan(plain))


def test_cold_ab_reads_the_benchmark_and_reports_medians(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("cold_ab", REPO / "tests" / "gpu" / "cold_ab.py")
    assert spec and spec.loader
    ca = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ca)
    out = ("goos: linux\n"
           "BenchmarkReplayVMMCold/walk=256KiB/calls=true         \t       1\t1781411573 ns/op\t     63049 calls/replay"
           "\t         0.3481 miss-share\t       213.5 ns/free\t       122.8 ns/hit\t      1648 ns/miss\t        38.35 ns/walk\n"
           "PASS\n")
    assert ca.parse(out) == {"256": {"ns/hit": 122.8, "ns/miss": 1648.0, "ns/free": 213.5, "ns/walk": 38.35}}
    got = {"base": {"256": {"ns/miss": [1000.0, 1200.0, 1100.0]}}, "head": {"256": {"ns/miss": [800.0, 900.0, 700.0]}}}
    lines = ca.report(got)
    assert lines[1].split() == ["256", "ns/miss", "1100.0", "800.0", "0.727", "3/3"]
    p = run_py(str(REPO / "tests" / "gpu" / "cold_ab.py"), "--run", "--rounds", "0")
    assert p.returncode == 2 and "at least 1" in p.stderr
    p = run_py(str(REPO / "tests" / "gpu" / "cold_ab.py"), "--run", "--walks", "256,lots")
    assert p.returncode == 2 and "KiB counts" in p.stderr


def lockstep_doc(pair: list[str], throughputs: list[float], workload: str = "llama") -> dict[str, Any]:
    """A bench/lockstep.py lockstep.json with one compared repeat per ratio, and a failed one."""
    pairs = [{"repeat": i, "status": "ok",
              "compare": {"steps": 100, "throughput": t, "step_median": t, "by_first": {"a": t, "b": None},
                          "median_step_s": {"a": 0.020, "b": 0.020 / t}, "overlapping_steps": 0}}
             for i, t in enumerate(throughputs)]
    pairs.append({"repeat": len(throughputs), "status": "died", "reason": "b: its turns ended before its last step"})
    return {"kind": "lockstep", "workload": workload, "pair": pair, "command": "python3 bench/lockstep.py OUT",
            "started": "2026-12-01T04:18:08Z", "git_commit": "abc", "host": {"cpus": 16, "cpus_allowed": [1, 2, 3, 4]},
            "options": {"first_repeat": 27, "repeats": len(pairs)}, "pairs": pairs}


def test_lockstep_runs_decide_the_throughput_goal_and_get_a_table():
    doc = suite_doc("0", 0, 3, ["llama"])
    for r in doc["runs"]:  # one after another, the suite's runs say 0.90x
        if r["config"] == "native":
            r["result"]["units_per_s"] = 20000.0
        elif r["config"] == "goalloc-vmm":
            r["result"]["units_per_s"] = 18000.0
    doc["lockstep"] = [lockstep_doc(["native", "goalloc-vmm"], [0.97, 1.01, 0.99, 1.02]),
                       lockstep_doc(["native", "native"], [1.0, 0.99, 1.02])]
    _, goals = render.goals(doc)
    thr = {g["goal"]: g for g in goals}["LLaMA 672M (GQA) throughput ≥ 0.98 × native"]
    assert thr["met"] is True, thr
    assert thr["text"].startswith("In lockstep with native, goalloc-vmm 1.000× (0.970–1.020, n=4; faster in 2 of 4); "
                                  "native against native in lockstep, 1.000× (0.990–1.020, n=3; faster in 1 of 3); "
                                  "in the suite's runs, one after another, goalloc-vmm 18,000 vs native 20,000 tokens/s "
                                  "= 0.900×"), thr["text"]
    text = render.render(doc)
    assert "### Training in lockstep" in text
    assert ("| llama | goalloc-vmm against native | 1.000× (0.970–1.020, n=4; faster in 2 of 4) | 1.000× (0.970–1.020) "
            "| 20.00 ms | 20.00 ms |") in text, text[text.index("### Training in lockstep"):]
    assert "- options: workload llama; repeats 27–31; 4 compared, 1 not" in text
    assert "CPUs 1,2,3,4 of 16" in text
    # Below the goal in lockstep: missed, by how much, whatever the suite said.
    doc["lockstep"][0] = lockstep_doc(["native", "goalloc-vmm"], [0.95, 0.96, 0.97])
    for r in doc["runs"]:
        if r["config"] == "goalloc-vmm":
            r["result"]["units_per_s"] = 21000.0
    thr = {g["goal"]: g for g in render.goals(doc)[1]}["LLaMA 672M (GQA) throughput ≥ 0.98 × native"]
    assert thr["met"] is False and "0.960× (0.950–0.970, n=3; faster in 0 of 3), 2.0 points under the goal" in thr["text"]
    # Another workload's lockstep runs, or another pair, decide nothing here.
    doc["lockstep"] = [lockstep_doc(["native", "goalloc-vmm"], [0.5], workload="resnet50"),
                       lockstep_doc(["native", "goalloc"], [0.5])]
    thr = {g["goal"]: g for g in render.goals(doc)[1]}["LLaMA 672M (GQA) throughput ≥ 0.98 × native"]
    assert thr["met"] is True and thr["text"].startswith("goalloc-vmm 21,000 vs native 20,000 tokens/s = 1.050×")


def test_render_reads_lockstep_files_and_refuses_others(tmp_path: Path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(suite_doc("0", 0, 3, ["llama"])))
    ls = tmp_path / "lockstep.json"
    ls.write_text(json.dumps(lockstep_doc(["native", "goalloc-vmm"], [0.99, 1.0, 1.01])))
    p = run_py(str(BENCH / "render.py"), str(bench), "--lockstep", str(ls))
    assert p.returncode == 0, p.stderr
    assert f"Lockstep input 1: `{ls}`" in p.stdout and "In lockstep with native, goalloc-vmm 1.000×" in p.stdout
    p = run_py(str(BENCH / "render.py"), str(bench), "--lockstep", str(bench))
    assert p.returncode == 1 and "is not a bench/lockstep.py lockstep.json" in p.stderr


def test_render_keeps_the_lockstep_runs_a_merged_document_carries(tmp_path: Path):
    """bench/results/training.json is a merged document that carries its
    lockstep runs: rendered alone it shows them, and --lockstep adds more."""
    doc = suite_doc("0", 0, 3, ["llama"])
    doc["lockstep"] = [lockstep_doc(["native", "goalloc-vmm"], [0.99, 1.0, 1.01]) | {"path": "ab.json"}]
    merged = tmp_path / "training.json"
    merged.write_text(json.dumps(doc))
    p = run_py(str(BENCH / "render.py"), str(merged))
    assert p.returncode == 0, p.stderr
    assert "Lockstep input 1: `ab.json`" in p.stdout and "In lockstep with native, goalloc-vmm 1.000×" in p.stdout
    ls = tmp_path / "aa.json"
    ls.write_text(json.dumps(lockstep_doc(["native", "native"], [1.0, 0.99, 1.02])))
    p = run_py(str(BENCH / "render.py"), str(merged), "--lockstep", str(ls))
    assert p.returncode == 0, p.stderr
    assert f"Lockstep input 2: `{ls}`" in p.stdout and "native against native in lockstep, 1.000×" in p.stdout


def test_keep_writes_a_file_that_renders_the_same_tables(tmp_path: Path):
    """--keep: the merged runs and lockstep runs, pruned, render alone as the inputs did."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(fake_doc()))
    b.write_text(json.dumps(suite_doc("1", 3, 2, ["llama", "resnet50"])))
    ls = tmp_path / "ls.json"
    ls.write_text(json.dumps(lockstep_doc(["native", "goalloc-vmm"], [0.99, 1.0, 1.01], workload="resnet50")))
    kept = tmp_path / "kept.json"
    p = run_py(str(BENCH / "render.py"), str(a), str(b), "--lockstep", str(ls), "--keep", str(kept))
    assert p.returncode == 0, p.stderr
    q = run_py(str(BENCH / "render.py"), str(kept))
    assert q.returncode == 0, q.stderr
    assert p.stdout.replace(f"{tmp_path}/", "") == q.stdout
    doc = json.loads(kept.read_text())
    assert doc["produced_by"]["kept"].startswith("python3 bench/render.py ") and "--keep" in doc["produced_by"]["kept"]
    assert len(doc["produced_by"]["suites"]) == 2 and len(doc["lockstep"]) == 1
    assert all(set(r) <= set(render.KEEP_RUN) | {"result"} for r in doc["runs"])


def test_keep_again_with_a_new_suite_names_every_suite(tmp_path: Path):
    """A kept file rendered with a further suite keeps the commands of the
    suites it was made from, and adds the new one's."""
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(fake_doc()))
    b.write_text(json.dumps(suite_doc("1", 3, 2, ["llama", "resnet50"])))
    c.write_text(json.dumps(suite_doc("2", 3, 2, ["llama"]) | {"command": "bash bench/run.sh OUTDIR --third"}))
    kept, again = tmp_path / "kept.json", tmp_path / "again.json"
    assert run_py(str(BENCH / "render.py"), str(a), str(b), "--keep", str(kept)).returncode == 0
    p = run_py(str(BENCH / "render.py"), str(kept), str(c), "--keep", str(again))
    assert p.returncode == 0, p.stderr
    suites = json.loads(again.read_text())["produced_by"]["suites"]
    assert suites == json.loads(kept.read_text())["produced_by"]["suites"] + ["bash bench/run.sh OUTDIR --third"]
    assert None not in suites


def test_keep_again_carries_the_lockstep_runs_and_the_history(tmp_path: Path):
    """A kept file given again with a further suite keeps its lockstep runs,
    which still decide the throughput goal, and says how it was made before."""
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(suite_doc("0", 0, 2, ["llama"])))
    b.write_text(json.dumps(suite_doc("1", 2, 1, ["llama"])))
    c.write_text(json.dumps(suite_doc("2", 3, 1, ["llama"])))
    ls = tmp_path / "ls.json"
    ls.write_text(json.dumps(lockstep_doc(["native", "goalloc-vmm"], [0.95, 0.96, 0.97])))
    kept, again = tmp_path / "kept.json", tmp_path / "again.json"
    assert run_py(str(BENCH / "render.py"), str(a), str(b), "--lockstep", str(ls), "--keep", str(kept)).returncode == 0
    p = run_py(str(BENCH / "render.py"), str(kept), str(c), "--keep", str(again))
    assert p.returncode == 0, p.stderr
    doc = json.loads(again.read_text())
    assert len(doc["lockstep"]) == 1 and len(doc["produced_by"]["lockstep"]) == 1
    assert "In lockstep with native, goalloc-vmm 0.960×" in p.stdout
    first = json.loads(kept.read_text())["produced_by"]["kept"]
    assert doc["produced_by"]["kept"].startswith(first + "; then python3 bench/render.py "), doc["produced_by"]["kept"]


def test_speed_is_not_compared_across_suites(tmp_path: Path):
    """goalloc's runs of a repeat in one suite and native's in another were
    not interleaved: no throughput ratio, in the table or the goal; memory
    is compared all the same, and a lockstep run still decides."""
    torch_side = suite_doc("0", 0, 3, ["llama"])
    torch_side["runs"] = [r for r in torch_side["runs"] if not r["config"].startswith("goalloc")]
    goalloc_side = suite_doc("1", 0, 3, ["llama"])
    goalloc_side["runs"] = [r for r in goalloc_side["runs"] if r["config"].startswith("goalloc")]
    doc = render.merge([torch_side, goalloc_side], ["T/bench.json", "G/bench.json"])
    text = render.render(doc)
    assert "| goalloc-vmm | 19,800 (19,800–19,800, n=3) | — | 41.00 GiB | 1.025× | 0.854× |" in text
    assert "| expandable | 20,000 (20,000–20,000, n=3) | 1.000× |" in text
    assert "—: no throughput ratio for goalloc, goalloc-vmm: native's runs of the same repeats come from other suites" \
        in text
    by = {g["goal"]: g for g in render.goals(doc)[1]}
    thr = by["LLaMA 672M (GQA) throughput ≥ 0.98 × native"]
    assert thr["met"] is None and "different suites" in thr["text"], thr
    assert render.paired_speed_ratios(doc, "llama", "goalloc-vmm") == []
    assert by["LLaMA 672M (GQA) peak memory below native"]["met"] is True
    # Kept, the runs keep their suite; kept before runs had one, the inputs' run names give it.
    kept = json.loads(json.dumps(render.keep(doc, ["T/bench.json", "G/bench.json"])))
    text = text.replace("T/bench.json", "bench.json").replace("G/bench.json", "bench.json")
    assert render.render(render.merge([kept], ["kept.json"])) == text
    for r in kept["runs"]:
        del r["suite"]
    assert render.render(render.merge([kept], ["kept.json"])) == text
    # One repeat of both in the same suite: its ratio is the one given.
    goalloc_side["runs"] += [r for r in torch_side["runs"] if r["config"] == "native" and r["repeat"] == 2]
    doc = render.merge([torch_side, goalloc_side], ["T/bench.json", "G/bench.json"])
    assert render.paired_speed_ratios(doc, "llama", "goalloc-vmm") == [0.99]
    # Lockstep decides where the suites cannot.
    doc["lockstep"] = [lockstep_doc(["native", "goalloc-vmm"], [0.99, 1.0, 1.01])]
    goalloc_side["runs"] = [r for r in goalloc_side["runs"] if r["config"] != "native"]
    doc = render.merge([torch_side, goalloc_side], ["T/bench.json", "G/bench.json"]) | {"lockstep": doc["lockstep"]}
    thr = {g["goal"]: g for g in render.goals(doc)[1]}["LLaMA 672M (GQA) throughput ≥ 0.98 × native"]
    assert thr["met"] is True and thr["text"].startswith("In lockstep with native, goalloc-vmm 1.000×")
    assert "come from different suites: no ratio" in thr["text"]


def test_allocator_split_names_what_holds_the_memory():
    """goalloc's split has its own blocks apart from what it holds from the
    driver; PyTorch's has held and allocated."""
    stats = {"reserved_bytes.all.current": 10, "goalloc.own_reserved_bytes.current": 9,
             "allocated_bytes.all.current": 8}
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(memory_stats=lambda d: stats))
    a = workloads.Allocator(fake_torch, "goalloc-vmm")
    split = {"held": 10, "live": 9, "free_shared": 1, "free_whole": 0, "free_spans": 1, "pending": 0}
    a.goalloc = types.SimpleNamespace(memory_stats=lambda d: stats,
                                      fragmentation=lambda d: types.SimpleNamespace(held_split=split))
    assert a.split() == {"held": 10, "own": 9, "allocated": 8, "held_split": split}
    assert workloads.Allocator(fake_torch, "native").split() == {"held": 10, "allocated": 8}


def test_breakdown_at_the_device_peak_adds_up():
    """Runs that read the allocator at the device's peak get a line whose
    parts add up to what the device held over the idle process; kept
    results keep what it reads."""
    doc = fake_doc()
    for run in doc["runs"]:
        if run.get("workload") == "gpt2" and run.get("config") == "goalloc-vmm" and run.get("status") == "ok":
            run["result"]["device"]["at_peak"] = {"used_over_baseline": 13 << 30, "held": 12 << 30,
                                                  "own": (12 << 30) - (64 << 20), "allocated": 11 << 30,
                                                  "held_split": {"free_shared": 60 << 20, "free_spans": 7}}
    text = render.render(doc)
    assert ("  - at the device's peak (13.00 GiB over the idle process; medians): outside the allocator 1.00 GiB; "
            "mapped between goalloc's blocks 64.0 MiB; goalloc's cache and slack 960.0 MiB; of that mapped, free ends "
            "of handles shared with live memory (7 free spans) 60.0 MiB.") in text, text
    kept = render.keep(doc, [])
    assert any(r["result"]["device"].get("at_peak") for r in kept["runs"] if isinstance(r.get("result"), dict))


def test_breakdown_at_the_held_peak_is_the_devices_own_split():
    """goalloc-vmm's split taken by the device when held last peaked
    (fragmentation().held_split_at_peak) gets its own line, and kept
    results keep it."""
    doc = fake_doc()
    peak = {"held": 12 << 30, "live": (12 << 30) - (96 << 20), "free_shared": 80 << 20, "free_spans": 9,
            "free_whole": 16 << 20, "pending": 0}
    for run in doc["runs"]:
        if run.get("workload") == "gpt2" and run.get("config") == "goalloc-vmm" and run.get("status") == "ok":
            run["result"]["allocator"]["held_split_at_peak"] = peak
    text = render.render(doc)
    assert ("  - when goalloc-vmm held its most (12.00 GiB; the device's own split, medians): live spans 11.91 GiB; "
            "free ends of handles shared with live memory 80.0 MiB (9 free spans); whole free handles 16.0 MiB.") in text, text
    kept = render.keep(doc, [])
    assert any(r["result"]["allocator"].get("held_split_at_peak") == peak
               for r in kept["runs"] if isinstance(r.get("result"), dict))
    # A library that splits out the free ends beside small blocks says so.
    for run in doc["runs"]:
        if run.get("workload") == "gpt2" and run.get("config") == "goalloc-vmm" and run.get("status") == "ok":
            run["result"]["allocator"]["held_split_at_peak"] = peak | {"free_beside_small": 48 << 20}
    assert ("free ends of handles shared with live memory 80.0 MiB (9 free spans; 48.0 MiB of it beside live "
            "blocks under 1 MiB)") in render.render(doc)


slim_trace = load_bench("slim_trace")


def test_slim_trace_keeps_what_the_replay_acts_on() -> None:
    import io
    lines = [
        {"workload": "w", "events": 7},
        {"a": "segment_alloc", "addr": 5000, "size": 4096, "stream": 0, "t": 100},
        {"a": "alloc", "addr": 5000, "size": 512, "stream": 0, "t": 101},
        {"a": "alloc", "addr": 9000, "size": 1024, "stream": 7, "t": 103},
        {"a": "free_requested", "addr": 5000, "size": 512, "stream": 0, "t": 104},
        {"a": "free_completed", "addr": 5000, "size": 512, "stream": 0, "t": 105},
        {"a": "alloc", "addr": 5000, "size": 512, "stream": 0, "t": 110},  # the address again
        {"a": "free_completed", "addr": 9000, "size": 1024, "stream": 7, "t": 111},
    ]
    out = [json.loads(x) for x in slim_trace.slim_lines(io.StringIO("".join(json.dumps(x) + "\n" for x in lines)))]
    header, events = out[0], out[1:]
    assert header["workload"] == "w" and header["events"] == 5 and "slimmed" in header
    assert [(e["a"], e["addr"], e["size"], e["stream"], e["t"]) for e in events] == [
        ("alloc", 1, 512, 0, 0), ("alloc", 2, 1024, 7, 2), ("free_completed", 1, 512, 0, 4),
        ("alloc", 1, 512, 0, 9), ("free_completed", 2, 1024, 7, 10)]
    bad = io.StringIO(json.dumps(lines[0]) + "\n" + json.dumps(lines[5]) + "\n")
    with pytest.raises(ValueError, match="line 2: free_completed of address 5000, which no alloc before it"):
        list(slim_trace.slim_lines(bad))
    for text, says in [("[1]\n", "line 1: not a trace's header"),
                       ('{"w": 1}\n{"a": "alloc", "addr": 1}\n', "line 2: not a trace event .KeyError"),
                       ('{"w": 1}\n{"a": "alloc", "addr": "x", "t": 0}\n', "line 2: addr and t must be integers"),
                       ('{"w": 1}\nnot json\n', "line 2: not a trace event .JSONDecodeError")]:
        with pytest.raises(ValueError, match=says):
            list(slim_trace.slim_lines(io.StringIO(text)))


def test_slim_trace_command_refuses_a_bad_trace_and_writes_nothing(tmp_path: Path) -> None:
    import gzip
    src, dst = tmp_path / "bad.jsonl.gz", tmp_path / "out.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write('{"w": 1}\n{"a": "free_completed", "addr": 7, "size": 512, "stream": 0, "t": 3}\n')
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "slim_trace.py"), str(src), str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and f"slim_trace: {src}: line 2: free_completed of address 7" in r.stderr, r.stderr
    assert not dst.exists()
