"""Two-GPU tests (peer access, per-device behaviour, model parallelism).
Skipped where torch is missing or fewer than two CUDA devices are visible.
Each check runs in a fresh process: the allocator must be installed before
CUDA initialises."""
import json
import os
import subprocess
import sys

import pytest
from rawlib import run_check

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", params=[0, 1], ids=["first0", "first1"])
def result(request):
    # run_gpu.sh puts the package (python/) on PYTHONPATH.
    return run_check("multigpu_check.py", f"multigpu-first{request.param}", "--first", str(request.param))


def test_peer_copies_both_ways(result):
    if not all(result["can_access_peer"]):
        pytest.skip("these GPUs cannot access each other")
    for direction in ("peer_0_to_1", "peer_1_to_0"):
        assert result[direction] == {"to": True, "copy_": True, "cat": True, "kernel_reads_peer": True,
                                     "strided": True}, result[direction]


def test_record_stream_with_the_other_devices_stream(result):
    r = result["record_stream"]
    assert isinstance(r, dict), r
    assert r["mismatches"] == 0
    assert r["deferred_frees"] >= 20


def test_stats_are_per_device(result):
    s = result["stats"]
    assert s["delta"][0] == 0
    assert s["delta"][1] >= 256 << 20
    assert s["torch_delta1"] == s["delta"][1]


def test_cap_on_one_device_only(result):
    c = result["cap"]
    assert "OutOfMemoryError" in c["dev1"] or "out of memory" in c["dev1"], c
    assert c["dev0"] is True, c
    assert c["ooms"][0] == 0 and c["ooms"][1] >= 1, c
    assert c["dev1_after_raise"] is True, c


def test_empty_cache_releases_on_both_devices(result):
    e = result["empty_cache"]
    for d in (0, 1):
        assert e["before"][d] > 0
        assert e["after"][d] < e["before"][d]
        assert e["after"][d] >= e["allocated"][d]


def test_allocation_for_device_1_from_a_device_0_thread(result):
    t = result["thread"]
    assert t == {"sum": float(1 << 20), "current_after": 0, "tensor_device": 1}, t


def test_no_bad_input(result):
    assert result["bad_input"] == {"0": {}, "1": {}}, result["bad_input"]


def _model_parallel(allocator):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("GOALLOC_LIBRARY", os.path.join(ROOT, "build", "libgoalloc.so"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "model_parallel.py"),
                           "--allocator", allocator, "--steps", "20"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_model_parallel_trains_like_native():
    g, n = _model_parallel("goalloc"), _model_parallel("native")
    out = os.environ.get("GOALLOC_GPU_OUT")
    if out:
        with open(os.path.join(out, "model_parallel.json"), "w") as f:
            json.dump({"goalloc": g, "native": n}, f, indent=1)
    assert len(g["losses"]) == 20
    # Same seed, same kernels: the allocator must not change the numbers.
    # The first step is bit-for-bit the same computation; later steps may
    # drift by the nondeterminism of atomics in attention's backward, never
    # by more than that.
    assert g["losses"][0] == pytest.approx(n["losses"][0], rel=1e-5)
    assert g["losses"] == pytest.approx(n["losses"], rel=1e-2)
    assert g["losses"][-1] < g["losses"][0]
