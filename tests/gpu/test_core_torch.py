"""GPU test of the core allocator inside PyTorch (issue: core allocator).
Skipped where torch or CUDA is missing. Runs core_torch_check.py in a fresh
process, because the allocator must be installed before CUDA initialises."""
import pytest
from rawlib import run_check

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



@pytest.fixture(scope="module")
def result():
    return run_check("core_torch_check.py", "core_torch", timeout=300)


def test_training_runs_and_hits_the_cache(result):
    t = result["train"]
    assert t["finite"]
    assert t["last_loss"] < t["first_loss"]
    # Most requests hit the cache, and what goalloc holds stays close to
    # what the model uses (miss_release gives cached blocks back to the pool).
    # reserved_peak is what the device holds (the granules backend:vmm maps
    # around goalloc's blocks, or the pool's 32 MiB chunks under
    # backend:async): at or above goalloc's own count.
    assert t["cache_hits"] > t["cache_misses"]
    assert t["own_reserved_peak"] <= 1.10 * t["allocated_peak"]
    assert t["reserved_peak"] >= t["own_reserved_peak"]
    assert not t["bad_input"] or all(v == 0 for v in t["bad_input"].values()), t["bad_input"]


def test_record_stream_keeps_data_intact(result):
    r = result["record_stream"]
    assert r["mismatches"] == 0
    assert r["deferred_frees"] >= 20


def test_empty_cache_releases_to_the_pool(result):
    e = result["empty_cache"]
    assert e["reserved_before"] > 0
    assert e["reserved_after"] < e["reserved_before"]
    assert e["pool_reserved_after"] < e["pool_reserved_before"]


def test_fraction_caps_and_recovers(result):
    f = result["fraction"]
    assert f["over_cap"] != "allocated"
    assert f["ooms"] == 1
    assert f["still_works"] == 3000.0
    assert f["reserved"] <= f["cap"]
    assert f["after_raising_cap"] == "allocated"
    assert "goalloc: CUDA out of memory. Tried to allocate" in result["stderr"]


def test_threads_without_context(result):
    assert result["threads"]["errors"] == []
