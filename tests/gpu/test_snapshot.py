"""Replaying what torch records (issue 16): a snapshot from
torch.cuda.memory._dump_snapshot, of PyTorch's allocator and of goalloc,
replayed by build/goalloc. Skipped without CUDA or without build/goalloc."""
import os

import pytest
from rawlib import run_check

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not os.path.isfile(os.path.join(os.path.dirname(__file__), "..", "..", "build", "goalloc")),
                       reason="needs build/goalloc (make tool where Go is; carry build/)"),
]


@pytest.fixture(scope="module")
def native():
    return run_check("snapshot_check.py", "snapshot-native", "native", timeout=600)


@pytest.fixture(scope="module")
def with_goalloc():
    return run_check("snapshot_check.py", "snapshot-goalloc", "goalloc", timeout=600)


def test_native_snapshot_replays_to_the_recorded_peak(native):
    s = native["snapshot"]
    assert s["recorder"] == "pytorch"
    assert s["initial_blocks"] == 0
    assert s["actions"]["alloc"] > 1000, "a training run, not a toy"
    # The history's own account of reserved memory is torch's.
    assert abs(s["recorded_peak_reserved_bytes"] / native["max_memory_reserved"] - 1) <= 0.02, s
    # The point: the native policy reproduces the run's peak reserved.
    assert abs(native["native"]["vs_max_memory_reserved"]) <= 0.02, native["native"]


def test_native_snapshot_is_small_enough_to_commit(native):
    assert native["pickle_bytes"] < 2 << 20, native["pickle_bytes"]


def test_goalloc_snapshot_replays(with_goalloc):
    s = with_goalloc["snapshot"]
    assert s["recorder"] in ("unknown", "goalloc")  # goalloc's own snapshot, or torch's through goalloc's C++ class
    assert s["initial_blocks"] == 0
    assert s["actions"]["alloc"] > 1000
    assert "no allocator_settings" in with_goalloc["notes"] or "recorded by goalloc" in with_goalloc["notes"]
    # goalloc's history accounts for goalloc's own reserved memory.
    assert abs(s["recorded_peak_reserved_bytes"] / with_goalloc["goalloc_own_reserved_peak"] - 1) <= 0.02, with_goalloc
    assert with_goalloc["goalloc"]["peak_live_bytes"] > 0
