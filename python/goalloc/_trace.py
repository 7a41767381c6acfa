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
import re
import sys
import time
import warnings
from types import TracebackType
from typing import Any, Iterator, Optional, Union

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
            history = read_history(self.device)
        finally:
            # Put history recording back as it was (on again starts afresh).
            _lib.record_history(previous or 0)
        self._write(history, time.time() - self._start)

    def _write(self, history: "History", seconds: float) -> None:
        if history.count >= self.max_entries:
            warnings.warn(
                f"goalloc.record_trace: the history filled its ring of max_entries={self.max_entries} events, "
                f"so its oldest events are gone; the trace holds the last {history.count} and starts from the "
                f"state they imply. Pass a larger max_entries to keep them all.", RuntimeWarning, stacklevel=3)
        start = history.scan()
        t0 = min(int(self._start * 1e6), start.first_time)
        header = {
            "workload": self.workload, "torch": _torch_version(), "gpu": _gpu_name(self.device),
            "allocator": "goalloc", "device": self.device, "events": start.lines, "seconds": seconds,
            # goalloc's own peaks over the recording: reserved bytes, and the
            # bytes its live requests asked for. The trace format's
            # max_reserved / max_allocated are PyTorch's native allocator's
            # figures, which a goalloc run does not have.
            "goalloc_max_reserved": start.peak_reserved, "goalloc_max_requested": start.peak_requested,
            # What the device held at most by the end of the recording
            # (memory_stats' reserved_bytes.all.peak, since the process
            # began or the last reset of the peaks): the figure a replay of
            # the trace predicts, when the recording starts with the process.
            "goalloc_reserved_peak": _lib.stat(self.device, _lib.RESERVED_PEAK),
        }
        opener = gzip.open if self.path.endswith(".gz") else open
        with opener(self.path, "wt", encoding="utf-8") as f:  # type: ignore[operator]
            f.write(json.dumps(header) + "\n")
            for a, (size, stream) in sorted(start.segments.items()):
                f.write(_line("segment_alloc", a, size, stream, t0))
            for a, (size, stream) in sorted(start.blocks.items()):
                f.write(_line("alloc", a, size, stream, t0))
            for action, addr, size, stream, t in history.entries():
                if action in TRACE_ACTIONS:
                    f.write(_line(action, addr, size, stream, t))
        self.events = start.lines
        self.initial_blocks = len(start.blocks)


def _line(action: str, addr: int, size: int, stream: int, t: int) -> str:
    # The exact layout the replay's fast path reads (replay/parse.go).
    return f'{{"a": "{action}", "addr": {addr}, "size": {size}, "stream": {stream}, "t": {t}}}\n'


#: One history entry as goalloc_snapshot_json writes it (encoding/json, the
#: fields of caching.TraceJSON in order; those after frames only when set,
#: by goalloc's C++ class).
_ENTRY = re.compile(r'\{"action":"([a-z_]+)","addr":(\d+),"size":(\d+),"stream":(\d+),"time_us":(-?\d+),"frames":\[\]'
                    r'(?:,"ctx":\d+)?(?:,"compile_context":"(?:[^"\\]|\\.)*")?(?:,"user_metadata":"(?:[^"\\]|\\.)*")?\}')

Entry = tuple[str, int, int, int, int]  # action, addr, size, stream, time_us


class History:
    """A device's history and segments, read from goalloc_snapshot_json.

    A history of a million events is about 100 MB of JSON; decoded into
    dicts it would take over a gigabyte of Python memory. So the events are
    read from the text as they are needed, by a pattern for the library's own
    layout, and only the segments are decoded. Should the text not be in
    that layout, the whole of it is decoded instead."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._list: Optional[list[Entry]] = None
        self._at = text.find('"device_traces":')
        self.count = text.count('"action":')
        if self._at >= 0:
            try:
                (head,) = json.loads(text[:self._at].rstrip().rstrip(",") + "}]")
                self.segments: list[dict[str, Any]] = head.get("segments") or []
                if sum(1 for _ in _ENTRY.finditer(text, self._at)) == self.count:
                    return
            except ValueError:
                pass
        (snap,) = json.loads(text)
        self.segments = snap.get("segments") or []
        self._list = [(e["action"], e["addr"], e["size"], e["stream"], e["time_us"])
                      for e in snap.get("device_traces") or []]
        self.count = len(self._list)

    def entries(self) -> Iterator[Entry]:
        """The events, oldest first."""
        if self._list is not None:
            return iter(self._list)
        return ((m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in _ENTRY.finditer(self._text, self._at))

    def scan(self) -> "Start":
        """The state the history starts from, and its figures."""
        return Start(self.entries(), self.segments)


def read_history(device: int) -> History:
    text = _lib._take_string(_lib.lib().goalloc_snapshot_json(device))
    if text is None:
        raise _lib._error("snapshot")
    return History(text)


class Start:
    """What one pass over a history finds: the segments and blocks live
    before its first event, each {address: (size, stream)}: those it frees
    without taking them, and those the segments (at the end) show live that
    it never names; and goalloc's peaks over it. A block's size is the size
    asked for, as in the history's events. Raises GoallocError for a
    history that contradicts itself."""

    def __init__(self, entries: Iterator[Entry], segments: list[dict[str, Any]]) -> None:
        live: set[int] = set()
        named: set[int] = set()
        self.blocks: dict[int, tuple[int, int]] = {}
        segs: set[int] = set()
        seg_named: set[int] = set()
        self.segments: dict[int, tuple[int, int]] = {}
        # Reserved and requested bytes relative to the start, and their peaks.
        reserved = requested = top_reserved = top_requested = 0
        self.lines = 0
        self.first_time = 1 << 62
        for i, (action, addr, size, stream, t) in enumerate(entries):
            self.first_time = min(self.first_time, t)
            if action in TRACE_ACTIONS:
                self.lines += 1
            if action == "alloc":
                if addr in live:
                    raise _lib.GoallocError(f"goalloc.record_trace: history entry {i} allocates {addr:#x}, which is live")
                live.add(addr)
                named.add(addr)
                requested += size
            elif action in ("free_requested", "free_completed"):
                if addr not in live:
                    if addr in named:
                        raise _lib.GoallocError(f"goalloc.record_trace: history entry {i} frees {addr:#x} twice")
                    self.blocks[addr] = (size, stream)
                    live.add(addr)
                named.add(addr)
                if action == "free_completed":
                    live.discard(addr)
                    requested -= size  # the free names the size its alloc did
            elif action == "segment_alloc":
                segs.add(addr)
                seg_named.add(addr)
                reserved += size
            elif action == "segment_free":
                if addr not in seg_named:
                    self.segments[addr] = (size, stream)
                segs.discard(addr)
                seg_named.add(addr)
                reserved -= size
            top_reserved, top_requested = max(top_reserved, reserved), max(top_requested, requested)
        for seg in segments:
            if seg["address"] not in seg_named:
                self.segments[seg["address"]] = (seg["total_size"], seg["stream"])
            for b in seg.get("blocks") or []:
                if b["state"] in _LIVE_STATES and b["address"] not in named:
                    self.blocks[b["address"]] = (b["requested_size"], seg["stream"])
        self.lines += len(self.segments) + len(self.blocks)
        self.peak_reserved = sum(s for s, _ in self.segments.values()) + top_reserved
        self.peak_requested = sum(s for s, _ in self.blocks.values()) + top_requested


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
