"""The library's snapshot JSON, reshaped as torch.cuda.memory._snapshot().

goalloc_snapshot_json(-1) gives one {device, segments, device_traces} object
per device; PyTorch's snapshot is one dict with every device's segments in a
single list (each segment names its device) and device_traces indexed by
device. PyTorch's memory visualiser (torch.cuda._memory_viz, and the
MemoryViz.js page it writes) reads that shape, so this module produces it and
nothing more: the library records no stack frames (every "frames" list is
empty; torch's own _snapshot() has them when goalloc's C++ class records
them). The context ids the library gives for the class ("ctx") name
nothing here and are left out.
"""

from __future__ import annotations

from typing import Any

# Keys of a trace entry in torch's snapshot, the last two only when the
# entry has them (the C++ class's labels). An "oom" entry has device_free
# where the others have addr.
_TRACE_KEYS = ("action", "addr", "size", "stream", "time_us", "frames", "compile_context", "user_metadata")


def _segment(seg: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in seg.items() if k != "ctx"}
    # torch gives the pool id as a tuple; JSON can only say list.
    out["segment_pool_id"] = tuple(seg.get("segment_pool_id") or (0, 0))
    out["frames"] = list(seg.get("frames") or [])
    out["blocks"] = [{**{k: v for k, v in b.items() if k != "ctx"}, "frames": list(b.get("frames") or [])}
                     for b in seg.get("blocks") or []]
    return out


def _trace_entry(e: dict[str, Any]) -> dict[str, Any]:
    out = {k: e[k] for k in _TRACE_KEYS if k in e}
    out.setdefault("frames", [])
    if out.get("action") == "oom":
        # torch records the device's free memory at the OOM in place of an
        # address. goalloc's history does not record it, so 0 stands for
        # "not recorded"; the viewers need the key to be present.
        out.pop("addr", None)
        out["device_free"] = 0
    return out


def to_torch(per_device: list[dict[str, Any]]) -> dict[str, Any]:
    """Convert goalloc_snapshot_json(-1) output to torch's snapshot dict."""
    count = 1 + max((d["device"] for d in per_device), default=-1)
    segments: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = [[] for _ in range(count)]
    for d in sorted(per_device, key=lambda d: d["device"]):
        segments.extend(_segment(s) for s in d.get("segments") or [])
        traces[d["device"]] = [_trace_entry(e) for e in d.get("device_traces") or []]
    return {"segments": segments, "device_traces": traces}
