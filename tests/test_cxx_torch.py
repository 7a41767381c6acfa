"""goalloc's C++ allocator class inside a real torch, without a GPU: built
with torch.utils.cpp_extension, installed with torch's own
changeCurrentAllocator, and asked through torch's own bindings
(torch._C._cuda_memoryStats, _cuda_memorySnapshot, ...), which reach the
class and, through it, the library on the simulated device. Only calls that
do not start CUDA are made (no tensor is allocated: the library's C ABI
makes the blocks).

Skipped where torch is not installed or the class cannot be built (CI);
tests/gpu/test_cxx_gpu.py covers the class on a GPU. The build takes about a
minute; GOALLOC_CXX_CACHE keeps it between runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from goalloc import _cxx  # noqa: E402

CHILD = textwrap.dedent("""
    import json
    import torch
    import goalloc
    from goalloc import _torch, _cxx, _lib

    _lib.init(2)
    alloc = _torch.swap_in(torch)
    out = {"installed": _cxx.installed(), "type": type(alloc.allocator()).__name__,
           "backend": torch.cuda.get_allocator_backend(),
           "replaced": [n for n in _torch._PATCHES
                        if type(getattr(torch._C, n)).__name__ != "builtin_function_or_method"]}
    L = _lib.lib()
    p = L.goalloc_malloc(3_000_000, 0, 0x10)
    st = torch._C._cuda_memoryStats(0)
    out["allocated"] = st["allocated_bytes"]["all"]["current"]
    out["requested"] = st["requested_bytes"]["all"]["current"]
    out["max_split_size"] = st["max_split_size"]
    goalloc.record_history(True, max_entries=100)
    q = L.goalloc_malloc(1000, 0, 0x10)
    snap = torch._C._cuda_memorySnapshot(None)
    out["segments"] = sorted((s["address"], s["total_size"], s["segment_type"], list(s["segment_pool_id"]))
                             for s in snap["segments"])
    out["live_blocks"] = sorted(b["address"] for s in snap["segments"] for b in s["blocks"]
                                if b["state"] == "active_allocated")
    out["trace"] = [(e["action"], e["addr"]) for e in snap["device_traces"][0]]
    out["traces_without"] = [len(t) for t in torch._C._cuda_memorySnapshot((0, 0, False))["device_traces"]]
    out["live_check"] = [torch._C._cuda_checkPoolLiveAllocations(0, (0, 0), {p, q}),
                         torch._C._cuda_checkPoolLiveAllocations(0, (0, 0), {p})]
    out["state"] = type(torch._C._cuda_getCheckpointState(0, (0, 0))).__name__
    torch._C._cuda_cudaCachingAllocator_raw_delete(q)
    out["after_delete"] = torch._C._cuda_memoryStats(0)["allocation"]["all"]["current"]
    torch._C._cuda_resetPeakMemoryStats(0)
    out["peak"] = torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"]
    try:
        torch._C._cuda_memoryStats(5)
    except RuntimeError as e:
        out["bad_device"] = str(e).splitlines()[0]
    # torch's test_memory_plots: a freed allocation's size is still in the
    # snapshot once trace_plot(filter_freed=True) drops the alloc-free pairs.
    from torch.cuda._memory_viz import trace_plot
    x = L.goalloc_malloc(128 * 128 * 4, 0, 0x10)
    torch._C._cuda_cudaCachingAllocator_raw_delete(x)
    ss = torch._C._cuda_memorySnapshot(None)
    trace_plot(ss, filter_freed=True)
    out["plotted"] = [[e["action"], e["size"]] for e in ss["device_traces"][0]]
    out["freed_size_shown"] = str(128 * 128 * 4) in json.dumps(ss)
    out["p"], out["q"] = p, q
    print(json.dumps(out))
""")


def test_the_class_answers_torchs_own_calls(tmp_path):
    lacks = _cxx.missing(torch)
    if lacks:
        pytest.skip("cannot build the C++ class here: " + "; ".join(lacks))
    env = dict(os.environ, GOALLOC_CXX="1", GOALLOC_SIM_DEVICES="2")
    env.setdefault("GOALLOC_CXX_CACHE", str(tmp_path / "cxx"))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installed"] and out["type"] == "_cuda_CUDAAllocator" and out["backend"] == "goalloc"
    assert out["replaced"] == [], "no torch function replaced"
    assert (out["allocated"], out["requested"], out["max_split_size"]) == (3_000_320, 3_000_000, -1)
    p, q = out["p"], out["q"]
    assert [s[0] for s in out["segments"]][0] == p and all(s[3] == [0, 0] for s in out["segments"])
    assert out["live_blocks"] == sorted([p, q])
    assert ["alloc", q] in out["trace"]
    assert out["traces_without"] == [0, 0]
    assert out["live_check"] == [True, False]
    assert out["state"] == "_cuda_CUDAAllocator_AllocatorState"
    assert out["after_delete"] == 1
    assert out["peak"] == 3_000_320
    assert "device 5 does not exist" in out["bad_device"]
    assert ["alloc", 65536] not in out["plotted"], "trace_plot(filter_freed=True) dropped the pair"
    assert out["freed_size_shown"], "the inactive block keeps the size last requested in it"
