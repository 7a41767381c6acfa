"""goalloc.record_trace() writes goalloc's trace format, which `goalloc replay`
reads; and `goalloc replay` reads the snapshots goalloc.dump_snapshot() writes.

The allocations go through the library's C functions on the simulated device
(as PyTorch would make them), and the files are replayed with the goalloc
command, built from this checkout."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import goalloc
from goalloc_testing import OTHER_STREAM, STREAM

ROOT = Path(__file__).resolve().parent.parent
# The requests, which the history's events carry as torch's do; a large
# request's block, which its segment events carry.
SMALL = 1000
LARGE, BLOCK = 3_000_000, 3_000_320


@pytest.fixture(scope="session")
def goalloc_tool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The goalloc command of this checkout: built with Go where Go is (so it
    is never stale), else build/goalloc."""
    if shutil.which("go") and (ROOT / "go.mod").is_file():
        out = tmp_path_factory.mktemp("tool") / "goalloc"
        subprocess.run(["go", "build", "-o", str(out), "./cmd/goalloc"], cwd=ROOT, check=True, timeout=600)
        return out
    built = ROOT / "build" / "goalloc"
    if not built.is_file():
        pytest.skip("needs Go or build/goalloc (make tool)")
    return built


def replay(tool: Path, path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """Replay path with the native policy; the JSON result and stderr."""
    proc = subprocess.run([str(tool), "replay", str(path), "--policy", "native", "--json", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def test_record_trace_from_the_middle_of_a_run(raw, device, tmp_path, goalloc_tool):
    # Live before the recording: a "parameter" that stays, and an
    # activation the recording frees.
    params = raw.must_malloc(LARGE, device)
    old = raw.must_malloc(SMALL, device)
    path = tmp_path / "t.jsonl.gz"
    with goalloc.record_trace(path, device=device, workload="unit") as rec:
        a = raw.must_malloc(LARGE, device)
        b = raw.must_malloc(SMALL, device, OTHER_STREAM)
        raw.free(old, SMALL, device)
        raw.free(a, LARGE, device)
        c = raw.must_malloc(LARGE, device)  # the cached block again
        raw.free(b, SMALL, device, OTHER_STREAM)
        raw.free(c, LARGE, device)
    assert rec.initial_blocks == 2

    header, events = read_trace(path)
    assert header["workload"] == "unit"
    assert header["allocator"] == "goalloc"
    assert header["device"] == device
    assert header["events"] == len(events) == rec.events
    assert header["goalloc_max_requested"] == LARGE + SMALL + LARGE + SMALL  # the sizes asked for, as torch's
    assert "max_reserved" not in header  # that is the native allocator's figure
    assert header["goalloc_reserved_peak"] == goalloc.memory_stats(device)["reserved_bytes.all.peak"] > 0
    assert {e["a"] for e in events} <= {"segment_alloc", "alloc", "free_requested", "free_completed"}
    # The live blocks come first, in address order, at the recording's start.
    firsts = [e for e in events if e["a"] == "alloc"][:2]
    assert sorted([(e["addr"], e["size"]) for e in firsts]) == sorted([(params, LARGE), (old, SMALL)])
    assert events[0]["t"] <= events[-1]["t"]
    assert {e["stream"] for e in events} >= {STREAM, OTHER_STREAM}

    result, stderr = replay(goalloc_tool, path)
    assert result["events"] == len(events)
    assert result["peak_live_bytes"] == LARGE + SMALL + LARGE + SMALL
    assert "snapshot" not in result
    assert stderr == ""


def test_record_trace_plain_and_restores_history(raw, device, tmp_path, goalloc_tool):
    assert goalloc.config()["history"] == 0
    path = tmp_path / "t.jsonl"
    with goalloc.record_trace(str(path), device=device, max_entries=1000):
        assert goalloc.config()["history"] == 1000
        p = raw.must_malloc(SMALL, device)
        raw.free(p, SMALL, device)
    assert goalloc.config()["history"] == 0
    with open(path, "rb") as f:
        assert f.read(1) == b"{"  # not gzipped
    result, _ = replay(goalloc_tool, path)
    assert result["events_replayed"] == 2
    assert result["peak_live_bytes"] == SMALL

    goalloc.record_history(True, max_entries=50)
    try:
        with goalloc.record_trace(path, device=device):
            pass
        assert goalloc.config()["history"] == 50
    finally:
        goalloc.record_history(False)


def test_record_trace_writes_when_the_block_raises(raw, device, tmp_path, goalloc_tool):
    path = tmp_path / "t.jsonl.gz"
    with pytest.raises(KeyError):
        with goalloc.record_trace(path, device=device):
            raw.must_malloc(LARGE, device)
            raise KeyError("boom")
    result, _ = replay(goalloc_tool, path)
    assert result["peak_live_bytes"] == LARGE
    assert goalloc.config()["history"] == 0


def test_record_trace_wrapped_ring(raw, device, tmp_path, goalloc_tool):
    path = tmp_path / "t.jsonl.gz"
    keep = [raw.must_malloc(LARGE, device) for _ in range(3)]
    with pytest.warns(RuntimeWarning, match="filled its ring of max_entries=8"):
        with goalloc.record_trace(path, device=device, max_entries=8):
            for _ in range(10):
                p = raw.must_malloc(SMALL, device)
                raw.free(p, SMALL, device)
            raw.free(keep[0], LARGE, device)
    # The ring kept the last 8 events; the trace still replays, from the
    # state they imply.
    result, _ = replay(goalloc_tool, path)
    assert result["peak_live_bytes"] >= 2 * LARGE
    for p in keep[1:]:
        raw.free(p, LARGE, device)


@pytest.mark.parametrize("kwargs, error", [
    ({"path": 3}, TypeError),
    ({"path": "x.jsonl", "max_entries": 0}, ValueError),
    ({"path": "x.jsonl", "max_entries": 1.5}, TypeError),
    ({"path": "x.jsonl", "device": 10_000}, ValueError),
    ({"path": "x.jsonl", "workload": 7}, TypeError),
])
def test_record_trace_bad_arguments(kwargs, error):
    with pytest.raises(error):
        goalloc.record_trace(**kwargs)
    assert goalloc.config()["history"] == 0


def test_record_trace_unwritable_path(raw, device, tmp_path):
    with pytest.raises(OSError):
        with goalloc.record_trace(tmp_path / "no" / "such" / "dir.jsonl", device=device):
            raw.free(raw.must_malloc(SMALL, device), SMALL, device)
    assert goalloc.config()["history"] == 0


def test_replay_reads_goallocs_snapshot(raw, device, tmp_path, goalloc_tool, history):
    # What torch's _dump_snapshot writes after goalloc.install(), here
    # through goalloc.dump_snapshot: goalloc's history in torch's keys.
    a = raw.must_malloc(LARGE, device)
    b = raw.must_malloc(SMALL, device)
    raw.free(a, LARGE, device)
    path = tmp_path / "snap.pickle"
    goalloc.dump_snapshot(path)
    raw.free(b, SMALL, device)

    proc = subprocess.run([str(goalloc_tool), "replay", str(path), "--json", "--policy", "native",
                           "--device-index", str(device)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    snap = result["snapshot"]
    assert snap["device"] == device
    assert snap["recorder"] == "unknown"
    assert snap["actions"]["alloc"] == 2
    assert result["peak_live_bytes"] == LARGE + SMALL
    assert snap["recorded_peak_reserved_bytes"] == BLOCK + 256 * 1024  # the block and the 1024-byte class's segment
    assert "no allocator_settings" in proc.stderr
    assert os.path.getsize(path) < 1 << 20


def test_history_reader_takes_any_json_layout():
    # The library's compact layout is read by pattern; any other layout of
    # the same JSON is decoded whole, with the same result.
    from goalloc import _trace

    snap = [{"device": 0, "segments": [{"address": 4096, "total_size": 262144, "stream": 7, "blocks": []}],
             "device_traces": [
                 {"action": "segment_alloc", "addr": 4096, "size": 262144, "stream": 7, "time_us": 5, "frames": []},
                 {"action": "alloc", "addr": 4096, "size": 1024, "stream": 7, "time_us": 6, "frames": []},
                 {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0, "time_us": 7, "frames": []},
                 # What the C++ class adds: a context id and torch's labels.
                 {"action": "alloc", "addr": 8192, "size": 100, "stream": 7, "time_us": 8, "frames": [], "ctx": 3,
                  "compile_context": "Torch-Compiled Region: 0/0", "user_metadata": "a \"quoted\" }"},
             ]}]
    compact = _trace.History(json.dumps(snap, separators=(",", ":")))
    spaced = _trace.History(json.dumps(snap, indent=1))
    assert compact._list is None and spaced._list is not None  # the two paths
    want = [("segment_alloc", 4096, 262144, 7, 5), ("alloc", 4096, 1024, 7, 6), ("oom", 0, 1 << 40, 0, 7),
            ("alloc", 8192, 100, 7, 8)]
    for h in (compact, spaced):
        assert list(h.entries()) == want
        assert h.count == 4
        assert h.segments == snap[0]["segments"]
        start = h.scan()
        assert start.lines == 3 and start.blocks == {} and start.segments == {}
        assert (start.peak_reserved, start.peak_requested) == (262144, 1124)
