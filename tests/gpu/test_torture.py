"""GPU data-integrity torture (issue: reliability); skipped without CUDA.
Each scenario runs torture_check.py in a fresh process. GOALLOC_TORTURE_OPS
sets the size of the main run (default 10^6)."""
import os

import pytest
from rawlib import run_check

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def torture(name, *argv, timeout=600):
    return run_check("torture_check.py", "torture_" + name, *argv, timeout=timeout)


def check_clean(r):
    assert r["mismatches"] == 0
    assert r["threads_finished"] == r["threads"]
    assert r["allocated_after"] == 0, "bytes leaked"
    assert r["active_after"] == 0
    assert r["reserved_after_empty_cache"] == 0
    assert r["pool_used_after"] == r["reserved_after_empty_cache"], "the pool's figures agree with goalloc's"


def test_torture_million_ops_four_streams():
    r = torture("main", "--ops", os.environ.get("GOALLOC_TORTURE_OPS", "1000000"))
    check_clean(r)
    assert r["handoffs"] > 0.2 * r["allocs"]
    assert r["deferred_frees"] > 0
    assert r["ooms_seen_by_torch"] == 0 and r["num_ooms"] == 0


def test_torture_under_cap_forces_retries():
    # 0.03% of 140 GiB is about 43 MiB: below what 64 live tensors of up to
    # 16 MiB (about 1 MiB on average, log-uniform sizes) want, so requests
    # fail and the allocator retries first.
    r = torture("cap", "--ops", "100000", "--fraction", "0.0003", "--max-live", "64", "--max-log2", "24")
    check_clean(r)
    assert r["num_alloc_retries"] > 0
    assert r["num_ooms"] > 0
    # Every failed request surfaced in torch, as a failed fill or a skipped check.
    assert r["ooms_seen_by_torch"] + r["skipped_checks"] == r["num_ooms"]
    assert r["reserved_peak"] <= 0.0003 * torch.cuda.get_device_properties(0).total_memory
    assert "goalloc: CUDA out of memory. Tried to allocate" in r["stderr"]


def test_torture_threads():
    r = torture("threads", "--ops", "200000", "--threads", "4")
    check_clean(r)
