"""Memory tags, sleep and wake on a GPU (skipped without CUDA): each test
runs sleep_check.py in a fresh process, through goalloc's C++ class and
through the pluggable path, and asserts on what it printed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rawlib import run_check  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module", params=["cxx", "pluggable"])
def result(request):
    mp = pytest.MonkeyPatch()
    mp.setenv("GOALLOC_CXX", "1" if request.param == "cxx" else "0")
    mp.delenv("GOALLOC_CONF", raising=False)
    mp.setenv("GOALLOC_DEVICE", "cuda")
    try:
        args = ["compile"] if request.param == "cxx" else []
        res = run_check("sleep_check.py", "sleep-" + request.param, *args, timeout=500)
    finally:
        mp.undo()
    assert res["cxx"] == (request.param == "cxx"), res
    return res


def test_sleep_offloads_the_weights_and_releases_every_tag(result):
    s = result["sleep"]
    # Every live block of the tag: the weights, the biases' small segment and
    # the cuBLAS workspace torch allocated inside the tag for the side
    # stream's first matmul (32 MiB on an H200).
    assert s["offloaded"] == s["state"]["tags"]["weights"]["reserved_bytes"], s
    assert s["weights_bytes"] <= s["offloaded"] <= s["weights_bytes"] + 34 * MiB, s
    assert s["reserved_before"] - s["reserved_after"] == s["released"]
    assert s["allocated_after"] == s["allocated_before"], "the tensors live on"
    assert sorted(s["state"]["asleep"]) == ["kv_cache", "weights"]
    # goalloc holds the untagged live memory and at most 1% of what it held
    # before more (whole handles of the untagged segments)...
    assert s["reserved_after"] <= s["untagged_allocated"] + s["reserved_before"] // 100, s
    # ... and the device (by mem_get_info, not goalloc's count) gave back what
    # goalloc says it released, less the copy streams' and events' few MiB.
    assert s["device_before"] - s["device_after"] >= s["released"] - 32 * MiB, s
    assert result["untagged_use_while_asleep"] is None


def test_wake_restores_bytes_at_the_same_addresses(result):
    w = result["wake"]
    assert w["woken"] and sorted(w["woken"]) == ["kv_cache", "weights"]
    assert w["restored"] == result["sleep"]["offloaded"]
    assert w["state"]["asleep"] == []
    assert result["same_addresses"]
    assert result["weights_equal"]
    assert result["untagged_intact"]
    assert result["kv_usable"]


def test_sleep_waits_for_work_queued_on_the_memory(result):
    # The side stream was still writing a tagged tensor when sleep began.
    assert result["busy_equal"]


def test_graphs_captured_before_sleep_replay_after_wake(result):
    assert result["graph_diff"] == 0.0
    assert result["eager_diff"] == 0.0
    assert result["capture_after_refusal_diff"] == 0.0


def test_refusals(result):
    e = result["errors"]
    assert "nothing is asleep" in e["wake_without_sleep"], e
    assert e["unknown_tag"].startswith("ValueError") and "no-such-tag" in e["unknown_tag"], e
    assert "capture" in e["during_capture"], e
    assert "asleep" in e["sleep_twice"], e


def test_out_of_memory_on_wake_leaves_everything_asleep(result):
    o = result["wake_oom"]
    assert o["error"] and "out of memory" in o["error"].lower(), o
    assert o["is_torch_oom"], o
    assert sorted(o["asleep"]) == ["kv_cache", "weights"], o


def test_a_second_cycle_discards_every_tag(result):
    s = result["second"]
    assert s["offloaded"] == 0 and s["released"] > 0
    assert s["woken"] == [["kv_cache"], ["weights"]]


def test_reduce_overhead_survives_a_sleep(result):
    if not result["cxx"]:
        pytest.skip("torch.compile(mode='reduce-overhead') needs the C++ class")
    assert result["compile_diff"] == 0.0


def test_prepare_sleep_grows_the_host_area_from_a_thread(result):
    p = result["prepare"]
    assert p["after"] >= p["before"] + (2 << 30), p
