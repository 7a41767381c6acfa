"""Write the memory snapshot pickles the replay tests read (replay/snapshot_test.go).

    python3 replay/testdata/snapshots/mksnapshots.py     # from the repository root

Needs only Python 3: no torch, no GPU. The snapshots have the structure that
torch 2.11's torch.cuda.memory._dump_snapshot() writes, which is
pickle.dump(torch.cuda.memory._snapshot(), f) with pickle's default protocol:
the dict THCPModule_memorySnapshot (torch/csrc/cuda/Module.cpp) builds, with

    segments            one dict per segment of every device, keys in torch's order:
                        device, address, total_size, allocated_size, active_size,
                        requested_size, stream, segment_type, segment_pool_id (a tuple),
                        is_expandable, frames, blocks (address, size, requested_size,
                        state, frames)
    device_traces       per device, a list of events: action, addr (device_free for an
                        oom), size, stream, time_us, and frames where stacks were recorded
    allocator_settings  PYTORCH_CUDA_ALLOC_CONF, max_split_size, ..., expandable_segments
    external_annotations

torch builds every dict with the same str objects for its keys and action names,
and one empty list for every empty "frames", so the pickle memoizes them (BINGET);
so does this script (Python interns the literals below).

The events come from the bundled GPT-2 trace (traces/gpt2-train.jsonl.gz, recorded
from torch 2.11's own history on an H200): its first events, so the recorded run's
segments and blocks are exactly what those events leave. The blocks' sizes are the
requests rounded up to 512 bytes (torch's round_size); torch's own may be larger
where it did not split a free block, which the replay does not read.

Every file is written with protocol 4, pickle.dump's default on Python 3.8 to 3.13
(torch 2.11 runs on 3.10 to 3.14; 3.14's default, 5, writes the same opcodes for
this data). values-p{2,3,4,5}.pickle hold one tree of assorted values in each
protocol, with values-pN.json the tree as the Go test renders it.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
PROTOCOL = 4

EMPTY_FRAMES: list = []  # torch's one empty frames list, shared by every dict without stacks

DEFAULT_SETTINGS = {
    "PYTORCH_CUDA_ALLOC_CONF": "",
    "max_split_size": -1,  # SIZE_MAX as int64: no limit
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "pinned_num_register_threads": 1,
    "release_lock_on_cudamalloc": False,
    "pinned_use_cuda_host_register": False,
    "roundup_power2_divisions": {str(1 << i): 0 for i in range(64)},
}


def round512(n: int) -> int:
    return max(512, (n + 511) // 512 * 512)


def gpt2_events(n: int) -> list[dict[str, Any]]:
    """The first n events of the bundled GPT-2 trace as torch's trace entries."""
    out = []
    with gzip.open(os.path.join(ROOT, "traces", "gpt2-train.jsonl.gz"), "rt") as f:
        next(f)  # header
        for line in f:
            e = json.loads(line)
            out.append(entry(e["a"], e["addr"], e["size"], e["stream"], e["t"]))
            if len(out) == n:
                break
    return out


def entry(action: str, addr: int, size: int, stream: int = 0, t: int = 0, frames: Any = None) -> dict[str, Any]:
    """One trace entry, keys in torch's order (frames first when there are stacks)."""
    e: dict[str, Any] = {}
    if frames is not None:
        e["frames"] = frames
    e["action"] = action
    e["device_free" if action == "oom" else "addr"] = addr
    e["size"] = size
    e["stream"] = stream
    e["time_us"] = t
    return e


def segments_after(events: list[dict[str, Any]], device: int) -> list[dict[str, Any]]:
    """The segments and blocks of one device once events have happened (from an
    empty allocator, without expandable segments), as torch's snapshot lists
    them, sorted by address."""
    segs: dict[int, tuple[int, int]] = {}  # address -> (size, stream)
    live: dict[int, list] = {}  # address -> [requested, pending]
    for e in events:
        a = e["action"]
        if a == "segment_alloc":
            segs[e["addr"]] = (e["size"], e["stream"])
        elif a == "segment_free":
            del segs[e["addr"]]
        elif a == "alloc":
            live[e["addr"]] = [e["size"], False]
        elif a == "free_requested":
            live[e["addr"]][1] = True
        elif a == "free_completed":
            del live[e["addr"]]
    out = []
    for addr in sorted(segs):
        size, stream = segs[addr]
        blocks = []
        at = addr
        allocated = active = requested = 0
        for b in sorted(x for x in live if addr <= x < addr + size):
            if b > at:
                blocks.append(block(at, b - at, 0, "inactive"))
            req, pending = live[b]
            nxt = min([x for x in live if x > b] + [addr + size])
            bsize = min(round512(req), nxt - b)
            state = "active_pending_free" if pending else "active_allocated"
            blocks.append(block(b, bsize, req, state))
            active += bsize
            if not pending:
                allocated += bsize
                requested += req
            at = b + bsize
        if at < addr + size:
            blocks.append(block(at, addr + size - at, 0, "inactive"))
        out.append({
            "device": device, "address": addr, "total_size": size, "allocated_size": allocated,
            "active_size": active, "requested_size": requested, "stream": stream,
            "segment_type": "small" if size <= 2 << 20 else "large", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": EMPTY_FRAMES, "blocks": blocks,
        })
    return out


def block(addr: int, size: int, requested: int, state: str) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": EMPTY_FRAMES}


def snapshot(segments: list, traces: list, settings: Any = DEFAULT_SETTINGS) -> dict[str, Any]:
    s: dict[str, Any] = {"segments": segments, "device_traces": traces}
    if settings is not None:
        s["allocator_settings"] = settings
        s["external_annotations"] = []
    return s


def write(name: str, obj: Any, protocol: int = PROTOCOL) -> None:
    path = os.path.join(HERE, name)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    print(f"{path}: {os.path.getsize(path):,} bytes", file=sys.stderr)


def with_stacks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every alloc a stack, as _record_memory_history(stacks="python")
    does; torch shares one list per distinct stack, and one dict per frame."""
    f1 = {"name": "forward", "filename": "model.py", "line": 42}
    f2 = {"name": "train_step", "filename": "train.py", "line": 7}
    stacks = [[f1, f2], [f2]]
    out = []
    for i, e in enumerate(events):
        e = dict(e)
        if e["action"] == "alloc":
            e = {"frames": stacks[i % 2], **e}
        out.append(e)
    return out


def main() -> None:
    # The head of the GPT-2 run, recorded from the start, with stacks.
    head = gpt2_events(12000)
    write("torch-gpt2-head.pickle", snapshot(segments_after(head, 0), [with_stacks(head)]))

    # The same run, but the ring kept only the last 8000 events (max_entries=8000).
    write("torch-gpt2-wrapped.pickle", snapshot(segments_after(head, 0), [head[-8000:]]))

    # No history: recording was off.
    write("torch-no-history.pickle", snapshot(segments_after(head, 0), [[]]))

    # Three devices: 0 without events, 1 and 2 with their own.
    def small(device: int, base: int) -> list[dict[str, Any]]:
        return [
            entry("segment_alloc", base, 2 << 20, 0, 10),
            entry("alloc", base, 1000, 0, 11),
            entry("alloc", base + 1024, 3000 * device, 0, 12),
            entry("free_requested", base, 1000, 0, 13),
            entry("free_completed", base, 1000, 0, 14),
        ]
    d1, d2 = small(1, 0x7F0000000000), small(2, 0x7F1000000000)
    write("torch-two-devices.pickle",
          snapshot(segments_after(d1, 1) + segments_after(d2, 2), [[], d1, d2]))

    # expandable_segments: one segment grows by segment_map and shrinks by segment_unmap.
    base = 0x7E0000000000
    exp = [
        entry("segment_map", base, 20 << 20, 0, 1),
        entry("alloc", base, 12 << 20, 0, 2),
        entry("segment_map", base + (20 << 20), 20 << 20, 0, 3),
        entry("alloc", base + (12 << 20), 20 << 20, 0, 4),
        entry("free_requested", base + (12 << 20), 20 << 20, 0, 5),
        entry("free_completed", base + (12 << 20), 20 << 20, 0, 6),
        entry("segment_unmap", base + (20 << 20), 20 << 20, 0, 7),
        entry("oom", 1 << 30, 64 << 30, 0, 8),
    ]
    # What is left: 20 MiB mapped, one 12 MiB block live in it.
    segs = [{
        "device": 0, "address": base, "total_size": 20 << 20, "allocated_size": 12 << 20,
        "active_size": 12 << 20, "requested_size": 12 << 20, "stream": 0, "segment_type": "large",
        "segment_pool_id": (0, 0), "is_expandable": True, "frames": EMPTY_FRAMES,
        "blocks": [block(base, 12 << 20, 12 << 20, "active_allocated"), block(base + (12 << 20), 8 << 20, 0, "inactive")],
    }]
    write("torch-expandable.pickle", snapshot(segs, [exp], dict(
        DEFAULT_SETTINGS, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", expandable_segments=True)))

    # An allocator other than torch's (goalloc's structure: no allocator_settings).
    write("other-allocator.pickle", snapshot(segments_after(d1, 0), [[dict(e) for e in d1]], settings=None))

    # A history that frees an address twice.
    bad = small(1, 0x7F0000000000) + [entry("free_completed", 0x7F0000000000, 1000, 0, 15)]
    write("torch-inconsistent.pickle", snapshot([], [bad]))

    # Assorted values, in every protocol the reader takes. Protocols 2 and 3
    # write sets, and protocol 2 bytes, as calls (REDUCE), which the reader
    # refuses; a snapshot has neither.
    shared = [1, 2]
    values: dict[Any, Any] = {
        "none": None, "true": True, "false": False,
        "ints": [0, 1, -1, 255, 256, 65535, 65536, -129, 2**31 - 1, -2**31, 2**31, 2**47 + 5, 2**63 - 1, -2**63],
        "bigints": [2**63, 2**64 - 1, 2**64, -2**63 - 1, 2**200 + 3, -(2**200)],
        "floats": [0.0, -1.5, 1e300, 3.141592653589793],
        "strs": ["", "ascii", "naïve ünïcödé ✓", "x" * 300],
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4, 5)],
        "pool_id": (0, 0),
        "long_list": list(range(1100)),
        "long_dict": {f"k{i}": i for i in range(1100)},
        "int_keys": {1: "one", -2: "minus two"},
        "shared": [shared, shared],
        "nested": {"a": [{"b": ({"c": [None]},)}]},
    }
    for p in (2, 3, 4, 5):
        v = dict(values)
        if p >= 3:
            v["bytes"] = b"\x00\x01\xff"
        if p >= 4:
            v["set"], v["frozenset"] = {7}, frozenset({8})
        write(f"values-p{p}.pickle", v, protocol=p)
        with open(os.path.join(HERE, f"values-p{p}.json"), "w") as f:
            json.dump(render(v), f, sort_keys=True)
            f.write("\n")


def render(v: Any) -> Any:
    """The tree as the Go test renders what it decodes (snapshot_test.go's render)."""
    if isinstance(v, dict):
        return {"dict": [[render(k), render(x)] for k, x in v.items()]}
    if isinstance(v, (list, set)):
        return [render(x) for x in v]
    if isinstance(v, (tuple, frozenset)):
        return {"tuple": [render(x) for x in v]}
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v if abs(v) < 2**53 else {"int": str(v)}
    if isinstance(v, float):
        return {"float": v}
    raise TypeError(type(v))


if __name__ == "__main__":
    main()
