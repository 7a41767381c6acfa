"""goalloc: a CUDA memory allocator for PyTorch, written in Go.

One line at the top of a training script makes it torch's allocator::

    import torch, goalloc
    goalloc.install()

After that torch.cuda.memory_allocated(), memory_stats(), memory_summary()
and the rest answer from goalloc. The functions here read the same figures
directly, plus goalloc's own (cache hits, fragmentation), and work without
torch: they only need the bundled libgoalloc.so.

Devices are given as torch gives them: an int, a torch.device or a string
such as "cuda:1"; None means torch's current device (0 while torch has not
started CUDA).
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from . import _lib, _snapshot, _summary, _torch, _trace
from ._lib import GoallocError, OutOfMemoryError, library_path
from ._warnings import GoallocWarning

__version__ = "0.1.0"

__all__ = [
    "GoallocError",
    "OutOfMemoryError",
    "GoallocWarning",
    "Fragmentation",
    "install",
    "mempool",
    "configure",
    "config",
    "device_count",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
    "empty_cache",
    "set_memory_fraction",
    "fragmentation",
    "snapshot",
    "dump_snapshot",
    "record_history",
    "record_trace",
    "memory_tag",
    "sleep",
    "wake_up",
    "sleep_state",
    "prepare_sleep",
    "current_memory_tag",
    "SleepResult",
    "WakeResult",
    "library_path",
]

#: A device as torch takes it: int, torch.device, "cuda:N", or None (current).
Device = Union[int, str, Any, None]

#: History size record_history() keeps by default: about 40 bytes an entry
#: per device in the library, about 1.4 KB each while snapshot() builds its
#: dicts (100,000 entries grew a process by 139 MiB). At most 2^20.
DEFAULT_HISTORY_ENTRIES = 100_000


# --- devices and arguments ----------------------------------------------------

def _device_index(device: Device) -> int:
    """Turn a torch-style device into an index goalloc has, or raise
    TypeError or ValueError. Whether the device exists is the library's rule
    (_lib.check_device)."""
    if device is None:
        index = _torch.current_device()
    elif isinstance(device, bool):
        raise TypeError(f"goalloc: device must be an int, a torch.device or 'cuda:N', not {device!r}")
    elif isinstance(device, str) or hasattr(device, "type"):
        kind, index_or_none = _parse_device(device)
        if kind != "cuda":
            raise ValueError(f"goalloc: manages CUDA devices only, not {str(device)!r}")
        if index_or_none is None:
            index = _torch.current_device()
        else:
            index = index_or_none
    else:
        try:
            index = operator.index(device)
        except TypeError:
            raise TypeError(
                f"goalloc: device must be an int, a torch.device or 'cuda:N', not {device!r}"
            ) from None
    return _c_device(index)


def _c_device(index: int) -> int:
    """index, if the library says the device exists. An index beyond a C int
    cannot be passed to ask (ctypes refuses it, with its own message) and
    names no device either."""
    if index in _lib._existing_devices:  # the library has said so: the per-step path
        return index
    if not _lib.fits_c_int(index):
        raise ValueError(f"goalloc: device {index} does not exist (a device is a C int)")
    return _lib.check_device(index)


def _stat_device(device: Device) -> int:
    """_device_index, with the shortest path for an int the library has
    already said exists: the per-step statistics cost about a microsecond,
    and a training loop may call them every step."""
    if type(device) is int and device in _lib._existing_devices:
        return device
    return _device_index(device)


def _parse_device(device: Any) -> tuple[str, Optional[int]]:
    """('cuda', 1) from 'cuda:1' or torch.device('cuda', 1); index None if not given."""
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if not idx:
            return kind, None
        if not (idx.isascii() and idx.isdigit()):  # not "²", which isdigit() takes
            raise ValueError(f"goalloc: {device!r} is not a device; use 'cuda' or 'cuda:N'")
        return kind, int(idx)
    return str(device.type), device.index


def _fraction_argument(fraction: Any) -> float:
    """fraction as a C double. Its range, [0, 1], is the library's rule,
    checked there (caching.CheckFraction) with the message a user reads."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"goalloc: memory fraction must be a number in [0, 1], not {fraction!r}")
    try:
        return float(fraction)
    except OverflowError:  # an int beyond any double: out of range, as infinity is
        return math.inf if fraction > 0 else -math.inf


# --- torch integration ----------------------------------------------------------

def install(conf: Optional[str] = None) -> Any:
    """Make goalloc torch's CUDA allocator, and return torch's allocator object.

    goalloc's C++ allocator class is used where it can be built (once per
    torch version; see goalloc._cxx); otherwise, after one warning, torch's
    CUDAPluggableAllocator over the library.

    Call it before anything starts CUDA (at the top of the script): torch
    cannot swap an allocator it has used. conf is a GOALLOC_CONF string such
    as "fraction:0.9,reserve:0.1"; None keeps the GOALLOC_CONF environment
    variable. On the pluggable path it sets torch's four allocator hooks (init, empty_cache,
    set_per_process_memory_fraction, record_stream), so those torch calls
    reach goalloc, and the CUDA graph pool hooks where the library has
    them, and points torch.cuda.memory_stats() and its family at
    goalloc. Calling it again returns the same allocator.

    Raises ValueError for a bad conf (before torch is touched), ImportError
    without torch, RuntimeError without CUDA or after CUDA has started.
    """
    from . import _torch

    return _torch.install(conf)


def mempool(conf: Optional[str] = None) -> Any:
    """A torch.cuda.MemPool whose memory comes from goalloc.

    For `with torch.cuda.use_mem_pool(pool):`, which routes the allocations
    made inside the block to goalloc while torch's own allocator keeps
    serving the rest; unlike install(), it works after CUDA has started.
    torch's caching allocator still carves the pool's segments, so
    torch.cuda.memory_stats() keeps reporting torch's figures and
    goalloc.memory_stats() shows the segments goalloc handed out.
    """
    from . import _torch

    return _torch.mempool(conf)


# --- configuration --------------------------------------------------------------

def configure(conf: str) -> None:
    """Set the configuration (GOALLOC_CONF syntax), replacing the environment's.

    Only before the first allocation: the caches are built from it. A bad
    key or value raises ValueError naming it.
    """
    if not isinstance(conf, str):
        raise TypeError(f"goalloc: conf must be a string like 'fraction:0.8', not {type(conf).__name__}")
    if "\0" in conf:  # C would read only up to it and drop the rest unseen
        raise ValueError(f"goalloc: conf {conf!r} contains a NUL character")
    _lib.configure(conf)


def config() -> dict[str, Any]:
    """The configuration in force, the device kind (cuda or sim) and count,
    per-device caps in bytes ("limits", devices made so far) and the
    fractions set_memory_fraction() set ("fractions", made or not), the
    history size and its bound ("max_history"), every GOALLOC_CONF key
    with what it means, and the names of the library's error kinds
    ("error_kinds", by number)."""
    return _lib.config()


def device_count() -> int:
    """How many devices goalloc serves."""
    return _lib.device_count()


# --- statistics -------------------------------------------------------------------

def memory_stats(device: Device = None) -> dict[str, int]:
    """Every statistic of a device, under torch.cuda.memory_stats()'s key names
    ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
    "num_ooms", ...), plus goalloc's own under "goalloc." (cache hits and
    misses, deferred frees, bad input by kind). Keys are sorted; a device
    goalloc has not used yet reads as zeros."""
    return _lib.stats(_device_index(device))


# The four per-step figures are read with atomic loads, without the
# allocator's lock and without building memory_stats(): about a microsecond
# a call (BENCHMARKS.md). They are the figures as of the last allocator call
# that completed.

def memory_allocated(device: Device = None) -> int:
    """Bytes held by live allocations (their block sizes), like torch's."""
    return _lib.stat(_stat_device(device), _lib.ALLOCATED)


def max_memory_allocated(device: Device = None) -> int:
    """Peak of memory_allocated() since the start or the last reset."""
    return _lib.stat(_stat_device(device), _lib.ALLOCATED_PEAK)


def memory_reserved(device: Device = None) -> int:
    """Bytes the device holds for goalloc, which the cap bounds: the physical
    memory mapped (backend:vmm, the default), or the driver pool's own
    reserved figure (backend:async)."""
    return _lib.stat(_stat_device(device), _lib.RESERVED)


def max_memory_reserved(device: Device = None) -> int:
    """Peak of memory_reserved() since the start or the last reset."""
    return _lib.stat(_stat_device(device), _lib.RESERVED_PEAK)


def reset_peak_memory_stats(device: Device = None) -> None:
    """Set every peak to its current value, e.g. to measure one training step."""
    _lib.reset_peak(_device_index(device))


def reset_accumulated_memory_stats(device: Device = None) -> None:
    """Zero the running totals (the .allocated/.freed figures) and the counters."""
    _lib.reset_accumulated(_device_index(device))


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """The statistics of a device as a table, in the layout of
    torch.cuda.memory_summary(), followed by goalloc's own figures."""
    if not isinstance(abbreviated, bool):
        raise TypeError(f"goalloc: abbreviated must be True or False, not {abbreviated!r}")
    d = _device_index(device)
    return _summary.format_summary(_lib.stats(d), _lib.fragmentation(d), d, abbreviated)


def empty_cache(device: Device = None) -> None:
    """Give cached memory back to the driver: every device when device is None
    (what torch.cuda.empty_cache() does), else that device. Waits for the
    device first, as torch's does."""
    if device is None:
        for d in range(_lib.device_count()):
            _lib.empty_cache_device(d)
    else:
        _lib.empty_cache_device(_device_index(device))


def set_memory_fraction(fraction: float, device: Device = None) -> None:
    """Cap reserved memory at fraction x the device's memory, fraction in [0, 1]
    (0 refuses every allocation, as in PyTorch).

    The goalloc side of torch.cuda.set_per_process_memory_fraction(): past
    the cap an allocation fails (NULL to torch) after goalloc has given its
    cached memory back, and goalloc prints why on stderr. Lowering the cap
    releases cached memory at once.
    """
    f = _fraction_argument(fraction)
    _lib.set_fraction(_device_index(device), f)


@dataclass(frozen=True)
class Fragmentation:
    """How scattered a device's cached free memory is."""

    #: Cached memory not in use: free slots of small segments and cached large blocks.
    free_bytes: int
    #: The largest request the cache could serve from one free piece.
    largest_free_block: int
    #: 1 - largest_free_block / free_bytes: 0 when the free memory is one
    #: piece, near 1 when it is many small ones; 0 when nothing is free.
    ratio: float
    #: The driver pool's own reserved and used bytes.
    pool_reserved_bytes: int
    pool_used_bytes: int
    #: The pool's high-water marks since it was made or the last
    #: reset_peak_memory_stats: what the device had to map at most.
    pool_reserved_high_bytes: int = 0
    pool_used_high_bytes: int = 0
    #: On backend:vmm, what the device holds now, span by span: ``held``
    #: (pool_reserved_bytes) is ``live`` (goalloc's blocks and segments,
    #: in use or cached) + ``free_shared`` (free ends in handles shared with
    #: live memory) + ``free_whole`` + ``pending`` (freed on another stream,
    #: waiting for it); ``free_spans`` counts the free pieces;
    #: ``free_beside_small`` is the part of ``free_shared`` in handles shared
    #: with a live block under 1 MiB (a small block pinning a free end).
    #: None elsewhere.
    held_split: Optional[dict[str, int]] = None
    #: The same when held last reached its high-water mark
    #: (pool_reserved_high_bytes): what held the memory at the peak.
    held_split_at_peak: Optional[dict[str, int]] = None


def fragmentation(device: Device = None) -> Fragmentation:
    """Cached free bytes, the largest free cached block, and 1 - largest/free."""
    f = _lib.fragmentation(_device_index(device))
    return Fragmentation(
        free_bytes=f["free_bytes"],
        largest_free_block=f["largest_free_block"],
        ratio=f["fragmentation"],
        pool_reserved_bytes=f["pool_reserved_bytes"],
        pool_used_bytes=f["pool_used_bytes"],
        pool_reserved_high_bytes=f.get("pool_reserved_high_bytes", 0),
        pool_used_high_bytes=f.get("pool_used_high_bytes", 0),
        held_split=f.get("held"),
        held_split_at_peak=f.get("held_at_peak"),
    )


# --- snapshots and history ------------------------------------------------------

def record_history(enabled: bool = True, max_entries: int = DEFAULT_HISTORY_ENTRIES) -> None:
    """Turn recording of allocator events on (keeping the last max_entries per
    device) or off, on every device. Turning it on starts a fresh history.
    snapshot() then carries the events as device_traces. No stack traces are
    recorded."""
    if not isinstance(enabled, bool):
        raise TypeError(f"goalloc: enabled must be True or False, not {enabled!r}")
    if not enabled:
        _lib.record_history(0)
        return
    _lib.record_history(_history_entries(max_entries))


def _history_entries(max_entries: Any) -> int:
    """max_entries as a C int for a history that is on. Its upper bound is
    the library's rule, checked there; 0 is refused here because the C ABI
    reads it as "off", which record_history(True) does not mean."""
    if isinstance(max_entries, bool) or not isinstance(max_entries, numbers.Integral):
        raise TypeError(f"goalloc: max_entries must be an int, not {max_entries!r}")
    n = int(max_entries)
    if n == 0 or not _lib.fits_c_int(n):
        raise ValueError(f"goalloc: max_entries={n} is outside [1, {_lib.MAX_HISTORY_ENTRIES}]")
    return n


def snapshot() -> dict[str, Any]:
    """The state of every device in the structure of torch.cuda.memory._snapshot():
    {"segments": [...], "device_traces": [[device 0's events], ...]}. Each
    segment has its blocks (state active_allocated, active_pending_free or
    inactive); the traces are empty unless record_history() is on."""
    return _snapshot.to_torch(_lib.snapshot(-1))


def dump_snapshot(path: Union[str, os.PathLike[str]]) -> None:
    """Write snapshot() as a pickle that PyTorch's memory visualiser reads:
    python -m torch.cuda._memory_viz trace_plot PATH -o out.html"""
    if not isinstance(path, (str, os.PathLike)):
        # open() would take an int as a file descriptor (2 is stderr).
        raise TypeError(f"goalloc: dump_snapshot takes a path, not {path!r}")
    data = snapshot()
    with open(path, "wb") as f:
        # Protocol 4: the highest that the visualiser's JavaScript unpickler reads.
        pickle.dump(data, f, protocol=4)


def record_trace(path: Union[str, os.PathLike[str]], device: Device = 0,
                 max_entries: int = _trace.DEFAULT_TRACE_ENTRIES,
                 workload: Optional[str] = None) -> "_trace.TraceRecorder":
    """A context manager that records goalloc's allocations on device while
    it is open and then writes them to path in goalloc's trace format (JSON
    lines, gzipped when path ends in .gz), which `goalloc replay PATH` reads::

        with goalloc.record_trace("train.jsonl.gz"):
            train_a_few_steps()

    It uses the library's history (record_history(): on for every device
    while open, a ring of max_entries events, restarting any history being
    recorded; turned back as it was afterwards). Blocks already live when it
    opens are written first. workload names the run in the header (default:
    the script's name). The trace is written even if the block raises.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"goalloc: path must be a str or os.PathLike, not {type(path).__name__}")
    entries = _history_entries(max_entries)
    if workload is not None and not isinstance(workload, str):
        raise TypeError(f"goalloc: workload must be a str, not {type(workload).__name__}")
    return _trace.TraceRecorder(path, _device_index(device), entries, workload)


# --- memory tags, sleep and wake ------------------------------------------------
#
# For a process that alternates between two users of the GPU (an RL
# inference engine and a trainer): the memory of tagged allocations can be
# put to sleep, its physical memory released and its addresses kept, and
# woken again at the same addresses, the tags offloaded copied back, so that
# CUDA graphs and pointers stay valid. Names follow vLLM's CuMemAllocator.
# backend:vmm only (the default). The design: caching/sleep.go and Note
# [Sleep and wake] in arena/vmm_sleep.go.

_tag_stack = threading.local()


class memory_tag:
    """A context manager: allocations this thread makes inside carry the tag
    name (the innermost of nested tags), so that sleep() can release their
    memory and wake_up() bring it back at the same addresses. Untagged
    memory is never touched by sleep. An allocation of a CUDA graph capture,
    or one in a torch.cuda.MemPool, is not tagged; nor is one made on
    another thread (autograd's backward thread included). What torch
    allocates for itself inside the block is (the cuBLAS workspace of a
    stream's first matmul). Names are 1 to 64
    printable ASCII characters without spaces or commas::

        with goalloc.memory_tag("weights"):
            model = Model().cuda()
        with goalloc.memory_tag("kv_cache"):
            cache = torch.empty(...)
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"goalloc: a memory tag is a str, not {name!r}")
        if not name or "\0" in name:
            raise ValueError(f"goalloc: memory tag {name!r}: give a non-empty name without NUL")
        self.name = name

    def __enter__(self) -> "memory_tag":
        _lib.set_memory_tag(self.name)  # the library checks the name
        _tags_of_thread().append(self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = _tags_of_thread()
        stack.pop()
        _lib.set_memory_tag(stack[-1] if stack else "")


def _tags_of_thread() -> list[str]:
    stack: Optional[list[str]] = getattr(_tag_stack, "names", None)
    if stack is None:
        stack = _tag_stack.names = []
    return stack


def current_memory_tag() -> str:
    """The memory tag this thread's allocations carry now ("" for none)."""
    return _lib.memory_tag()


@dataclass(frozen=True)
class SleepResult:
    """What sleep() did."""

    #: Bytes of live tagged blocks copied to pinned host memory.
    offloaded_bytes: int
    #: Bytes of physical memory the devices hold less: memory_reserved()'s drop.
    released_bytes: int
    #: Seconds spent pinning the host memory the copies go to (the first
    #: sleep that offloads, or one that needs more than the last).
    prepare_seconds: float = field(default=0.0, compare=False)
    #: Seconds from the first copy to the host queued to the last complete
    #: (the work already queued on the memory included).
    offload_seconds: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class WakeResult:
    """What wake_up() did."""

    #: Bytes of physical memory mapped again for the tags woken.
    mapped_bytes: int
    #: Bytes copied back from the host.
    restored_bytes: int
    #: The tags woken.
    woken: tuple[str, ...]
    #: Seconds spent mapping physical memory again, and copying back.
    map_seconds: float = field(default=0.0, compare=False)
    restore_seconds: float = field(default=0.0, compare=False)


def _tag_names(tags: Union[str, Iterable[str]], what: str) -> str:
    """tags (a name, or names) as the library's comma-separated list."""
    names = [tags] if isinstance(tags, str) else list(tags)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"goalloc: {what} holds {n!r}, not a tag's name")
        if "\0" in n:
            raise ValueError(f"goalloc: {what}: tag {n!r} contains a NUL character")
    return ",".join(names)


def _every_device_or(device: Device) -> int:
    return -1 if device is None else _device_index(device)


def sleep(offload_tags: Union[str, Iterable[str]] = ("weights",), device: Device = None) -> SleepResult:
    """Put every memory tag's memory to sleep on device (None: every device
    goalloc has used): the live blocks of offload_tags are copied to pinned
    host memory, then the physical memory of every tagged block and of the
    free cache is released, the addresses kept. Waits for the work queued
    on that memory, not for the whole device. memory_reserved() drops by
    released_bytes; memory_allocated() does not (the tensors live on).

    Raises ValueError for a tag no allocation was ever tagged with,
    GoallocError for a sleep while anything is asleep or during a CUDA
    graph capture, and ValueError on backend:async, which cannot sleep.
    """
    r = _lib.sleep(_every_device_or(device), _tag_names(offload_tags, "offload_tags"))
    return SleepResult(offloaded_bytes=r["offloaded_bytes"], released_bytes=r["released_bytes"],
                       prepare_seconds=r["prepare_seconds"], offload_seconds=r["offload_seconds"])


def wake_up(tags: Union[str, Iterable[str], None] = None, device: Device = None) -> WakeResult:
    """Map the memory of tags (None: every tag asleep) again on device (None:
    every device where one is asleep), at the same addresses, and copy back
    what sleep() offloaded; a tag not offloaded comes back usable, its
    contents undefined. Each tag wakes whole or not at all, in order.

    Raises OutOfMemoryError (a torch.OutOfMemoryError where torch is loaded)
    when a tag does not fit: it and the tags after it stay asleep, so that
    the caller can free memory and call wake_up() again. GoallocError when
    nothing named is asleep.
    """
    names = None if tags is None else _tag_names(tags, "tags")
    if names == "":
        raise ValueError("goalloc: wake_up: tags names no tag; give None to wake every tag asleep")
    r = _lib.wake_up(_every_device_or(device), names)
    return WakeResult(mapped_bytes=r["mapped_bytes"], restored_bytes=r["restored_bytes"], woken=tuple(r["woken"]),
                      map_seconds=r["map_seconds"], restore_seconds=r["restore_seconds"])


def prepare_sleep(nbytes: int, device: Device = None) -> None:
    """Pin nbytes of host memory for sleep()'s offload now, on device (None:
    every device goalloc has used), so that the first sleep does not pin it
    itself (pinning touches every page: seconds for many GiB). Allocations
    from other threads go on while it pins, so it can run in a thread while
    the model loads; a later sleep that offloads more pins again. For the
    tags' memory as it is: sum(sleep_state()["tags"][t]["reserved_bytes"]
    for t in offload_tags).

    Raises TypeError for a non-int, ValueError for a negative size or one
    above 2**48 and on backend:async, GoallocError during a CUDA graph
    capture or while anything is asleep.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        raise TypeError(f"goalloc: prepare_sleep takes a number of bytes, not {nbytes!r}")
    if nbytes < 0 or nbytes >= 1 << 64:
        raise ValueError(f"goalloc: prepare_sleep of {nbytes} bytes")
    _lib.prepare_sleep(_every_device_or(device), int(nbytes))


def sleep_state(device: Device = None) -> dict[str, Any]:
    """A device's memory tags: {"tags": {name: {"reserved_bytes", "asleep"}},
    "asleep": [names], "offloaded_bytes" (host copies kept),
    "host_area_bytes" (pinned host memory kept for them, reused by the next
    sleep), "device"}."""
    return _lib.sleep_state(_device_index(device))
