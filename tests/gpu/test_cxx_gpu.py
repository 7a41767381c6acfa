"""goalloc's C++ allocator class on a real GPU (skipped without CUDA): each
test runs one check of cxx_check.py in a fresh process with GOALLOC_CXX=1,
so that a class that cannot be built fails the test instead of falling back.
Each fails on the pluggable path (GOALLOC_CXX=0), which is what goalloc
used before the class: there a refusal raised RuntimeError, cudnn.benchmark
failed with "CUDAPluggableAllocator does not yet support cacheInfo",
reduce-overhead with "... checkPoolLiveAllocations", MemPool() with
"... createOrIncrefPool", and the statistics needed torch's functions
replaced.

    python3 -m goalloc._cxx && python3 -m pytest -q tests/gpu/test_cxx_gpu.py   # build once, then test
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rawlib import run_check  # noqa: E402


@pytest.fixture(autouse=True)
def require_the_class(monkeypatch):
    monkeypatch.setenv("GOALLOC_CXX", "1")
    monkeypatch.delenv("GOALLOC_CONF", raising=False)
    monkeypatch.setenv("GOALLOC_DEVICE", "cuda")


def check(name):
    res = run_check("cxx_check.py", "cxx-" + name, name, timeout=900)
    assert res["cxx"], f"the C++ class is not torch's allocator: {res.get('cxx_failure')}"
    assert res["backend"] == "goalloc"
    return res


def test_refusal_raises_torch_out_of_memory_error_and_the_process_goes_on():
    res = check("oom")
    assert res["error_type"] == "OutOfMemoryError" and res["is_oom_error"], res
    assert res["message"].startswith("CUDA out of memory. Tried to allocate"), res["message"]
    assert res["after_sum_ok"] and res["keep_ok"]
    assert res["num_ooms"] >= 1
    if res["fraction"] is not None:
        assert res["fraction"] == pytest.approx(0.10)


def test_torch_statistics_snapshot_and_history_answer_from_goalloc_with_nothing_replaced():
    res = check("stats")
    assert res["replaced"] == [], "no torch function is replaced"
    assert res["stats_keys_compared"] > 100 and res["stats_mismatch"] == {}
    assert res["allocated_equal"] and res["reserved_equal"]
    assert res["allocated_delta"] >= 3_000_000
    assert res["peak_above_current"] and res["peak_reset"] and res["accumulated_reset"]
    assert res["summary_ok"]
    assert res["trace_alloc_seen"] and res["trace_free_seen"], "history recorded through torch"
    assert res["segments"] >= 1 and res["x_in_snapshot"]
    assert res["dump_ok"] and res["history_off"]


def test_cudnn_benchmark_trains_a_convolutional_net():
    res = check("cudnn")
    assert res["steps"] == 10 and res["losses_finite"]


def test_compile_reduce_overhead_trains_with_eager_losses():
    res = check("compile")
    assert res["cudagraph_skips"] == 0, "CUDA graphs were used"
    assert res["max_loss_diff"] < 1e-3, (res["eager_losses"], res["losses"])


def test_compile_reduce_overhead_switching_paths_restores_pool_checkpoints():
    res = check("compile_paths")
    assert res["cudagraph_skips"] == 0
    assert res["max_loss_diff"] < 1e-3, (res["eager_losses"], res["losses"])
    assert res["max_eval_diff"] < 1e-2


def test_mempool_and_use_mem_pool_in_user_code():
    res = check("mempool")
    assert res["use_count_made"] == 1 and res["use_count_inside"] == 2 and res["use_count_after"] == 1
    assert res["pool_segments_own_id"] and res["a_b_in_pool"] and res["c_not_in_pool"]
    assert res["values_ok"]
    assert res["pool_reuses_its_memory"] and res["eager_never_gets_pool_memory"]
    assert res["goalloc_mempool_is_a_mempool"]
    assert res["graph_pools_after"] == 0, "the pool is gone with its last tensor and the MemPool"


def test_cuda_graphs_and_record_stream_as_before():
    res = check("graphs")
    assert res["replay_ok"]
    assert res["graph_pools"] >= 1 and res["graph_begins"] >= 2
    assert res["record_stream_deferred"] >= 1 and res["record_stream_data_ok"]
    assert res["bad_input"] == {}, res["bad_input"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_copies_between_devices():
    res = check("peer")
    assert res["to_ok"] and res["copy_ok"]


@pytest.mark.skipif(os.environ.get("GOALLOC_CXX_SKIP_PLUGGABLE") == "1", reason="GOALLOC_CXX_SKIP_PLUGGABLE=1")
def test_the_pluggable_path_fails_what_the_class_fixes(monkeypatch):
    """The checks above fail without the class: a refusal is a RuntimeError."""
    monkeypatch.setenv("GOALLOC_CXX", "0")
    res = run_check("cxx_check.py", "pluggable-oom", "oom", timeout=600)
    assert not res["cxx"] and res["error_type"] == "RuntimeError", res
