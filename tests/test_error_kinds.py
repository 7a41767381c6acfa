"""The library's error kinds choose Python's exception types; its messages
are only carried, never parsed."""

from __future__ import annotations

import warnings

import pytest

import goalloc
from goalloc import GoallocError, OutOfMemoryError, _lib


def test_python_knows_the_librarys_kinds_by_number():
    assert list(_lib.ERROR_KINDS) == goalloc.config()["error_kinds"]


@pytest.mark.parametrize("kind, message, error", [
    # Messages that the old text-parsing would have got wrong either way.
    ("out_of_memory", "goalloc: not initialised: GOALLOC_CONF looks like a setting, but is not one", OutOfMemoryError),
    ("bad_state", "goalloc: wake_up: nothing is asleep on device 0", GoallocError),
    ("failed", "GOALLOC_DEVICE=sim, and yet the driver failed", GoallocError),
    ("too_late", "GOALLOC_SIM_MEMORY read too late", GoallocError),
    ("bad_config", "goalloc: something about the configuration", ValueError),
    ("bad_argument", "goalloc: no word of memory fractions here", ValueError),
    ("none", "GOALLOC_CONF", GoallocError),
])
def test_the_kind_alone_chooses_the_exception(monkeypatch, kind, message, error):
    monkeypatch.setattr(_lib, "last_error", lambda: message)
    monkeypatch.setattr(_lib, "last_error_kind", lambda: kind)
    e = _lib._error("a call")
    # (Where torch is loaded, out_of_memory's class is also torch's: its own subclass.)
    assert type(e) is error or (error is OutOfMemoryError and isinstance(e, error))
    assert str(e) == message, "the library's message, unchanged"


def test_out_of_memory_has_its_kind(raw, device):
    assert raw.malloc(1 << 40, device) == 0
    assert _lib.last_error_kind() == "out_of_memory", _lib.last_error()
    e = _lib._error("malloc")
    assert isinstance(e, OutOfMemoryError) and isinstance(e, GoallocError)


def test_configure_after_the_first_allocation_is_too_late(raw, device):
    p = raw.must_malloc(1 << 20, device)
    with pytest.raises(GoallocError, match="configure after the first allocation"):
        goalloc.configure("fraction:0.5")
    assert _lib.last_error_kind() == "too_late"
    raw.free(p, 1 << 20, device)


@pytest.mark.parametrize("call, kind", [
    (lambda: goalloc.configure("bogus:1"), "bad_config"),
    (lambda: goalloc.memory_stats(99), "bad_argument"),
    (lambda: goalloc.memory_allocated(-1), "bad_argument"),
    (lambda: goalloc.set_memory_fraction(1.5, 1), "bad_argument"),
    (lambda: goalloc.record_history(True, max_entries=(1 << 20) + 1), "bad_argument"),
])
def test_each_refusal_is_a_value_error_of_its_kind(call, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", goalloc.GoallocWarning)  # the library's once-per-kind warnings
        with pytest.raises(ValueError):
            call()
    assert _lib.last_error_kind() == kind


@pytest.mark.parametrize("device", [1 << 31, -(1 << 31) - 1, 10**30])
def test_device_beyond_a_c_int_is_a_value_error(device):
    """ctypes cannot pass it; its own error would not say what is wrong."""
    with pytest.raises(ValueError, match=f"device {device} does not exist"):
        goalloc.memory_stats(device)
    with pytest.raises(ValueError, match=f"device {device} does not exist"):
        goalloc.memory_allocated(device)


@pytest.mark.parametrize("entries", [1 << 31, -(1 << 40)])
def test_history_size_beyond_a_c_int_is_a_value_error(entries):
    with pytest.raises(ValueError, match="max_entries"):
        goalloc.record_history(True, max_entries=entries)


def test_readme_lists_the_librarys_kinds():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", readme, re.M)
    assert [name for _, name in rows] == goalloc.config()["error_kinds"]
    assert [int(n) for n, _ in rows] == list(range(len(rows)))
