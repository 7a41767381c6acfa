"""snapshot() has the structure of torch.cuda.memory._snapshot(), and
dump_snapshot() writes a pickle that PyTorch's memory visualiser reads."""

from __future__ import annotations

import pickle
import pickletools
import subprocess
import sys

import pytest

import goalloc

SMALL, LARGE, BLOCK = 1000, 3_000_000, 3_000_320

SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
TRACE_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}

# The opcodes the unpickler of MemoryViz.js (the page trace_plot writes, and
# pytorch.org/memory_viz) implements; a pickle with any other fails to load.
MEMORY_VIZ_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT",
    "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK",
    "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE",
    "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}


@pytest.fixture
def recorded(raw, device, history):
    """Record: 1 small and 1 large allocation, the large freed, cache emptied, 1 more small."""
    small = raw.must_malloc(SMALL, device)
    large = raw.must_malloc(LARGE, device)
    raw.free(large, LARGE, device)
    goalloc.empty_cache(device)
    raw.must_malloc(SMALL, device)
    return device, small, large


def segments_of(snap: dict, device: int) -> list[dict]:
    return [s for s in snap["segments"] if s["device"] == device]


def test_snapshot_has_torchs_structure(recorded):
    device, small, _ = recorded
    snap = goalloc.snapshot()
    assert set(snap) == {"segments", "device_traces"}
    assert len(snap["device_traces"]) == goalloc.device_count()
    (seg,) = segments_of(snap, device)  # the large block went back to the pool
    assert set(seg) == SEGMENT_KEYS
    assert seg["segment_type"] == "small"
    assert seg["address"] == small
    assert seg["total_size"] == 256 * 1024  # the 1024-byte class's segment
    assert seg["allocated_size"] == 2 * 1024  # two 1024-byte slots
    assert seg["requested_size"] == 2 * SMALL
    assert seg["segment_pool_id"] == (0, 0)
    for b in seg["blocks"]:
        assert set(b) == BLOCK_KEYS
        assert b["frames"] == []
    # Blocks tile the segment from its address on, as the viewers assume.
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    addr = seg["address"]
    for b in seg["blocks"]:
        assert b["address"] == addr
        addr += b["size"]
    states = [b["state"] for b in seg["blocks"]]
    assert states == ["active_allocated", "active_allocated", "inactive"]


def test_device_trace_records_the_sequence(recorded):
    device, small, large = recorded
    trace = goalloc.snapshot()["device_traces"][device]
    for e in trace:
        assert set(e) == TRACE_KEYS
    got = [(e["action"], e["addr"], e["size"]) for e in trace]
    # An alloc or free carries the size asked for, as torch's; a segment
    # event the segment's.
    assert got == [
        ("segment_alloc", small, 256 * 1024),
        ("alloc", small, SMALL),
        ("segment_alloc", large, BLOCK),
        ("alloc", large, LARGE),
        ("free_requested", large, LARGE),
        ("free_completed", large, LARGE),
        ("snapshot", 0, 0),  # goalloc's marker of an empty_cache, before what it gives back
        ("segment_free", large, BLOCK),
        ("alloc", small + 1024, SMALL),
    ]
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)


def test_oom_trace_entry_has_torchs_keys(raw, device, history):
    goalloc.set_memory_fraction(0.001, device)
    assert raw.malloc(64 << 20, device) == 0
    trace = goalloc.snapshot()["device_traces"][device]
    oom = [e for e in trace if e["action"] == "oom"]
    assert len(oom) == 1
    assert set(oom[0]) == {"action", "device_free", "size", "stream", "time_us", "frames"}
    assert oom[0]["size"] == 64 << 20


def test_history_off_records_nothing(raw, device):
    goalloc.record_history(False)
    raw.must_malloc(SMALL, device)
    assert goalloc.snapshot()["device_traces"][device] == []


def test_dump_snapshot_writes_the_same_structure_as_a_pickle(recorded, tmp_path):
    device = recorded[0]
    path = tmp_path / "snap.pickle"
    goalloc.dump_snapshot(path)
    data = path.read_bytes()
    loaded = pickle.loads(data)
    assert set(loaded) == {"segments", "device_traces"}
    assert segments_of(loaded, device) == segments_of(goalloc.snapshot(), device)
    assert [e["action"] for e in loaded["device_traces"][device]][:2] == ["segment_alloc", "alloc"]
    # Protocol 4, and only opcodes the visualiser's JavaScript unpickler reads.
    ops = list(pickletools.genops(data))
    assert ops[0][0].name == "PROTO" and ops[0][1] == 4
    assert {op.name for op, _, _ in ops} <= MEMORY_VIZ_OPCODES


@pytest.mark.parametrize("command", ["trace_plot", "segment_plot", "stats", "trace"])
def test_pytorch_memory_viz_reads_the_pickle(recorded, tmp_path, command):
    pytest.importorskip("torch")
    pickle_path = tmp_path / "snap.pickle"
    goalloc.dump_snapshot(pickle_path)
    out = tmp_path / "out.html"
    args = [sys.executable, "-m", "torch.cuda._memory_viz", command, str(pickle_path)]
    if command.endswith("_plot"):
        args += ["-o", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if command.endswith("_plot"):
        html = out.read_text()
        assert "MemoryViz.js" in html and "snapshot.pickle" in html
    elif command == "stats":
        assert "total_reserved" in proc.stdout
    else:
        assert f"Device {recorded[0]}" in proc.stdout
