"""goalloc.record_trace: record goalloc's trace format from a running program.

The trace format (traces/README.md, read by `goalloc replay`) is JSON lines:
a header object, then one event per line,

    {"a": "alloc", "addr": 140577299496960, "size": 512, "stream": 0, "t": 1795949109765507}

with the actions segment_alloc, alloc, free_requested and free_completed.
The events come from the library's own history (goalloc_record_history,
read back through goalloc_snapshot_json), the same ring that
goalloc.record_history() and torch's _record_memory_history() fill.

A trace must start from an empty allocator: every free names a block the
trace allocated. A recording that starts mid-run (the model is built, its
parameters live), or whose ring dropped its oldest events, does not. So the
blocks live at the start are written first, as allocations at the start
time: those the history frees without allocating them, and those the
snapshot at the end shows live that the history never names. That is the
state the history implies; nothing else about the time before it is known.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
import warnings
from types import TracebackType
from typing import Any, Optional, Union

from . import _lib

#: The actions the trace format has; the history's others (segment_free,
#: oom, snapshot) say nothing a replay uses and are left out.
TRACE_ACTIONS = ("segment_alloc", "alloc", "free_requested", "free_completed")

#: History ring record_trace() asks for by default: 40 bytes an entry in
#: the library, per device goalloc uses.
DEFAULT_TRACE_ENTRIES = 1_000_000

_LIVE_STATES = ("active_allocated", "active_pending_free")


class TraceRecorder:
    """What goalloc.record_trace() returns: a context manager that records
    the library's allocations on one device while it is open and writes the
    trace when it closes. After closing, `events` is the number of event
    lines written and `initial_blocks` the number of blocks found live at
    the start."""

    def __init__(self, path: Union[str, "os.PathLike[str]"], device: int, max_entries: int,
                 workload: Optional[str]) -> None:
        self.path = os.fspath(path)
        self.device = device
        self.max_entries = max_entries
        self.workload = workload if workload is not None else _default_workload()
        self.events = 0
        self.initial_blocks = 0
        self._previous_history: Optional[int] = None
        self._start = 0.0

    def __enter__(self) -> "TraceRecorder":
        if self._previous_history is not None:
            raise RuntimeError("goalloc: this record_trace() is already recording")
        previous = int(_lib.config().get("history") or 0)
        _lib.record_history(self.max_entries)
        self._previous_history = previous
        self._start = time.time()
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        # Written whatever happened inside: a trace up to a failure is what
        # one wants to replay. The exception, if any, goes on.
        previous, self._previous_history = self._previous_history, None
        try:
            (snap,) = _lib.snapshot(self.device)
        finally:
            # Put history recording back as it was (on again starts afresh).
            _lib.record_history(previous or 0)
        self._write(snap, time.time() - self._start)

    def _write(self, snap: dict[str, Any], seconds: float) -> None:
        entries = snap.get("device_traces") or []
        if len(entries) >= self.max_entries:
            warnings.warn(
                f"goalloc.record_trace: the history filled its ring of max_entries={self.max_entries} events, "
                f"so its oldest events are gone; the trace holds the last {len(entries)} and starts from the "
                f"state they imply. Pass a larger max_entries to keep them all.", RuntimeWarning, stacklevel=3)
        segments, blocks = initial_state(entries, snap.get("segments") or [])
        t0 = int(self._start * 1e6)
        if entries:
            t0 = min(t0, int(entries[0]["time_us"]))
        lines = [_line("segment_alloc", a, size, stream, t0) for a, (size, stream) in sorted(segments.items())]
        lines += [_line("alloc", a, size, stream, t0) for a, (size, stream) in sorted(blocks.items())]
        lines += [_line(e["action"], e["addr"], e["size"], e["stream"], e["time_us"])
                  for e in entries if e["action"] in TRACE_ACTIONS]
        reserved, allocated = _peaks(entries, segments, blocks)
        header = {
            "workload": self.workload, "torch": _torch_version(), "gpu": _gpu_name(self.device),
            "allocator": "goalloc", "device": self.device, "events": len(lines), "seconds": seconds,
            # goalloc's own peaks over the recording. The trace format's
            # max_reserved / max_allocated are PyTorch's native allocator's
            # figures, which a goalloc run does not have.
            "goalloc_max_reserved": reserved, "goalloc_max_allocated": allocated,
        }
        opener = gzip.open if self.path.endswith(".gz") else open
        with opener(self.path, "wt", encoding="utf-8") as f:  # type: ignore[operator]
            f.write(json.dumps(header) + "\n")
            for line in lines:
                f.write(line)
        self.events = len(lines)
        self.initial_blocks = len(blocks)


def _line(action: str, addr: int, size: int, stream: int, t: int) -> str:
    # The exact layout the replay's fast path reads (replay/parse.go).
    return f'{{"a": "{action}", "addr": {addr}, "size": {size}, "stream": {stream}, "t": {t}}}\n'


def initial_state(entries: list[dict[str, Any]], segments: list[dict[str, Any]]
                  ) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """The segments and blocks live before the first of entries, each
    {address: (size, stream)}: those the history frees without taking them,
    and those the segments (at the end) show live that the history never
    names. Raises GoallocError for a history that contradicts itself."""
    live: set[int] = set()
    named: set[int] = set()
    blocks: dict[int, tuple[int, int]] = {}
    segs: set[int] = set()
    seg_named: set[int] = set()
    first_segs: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(entries):
        action, addr = e["action"], e.get("addr")
        if action == "alloc":
            if addr in live:
                raise _lib.GoallocError(f"goalloc.record_trace: history entry {i} allocates {addr:#x}, which is live")
            live.add(addr)
            named.add(addr)
        elif action in ("free_requested", "free_completed"):
            if addr not in live:
                if addr in named:
                    raise _lib.GoallocError(f"goalloc.record_trace: history entry {i} frees {addr:#x} twice")
                blocks[addr] = (e["size"], e["stream"])
                live.add(addr)
            named.add(addr)
            if action == "free_completed":
                live.discard(addr)
        elif action == "segment_alloc":
            segs.add(addr)
            seg_named.add(addr)
        elif action == "segment_free":
            if addr not in segs and addr not in seg_named:
                first_segs[addr] = (e["size"], e["stream"])
            segs.discard(addr)
            seg_named.add(addr)
    for seg in segments:
        if seg["address"] not in seg_named:
            first_segs[seg["address"]] = (seg["total_size"], seg["stream"])
        for b in seg.get("blocks") or []:
            if b["state"] in _LIVE_STATES and b["address"] not in named:
                # goalloc's alloc events record the slot or block handed
                # out; so does a block's size.
                blocks[b["address"]] = (b["size"], seg["stream"])
    return first_segs, blocks


def _peaks(entries: list[dict[str, Any]], segments: dict[int, tuple[int, int]],
           blocks: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """goalloc's peak reserved and allocated bytes over the recording."""
    reserved = sum(s for s, _ in segments.values())
    allocated = sum(s for s, _ in blocks.values())
    sizes = {a: s for a, (s, _) in blocks.items()}
    peak_r, peak_a = reserved, allocated
    for e in entries:
        action = e["action"]
        if action == "segment_alloc":
            reserved += e["size"]
        elif action == "segment_free":
            reserved -= e["size"]
        elif action == "alloc":
            sizes[e["addr"]] = e["size"]
            allocated += e["size"]
        elif action == "free_completed":
            allocated -= sizes.pop(e["addr"], e["size"])
        peak_r, peak_a = max(peak_r, reserved), max(peak_a, allocated)
    return peak_r, peak_a


def _default_workload() -> str:
    main = sys.modules.get("__main__")
    name = getattr(main, "__file__", None)
    return os.path.splitext(os.path.basename(name))[0] if name else "python"


def _torch_version() -> str:
    # Only a torch the program imported: importing it here could start CUDA.
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "")) if torch is not None else ""


def _gpu_name(device: int) -> str:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and _lib.config().get("device") == "cuda" and torch.cuda.is_initialized():
            return str(torch.cuda.get_device_name(device))
    except Exception:  # the name is a courtesy; a trace without it is still a trace
        pass
    return "Simulated" if _lib.config().get("device") == "sim" else ""
