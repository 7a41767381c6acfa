"""Bad arguments give clear Python errors, and never a crash or a silent default."""

from __future__ import annotations

import math
import warnings

import pytest

import goalloc


@pytest.mark.parametrize("fraction", [-0.5, -1e-300, 1.5, math.nan, math.inf, -math.inf])
def test_fraction_outside_zero_one_is_a_value_error(fraction):
    with warnings.catch_warnings():
        # The library also warns of the first one (once per kind): expected.
        warnings.simplefilter("ignore", goalloc.GoallocWarning)
        with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
            goalloc.set_memory_fraction(fraction, 1)


@pytest.mark.parametrize("fraction", ["0.5", None, True])
def test_fraction_that_is_not_a_number_is_a_type_error(fraction):
    with pytest.raises(TypeError, match="memory fraction"):
        goalloc.set_memory_fraction(fraction, 1)


@pytest.mark.parametrize("device", [-1, 64, 99])
def test_device_that_does_not_exist_is_a_value_error(device):
    with pytest.raises(ValueError, match=f"device {device} does not exist \\(64 sim devices"):
        goalloc.memory_stats(device)


@pytest.mark.parametrize("call", [
    lambda d: goalloc.memory_allocated(d),
    lambda d: goalloc.max_memory_reserved(d),
    lambda d: goalloc.reset_peak_memory_stats(d),
    lambda d: goalloc.empty_cache(d),
    lambda d: goalloc.set_memory_fraction(0.5, d),
    lambda d: goalloc.fragmentation(d),
    lambda d: goalloc.memory_summary(d),
])
def test_every_device_argument_is_checked(call):
    with pytest.raises(ValueError, match="device 99 does not exist"):
        call(99)


@pytest.mark.parametrize("device, error, text", [
    ("cpu", ValueError, "CUDA devices only"),
    ("cuda:x", ValueError, "is not a device"),
    (1.5, TypeError, "device must be"),
    (True, TypeError, "device must be"),
])
def test_device_of_the_wrong_kind(device, error, text):
    with pytest.raises(error, match=text):
        goalloc.memory_stats(device)


def test_bad_device_does_not_reach_the_library():
    """Python checks first, so the library prints no warning and counts nothing."""
    before = goalloc.memory_stats(0).get("goalloc.bad_input.bad_device", 0)
    with pytest.raises(ValueError):
        goalloc.memory_stats(99)
    assert goalloc.memory_stats(0).get("goalloc.bad_input.bad_device", 0) == before


@pytest.mark.parametrize("conf, named", [
    ("fraction:2", "fraction"),
    ("reserve:1", "reserve"),
    ("large_cache:lots", "large_cache"),
    ("quiet:perhaps", "quiet"),
    ("bogus:1", '"bogus"'),
    ("fraction", '"fraction" is not key:value'),
    ("fraction:0.5,fraction:0.6", "given twice"),
    ("reserve:0.5,fraction:0.25", "reserve:0.5 is above fraction:0.25"),  # could never be pre-warmed
])
def test_bad_conf_is_a_value_error_naming_the_key(conf, named):
    with pytest.raises(ValueError, match="GOALLOC_CONF") as e:
        goalloc.configure(conf)
    assert named in str(e.value)


def test_unknown_conf_key_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        goalloc.configure("fractoin:0.5")
    known = ", ".join(sorted(goalloc.config()["keys"]))
    assert f"(known: {known})" in str(e.value)


def test_conf_must_be_a_string():
    with pytest.raises(TypeError, match="conf must be a string"):
        goalloc.configure(0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("entries", [0, -1, (1 << 20) + 1, 1 << 27])
def test_history_size_out_of_range(entries):
    with warnings.catch_warnings():
        # The library, whose rule the bound is, also warns of the first one: expected.
        warnings.simplefilter("ignore", goalloc.GoallocWarning)
        with pytest.raises(ValueError, match="max_entries"):
            goalloc.record_history(True, max_entries=entries)


def test_history_arguments_of_the_wrong_type():
    with pytest.raises(TypeError, match="enabled must be True or False"):
        goalloc.record_history("yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_entries must be an int"):
        goalloc.record_history(True, max_entries=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [10**400, -10**400], ids=["10**400", "-10**400"])
def test_fraction_beyond_a_double_is_a_value_error(fraction):
    """Not Python's OverflowError: the library's own message, as for 1.5."""
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        goalloc.set_memory_fraction(fraction, 1)


@pytest.mark.parametrize("fraction", [0, 0.0])
def test_fraction_zero_refuses_everything_as_in_pytorch(raw, device, fraction):
    """torch.cuda.set_per_process_memory_fraction(0.0) is allowed, and reads back."""
    goalloc.set_memory_fraction(fraction, device)
    assert goalloc.config()["fractions"][str(device)] == 0
    assert raw.malloc(512, device) == 0
    goalloc.set_memory_fraction(1.0, device)
    p = raw.malloc(512, device)
    assert p != 0
    raw.free(p, 512, device)


def test_tiny_fraction_is_a_cap_and_shows_before_the_device_exists(raw, device):
    goalloc.set_memory_fraction(1e-12, device)   # 8 GiB x 1e-12 rounds to 0 bytes
    assert goalloc.config()["fractions"][str(device)] == 1e-12
    assert raw.malloc(1 << 30, device) == 0, "a cap is a cap, however small"
    assert goalloc.memory_allocated(device) == 0


def test_device_with_a_non_ascii_digit_is_a_value_error():
    """'²'.isdigit() is True, but int('²') fails: the message must be goalloc's."""
    with pytest.raises(ValueError, match="is not a device"):
        goalloc.memory_stats("cuda:²")


def test_conf_with_a_nul_is_refused():
    """C would read 'fraction:0.5' and drop the rest unseen."""
    with pytest.raises(ValueError, match="NUL"):
        goalloc.configure("fraction:0.5\0garbage")


@pytest.mark.parametrize("path", [2, True, None, 1.5])
def test_dump_snapshot_takes_paths_only(path):
    """An int would be a file descriptor: 2 would write the pickle into stderr."""
    with pytest.raises(TypeError, match="takes a path"):
        goalloc.dump_snapshot(path)  # type: ignore[arg-type]


@pytest.mark.parametrize("abbreviated", ["yes", 1, None])
def test_memory_summary_abbreviated_must_be_a_bool(abbreviated):
    with pytest.raises(TypeError, match="abbreviated must be True or False"):
        goalloc.memory_summary(0, abbreviated=abbreviated)  # type: ignore[arg-type]


def test_history_bound_is_the_librarys():
    """The bound keeps a snapshot near 1.4 GiB a device (2^26 entries needed
    about 90 GB); Python's copy of it must be the library's."""
    from goalloc import _lib

    assert _lib.MAX_HISTORY_ENTRIES == goalloc.config()["max_history"] == 1 << 20
