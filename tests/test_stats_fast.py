"""The per-step statistics: memory_allocated() and its three siblings, read
through goalloc_stat (atomic loads, no JSON) rather than memory_stats().

They must never drift from memory_stats(), must default to torch's current
device, and torch.cuda's four functions must answer from them after
install() (checked here on a stand-in torch module; tests/gpu checks the
real one).
"""

from __future__ import annotations

import random
import sys
import timeit
import types
from types import SimpleNamespace
from typing import Any, Callable

import pytest

import goalloc
from goalloc import _lib, _torch
from goalloc_testing import OTHER_STREAM, STREAM, device_holds

LARGE = 3_000_000
BLOCK = 3_000_320  # LARGE rounded up to 512

FAST: dict[str, Callable[..., int]] = {
    "allocated_bytes.all.current": goalloc.memory_allocated,
    "allocated_bytes.all.peak": goalloc.max_memory_allocated,
    "reserved_bytes.all.current": goalloc.memory_reserved,
    "reserved_bytes.all.peak": goalloc.max_memory_reserved,
}


def assert_fast_equals_stats(device: int, msg: str = "") -> None:
    s = goalloc.memory_stats(device)
    scalars = _lib.stat_scalars(device)
    for i, key in enumerate(_lib.STAT_KEYS):
        assert scalars[i] == s[key], f"{msg}: goalloc_stat_scalars {key}"
        assert _lib.stat(device, i) == s[key], f"{msg}: goalloc_stat {key}"
    for key, fn in FAST.items():
        assert fn(device) == s[key], f"{msg}: {fn.__name__}"


def test_keys_are_the_librarys():
    assert tuple(_lib.stat_keys()) == _lib.STAT_KEYS
    assert set(FAST) == set(_lib.STAT_KEYS)


def test_fast_figures_equal_memory_stats_after_random_ops(raw, device):
    rng = random.Random(16)
    live: list[tuple[int, int, int]] = []
    sizes = [0, 100, 5000, 70_000, 1 << 20, LARGE, 50 << 20, 1 << 30]
    assert_fast_equals_stats(device, "untouched")
    for op in range(1500):
        r = rng.randrange(100)
        if r < 45 or not live:
            size, stream = rng.choice(sizes), rng.choice([STREAM, OTHER_STREAM])
            p = raw.malloc(size, device, stream)
            if p:
                live.append((p, size, stream))
        elif r < 88:
            p, size, stream = live.pop(rng.randrange(len(live)))
            raw.free(p, size, device, stream)
        elif r < 91:
            raw.record_stream(rng.choice(live)[0], OTHER_STREAM if rng.random() < 0.5 else STREAM)
        elif r < 93:
            goalloc.empty_cache(device)
        elif r < 95:
            goalloc.reset_peak_memory_stats(device)
        elif r < 97:
            goalloc.reset_accumulated_memory_stats(device)
        else:
            goalloc.set_memory_fraction(rng.uniform(0.05, 1.0), device)
        assert_fast_equals_stats(device, f"op {op}")
    for p, size, stream in live:
        raw.free(p, size, device, stream)
    goalloc.empty_cache(device)
    assert_fast_equals_stats(device, "drained")
    assert goalloc.memory_reserved(device) == 0


def test_reset_peak_memory_stats_resets_the_fast_figures(raw, device):
    p = raw.must_malloc(4 * LARGE, device)
    raw.free(p, 4 * LARGE, device)
    q = raw.must_malloc(LARGE, device)
    assert goalloc.max_memory_allocated(device) == 12_000_256  # 4 * LARGE rounded
    # The miss gave the cached 12 MB block back to the device (miss_release),
    # which placed the new block in it: goalloc's own count fell, the device
    # still holds what it held for the 12 MB.
    own = goalloc.memory_stats(device)
    assert own["goalloc.own_reserved_bytes.peak"] > own["goalloc.own_reserved_bytes.current"] == BLOCK
    assert goalloc.max_memory_reserved(device) == goalloc.memory_reserved(device) == device_holds(12_000_256)
    r = raw.must_malloc(16 * LARGE, device)  # 48 MB more, placed after the 3 MB block
    raw.free(r, 16 * LARGE, device)
    goalloc.empty_cache(device)  # and gives it back
    assert goalloc.max_memory_reserved(device) == device_holds(BLOCK + 48_000_256)
    goalloc.reset_peak_memory_stats(device)
    assert goalloc.max_memory_allocated(device) == goalloc.memory_allocated(device) == BLOCK
    assert goalloc.max_memory_reserved(device) == goalloc.memory_reserved(device) == device_holds(BLOCK)
    raw.free(q, LARGE, device)


def test_bad_devices_are_caught_before_the_library(device):
    before = goalloc.memory_stats(0).get("goalloc.bad_input.bad_device", 0)
    for bad in (goalloc.device_count(), 10_000, -1):
        with pytest.raises(ValueError, match=f"device {bad} does not exist"):
            goalloc.memory_allocated(bad)
    with pytest.raises(TypeError, match="device must be"):
        goalloc.max_memory_reserved(True)
    with pytest.raises(ValueError, match="CUDA devices only"):
        goalloc.memory_reserved("cpu")
    assert goalloc.memory_stats(0).get("goalloc.bad_input.bad_device", 0) == before
    assert goalloc.memory_allocated(f"cuda:{device}") == goalloc.memory_allocated(device)


@pytest.mark.filterwarnings("ignore::goalloc.GoallocWarning")  # the library also warns of them: expected
def test_library_refusals_carry_its_message():
    """goalloc_stat's -1 becomes the library's own message, and its kind
    (bad_argument) a ValueError (the calls above ask the library about the
    device first, without using it; a C caller or a bad key reaches this)."""
    with pytest.raises(ValueError, match="device 10000 does not exist"):
        _lib.stat(10_000, _lib.ALLOCATED)
    with pytest.raises(ValueError, match="statistic 4 does not exist"):
        _lib.stat(0, len(_lib.STAT_KEYS))
    with pytest.raises(ValueError, match="device -1 does not exist"):
        _lib.stat_scalars(-1)


def test_fast_figures_cost_microseconds_not_a_json_dict(raw, device):
    """A loose bound, for a shared CI machine: the JSON path took over 100 us
    a call; the fast one takes about 1 us (BENCHMARKS.md has the figures)."""
    raw.must_malloc(LARGE, device)
    for fn in FAST.values():
        best = min(timeit.repeat(lambda: fn(device), number=2000, repeat=5)) / 2000
        assert best < 20e-6, f"{fn.__name__} took {best * 1e6:.1f} us a call"


# --- the default device -----------------------------------------------------------

def fake_torch(current: int, initialized: bool = True) -> types.ModuleType:
    """Enough of torch for goalloc's current-device question."""
    torch = types.ModuleType("torch")
    torch.cuda = SimpleNamespace(is_initialized=lambda: initialized, current_device=lambda: current)  # type: ignore[attr-defined]
    return torch


def test_default_device_is_torchs_current_device(monkeypatch, raw, device):
    p = raw.must_malloc(LARGE, device)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(device))
    assert goalloc.memory_allocated() == goalloc.max_memory_allocated() == BLOCK
    assert goalloc.memory_reserved() == goalloc.max_memory_reserved() == device_holds(BLOCK)
    assert goalloc.memory_stats()["allocated_bytes.all.current"] == BLOCK
    assert goalloc.fragmentation().free_bytes == 0
    assert f"device ID {device}" in goalloc.memory_summary()
    raw.free(p, LARGE, device)
    goalloc.reset_peak_memory_stats()
    assert goalloc.max_memory_allocated(device) == 0
    goalloc.reset_accumulated_memory_stats()
    assert goalloc.memory_stats(device)["allocated_bytes.all.freed"] == 0
    goalloc.set_memory_fraction(0.5)
    assert goalloc.config()["limits"][str(device)] == 4 << 30  # half of the 8G simulated device

    # Before torch starts CUDA, asking it would start CUDA: device 0.
    monkeypatch.setitem(sys.modules, "torch", fake_torch(device, initialized=False))
    assert goalloc.memory_reserved() == goalloc.memory_reserved(0) == 0


def test_default_device_without_torch_is_0(monkeypatch, raw, device):
    raw.must_malloc(LARGE, device)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails
    assert goalloc.memory_allocated() == goalloc.memory_allocated(0) == 0
    assert goalloc.memory_stats() == goalloc.memory_stats(0)


# --- torch.cuda's four functions after install() -----------------------------------

def stand_in_torch(current: int) -> types.ModuleType:
    """A module shaped like torch where patch_torch() looks: torch._C, and
    torch.cuda with its memory module, whose four functions are shared with
    torch.cuda as `from .memory import *` shares them."""
    torch = types.ModuleType("torch")
    torch._C = SimpleNamespace()  # type: ignore[attr-defined]
    memory = types.ModuleType("torch.cuda.memory")
    memory.is_initialized = lambda: True  # type: ignore[attr-defined]
    cuda = types.ModuleType("torch.cuda")
    cuda.memory = memory  # type: ignore[attr-defined]
    cuda.current_device = lambda: current  # type: ignore[attr-defined]
    cuda.is_initialized = lambda: True  # type: ignore[attr-defined]

    def get_device_index(device: Any, optional: bool = False) -> int:
        assert optional
        return int(str(device).partition(":")[2] or current)

    cuda._get_device_index = get_device_index  # type: ignore[attr-defined]
    for name in _torch._SCALARS:
        def original(device: Any = None, name: str = name) -> int:
            raise AssertionError(f"torch's own {name} was called")
        setattr(memory, name, original)
        setattr(cuda, name, original)
    torch.cuda = cuda  # type: ignore[attr-defined]
    return torch


def test_torch_scalars_answer_from_goalloc(monkeypatch, raw, device):
    torch = stand_in_torch(device)
    originals = {name: getattr(torch.cuda, name) for name in _torch._SCALARS}
    monkeypatch.setitem(sys.modules, "torch", torch)
    _torch.patch_torch(torch)
    try:
        p = raw.must_malloc(LARGE, device)
        for module in (torch.cuda, torch.cuda.memory):
            assert module.memory_allocated() == module.memory_allocated(device) == BLOCK
            assert module.max_memory_allocated(f"cuda:{device}") == BLOCK
            assert module.memory_reserved(device) == module.max_memory_reserved() == device_holds(BLOCK)
        raw.free(p, LARGE, device)
        torch._C._cuda_resetPeakMemoryStats(device)  # what torch.cuda.reset_peak_memory_stats calls
        assert torch.cuda.max_memory_allocated() == 0
        assert torch.cuda.max_memory_reserved() == device_holds(BLOCK)  # the block stays cached
        with pytest.raises(ValueError, match="device 10000 does not exist"):
            torch.cuda.memory_allocated(10_000)
        torch.cuda.memory.is_initialized = lambda: False  # as torch: {} before CUDA starts
        assert torch.cuda.memory_reserved(device) == 0
    finally:
        _torch.unpatch_torch(torch)
    for name, fn in originals.items():
        assert getattr(torch.cuda, name) is fn
        assert getattr(torch.cuda.memory, name) is fn
