"""Statistics against a known sequence of allocations made through the C ABI.

The figures follow from goalloc's layout (caching/sizeclasses.go): a request
of at most 64 KiB takes a slot of its size class inside a small segment
(1000 bytes -> a 1024-byte slot in a 256 KiB segment); a larger one takes a block of its
size rounded up to 512 bytes (3,000,000 -> 3,000,320), its own segment, and
stays cached on its stream when freed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import goalloc
from goalloc import _warnings
from goalloc_testing import device_holds

SEGMENT = 256 * 1024  # the small segment of the 1024-byte class (classSegment)
SLOT = 1024  # the slot of a 1000-byte request
SMALL = 1000
LARGE = 3_000_000
BLOCK = 3_000_320  # LARGE rounded up to 512


def pool_figures(stats: dict[str, int], name: str, pool: str) -> tuple[int, int, int, int]:
    return tuple(stats[f"{name}.{pool}.{f}"] for f in ("current", "peak", "allocated", "freed"))  # type: ignore[return-value]


@pytest.fixture
def five_then_free_one(raw, device):
    """3 small and 2 large allocations on one stream, then the first large freed."""
    small = [raw.must_malloc(SMALL, device) for _ in range(3)]
    large = [raw.must_malloc(LARGE, device) for _ in range(2)]
    raw.free(large[0], LARGE, device)
    return SimpleNamespace(device=device, small=small, large=large)


def test_known_sequence_gives_exact_torch_statistics(five_then_free_one):
    s = goalloc.memory_stats(five_then_free_one.device)

    # (current, peak, allocated, freed), as torch reports them.
    assert pool_figures(s, "allocation", "small_pool") == (3, 3, 3, 0)
    assert pool_figures(s, "allocation", "large_pool") == (1, 2, 2, 1)
    assert pool_figures(s, "allocation", "all") == (4, 5, 5, 1)

    assert pool_figures(s, "allocated_bytes", "small_pool") == (3 * SLOT, 3 * SLOT, 3 * SLOT, 0)
    assert pool_figures(s, "allocated_bytes", "large_pool") == (BLOCK, 2 * BLOCK, 2 * BLOCK, BLOCK)
    assert pool_figures(s, "allocated_bytes", "all") == (3 * SLOT + BLOCK, 3 * SLOT + 2 * BLOCK, 3 * SLOT + 2 * BLOCK, BLOCK)

    # Requested bytes are what the caller asked for, before rounding.
    assert pool_figures(s, "requested_bytes", "small_pool") == (3 * SMALL, 3 * SMALL, 3 * SMALL, 0)
    assert pool_figures(s, "requested_bytes", "large_pool") == (LARGE, 2 * LARGE, 2 * LARGE, LARGE)

    # No record_stream: active equals allocated.
    assert pool_figures(s, "active_bytes", "all") == pool_figures(s, "allocated_bytes", "all")
    assert pool_figures(s, "active", "all") == pool_figures(s, "allocation", "all")

    # One small segment, two large blocks; the freed block stays cached.
    assert pool_figures(s, "segment", "small_pool") == (1, 1, 1, 0)
    assert pool_figures(s, "segment", "large_pool") == (2, 2, 2, 0)
    assert pool_figures(s, "reserved_bytes", "small_pool") == (SEGMENT, SEGMENT, SEGMENT, 0)
    assert pool_figures(s, "reserved_bytes", "large_pool") == (2 * BLOCK, 2 * BLOCK, 2 * BLOCK, 0)

    # The small segment's other 2045 slots are free but cannot go back to the pool.
    slots = SEGMENT // SLOT
    assert pool_figures(s, "inactive_split", "small_pool") == (slots - 3, slots - 1, slots - 1, 2)
    assert s["inactive_split_bytes.small_pool.current"] == SEGMENT - 3 * SLOT

    assert s["num_device_alloc"] == 3
    assert s["num_device_free"] == 0
    assert s["num_ooms"] == 0
    assert s["goalloc.cache_misses"] == 3  # the first small one and both large ones
    assert s["goalloc.cache_hits"] == 2  # the second and third small ones


def test_shortcuts_read_the_same_figures(five_then_free_one):
    d = five_then_free_one.device
    s = goalloc.memory_stats(d)
    assert goalloc.memory_allocated(d) == s["allocated_bytes.all.current"] == 3 * SLOT + BLOCK
    assert goalloc.max_memory_allocated(d) == s["allocated_bytes.all.peak"] == 3 * SLOT + 2 * BLOCK
    # Reserved is what the device holds around goalloc's segment and blocks
    # (granules, or a pool chunk); goalloc's own count is them.
    held = device_holds(SEGMENT + 2 * BLOCK)
    assert goalloc.memory_reserved(d) == s["reserved_bytes.all.current"] == held
    assert goalloc.max_memory_reserved(d) == s["reserved_bytes.all.peak"] == held
    assert s["goalloc.own_reserved_bytes.current"] == SEGMENT + 2 * BLOCK


def test_stats_keys_are_torchs_and_sorted(five_then_free_one):
    s = goalloc.memory_stats(five_then_free_one.device)
    assert list(s) == sorted(s)
    for name in ("allocation", "allocated_bytes", "requested_bytes", "active", "active_bytes",
                 "segment", "reserved_bytes", "inactive_split", "inactive_split_bytes"):
        for pool in ("all", "small_pool", "large_pool"):
            for fig in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{fig}" in s
    for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                "num_device_free", "max_split_size", "oversize_allocations.current", "oversize_segments.peak"):
        assert key in s
    assert all(isinstance(v, int) for v in s.values())


def test_cached_block_is_reused_without_the_driver(raw, five_then_free_one):
    d = five_then_free_one.device
    p = raw.must_malloc(LARGE, d)
    assert p == five_then_free_one.large[0]  # the cached block, on the same stream
    s = goalloc.memory_stats(d)
    assert s["num_device_alloc"] == 3
    assert s["goalloc.cache_hits"] == 3
    assert s["allocated_bytes.large_pool.current"] == 2 * BLOCK


def test_reset_peak_memory_stats(raw, five_then_free_one):
    d = five_then_free_one.device
    goalloc.reset_peak_memory_stats(d)
    s = goalloc.memory_stats(d)
    assert s["allocated_bytes.all.peak"] == s["allocated_bytes.all.current"] == 3 * SLOT + BLOCK
    assert s["allocated_bytes.all.allocated"] == 3 * SLOT + 2 * BLOCK  # totals untouched
    p = raw.must_malloc(4 * LARGE, d)  # 12,000,256 bytes once rounded
    assert goalloc.max_memory_allocated(d) == 3 * SLOT + BLOCK + 12_000_256
    raw.free(p, 4 * LARGE, d)
    assert goalloc.max_memory_allocated(d) == 3 * SLOT + BLOCK + 12_000_256


def test_reset_accumulated_memory_stats(five_then_free_one):
    d = five_then_free_one.device
    goalloc.reset_accumulated_memory_stats(d)
    s = goalloc.memory_stats(d)
    assert pool_figures(s, "allocated_bytes", "all") == (3 * SLOT + BLOCK, 3 * SLOT + 2 * BLOCK, 3 * SLOT + BLOCK, 0)
    assert s["num_device_alloc"] == 0
    assert s["goalloc.cache_hits"] == s["goalloc.cache_misses"] == 0


def test_fragmentation(five_then_free_one):
    f = goalloc.fragmentation(five_then_free_one.device)
    free = BLOCK + (SEGMENT // SLOT - 3) * SLOT  # the cached block and the free slots
    assert f.free_bytes == free
    assert f.largest_free_block == BLOCK
    assert f.ratio == pytest.approx(1 - BLOCK / free)
    assert f.pool_used_bytes == SEGMENT + 2 * BLOCK
    # backend:vmm (the default): the device's handles, span by span.
    h = f.held_split
    assert h["held"] == f.pool_reserved_bytes
    assert h["live"] == SEGMENT + 2 * BLOCK, "goalloc's blocks, the cached one too, and the small segment"
    assert h["held"] == h["live"] + h["free_shared"] + h["free_whole"] + h["pending"]
    assert 0 <= h["free_beside_small"] <= h["free_shared"]
    p = f.held_split_at_peak  # taken by the device when held last rose
    assert p["held"] == f.pool_reserved_high_bytes
    assert p["held"] == p["live"] + p["free_shared"] + p["free_whole"] + p["pending"]


def test_empty_cache_gives_cached_memory_back(raw, five_then_free_one):
    d = five_then_free_one.device
    goalloc.empty_cache(d)
    s = goalloc.memory_stats(d)
    assert s["reserved_bytes.large_pool.current"] == BLOCK  # only the live block
    assert s["segment.large_pool.current"] == 1
    assert s["reserved_bytes.small_pool.current"] == SEGMENT  # it still has live slots
    assert s["num_device_free"] == 1
    assert s["num_sync_all_streams"] == 1
    assert goalloc.fragmentation(d).largest_free_block == SLOT

    # Everything freed: empty_cache() with no argument empties every device.
    for p in five_then_free_one.small:
        raw.free(p, SMALL, d)
    raw.free(five_then_free_one.large[1], LARGE, d)
    goalloc.empty_cache()
    assert goalloc.memory_reserved(d) == 0
    assert goalloc.memory_allocated(d) == 0
    assert goalloc.fragmentation(d).free_bytes == 0


def test_bad_calls_through_the_c_abi_are_counted(raw, device):
    # The library warns of the first of each kind in the process, and this
    # is the only test here that makes these two.
    with pytest.warns(goalloc.GoallocWarning) as warned:
        assert raw.malloc(-1, device) == 0
        p = raw.must_malloc(SMALL, device)
        raw.free(p, SMALL, device)
        raw.free(p, SMALL, device)  # a double free: reported, counted, ignored
        _warnings.drain()
    assert {str(w.message).rsplit(".", 1)[-1] for w in warned} == {"negative_size)", "double_free)"}
    s = goalloc.memory_stats(device)
    assert s["goalloc.bad_input.double_free"] == 1
    assert s["goalloc.bad_input.negative_size"] >= 1  # counted library-wide
    assert s["allocation.all.current"] == 0


def test_untouched_device_reads_as_zeros():
    s = goalloc.memory_stats(0)
    assert s["allocated_bytes.all.current"] == 0
    assert s["reserved_bytes.all.peak"] == 0
    assert goalloc.fragmentation(0).free_bytes == 0


def test_device_given_as_torch_gives_it(raw, device):
    raw.must_malloc(LARGE, device)
    want = goalloc.memory_allocated(device)
    assert want == BLOCK
    assert goalloc.memory_allocated(f"cuda:{device}") == want
    assert goalloc.memory_allocated(SimpleNamespace(type="cuda", index=device)) == want  # a torch.device
    # None and "cuda" mean torch's current device: 0 while torch has not started CUDA.
    assert goalloc.memory_allocated(None) == goalloc.memory_allocated(0) == 0
    assert goalloc.memory_allocated("cuda") == 0


def test_memory_summary_is_a_readable_table(five_then_free_one):
    d = five_then_free_one.device
    text = goalloc.memory_summary(d)
    lines = text.splitlines()
    assert all(len(line) == 77 for line in lines), "every line is 75 characters between borders"
    assert f"device ID {d}" in lines[1]
    header = next(line for line in lines if "Metric" in line)
    for col in ("Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"):
        assert col in header
    for row in ("Allocated memory", "Active memory", "Requested memory", "GPU reserved memory",
                "Non-releasable memory", "Allocations", "Active allocs", "GPU reserved segments",
                "Non-releasable allocs"):
        assert any(line.startswith(f"| {row}") for line in lines), row
    assert sum("from large pool" in line for line in lines) == 9
    allocated = next(line for line in lines if line.startswith("| Allocated memory"))
    assert allocated.split("|")[2].split() == ["2933", "KiB"]  # 3 * 1024 + 3,000,320 bytes
    allocations = next(line for line in lines if line.startswith("| Allocations"))
    assert [c.strip() for c in allocations.split("|")[2:6]] == ["4", "5", "5", "1"]
    assert "2 hits, 3 misses" in text
    assert "largest free block 2.86 MiB" in text

    short = goalloc.memory_summary(d, abbreviated=True)
    assert "from large pool" not in short and "Allocated memory" in short


def test_config_reports_the_simulated_devices():
    c = goalloc.config()
    assert c["device"] == "sim"
    assert c["device_count"] == goalloc.device_count() == 64
    assert "fraction" in c["keys"]
