"""The torch-facing API: clear errors without torch or CUDA, and, where a
(CPU) torch is installed, torch's own statistics calls answering from goalloc.

CI has no torch, so there only the "says so clearly" tests run (torch's
absence is simulated when torch is installed). The rest need torch and skip
without it; tests/gpu covers what needs a GPU.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import goalloc
from goalloc import _torch
from goalloc_testing import run_python

LARGE, BLOCK = 3_000_000, 3_000_320


@pytest.fixture
def no_torch(monkeypatch):
    """Make `import torch` fail, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "torch", None)


def test_install_without_torch_says_it_needs_torch(no_torch):
    with pytest.raises(ImportError, match=r"goalloc.install\(\) needs PyTorch") as e:
        goalloc.install()
    assert "statistics, snapshot and configuration functions work without it" in str(e.value)


def test_mempool_without_torch_says_it_needs_torch(no_torch):
    with pytest.raises(ImportError, match=r"goalloc.mempool\(\) needs PyTorch"):
        goalloc.mempool()


def test_bad_conf_is_rejected_before_torch_is_touched(no_torch):
    """A ValueError, not the ImportError that touching torch would raise."""
    with pytest.raises(ValueError, match='unknown key "bogus"'):
        goalloc.install("bogus:1")
    with pytest.raises(ValueError, match="GOALLOC_CONF: fraction"):
        goalloc.mempool("fraction:0")


def test_statistics_work_without_torch(no_torch, raw, device):
    raw.must_malloc(LARGE, device)
    assert goalloc.memory_allocated(device) == BLOCK
    assert goalloc.memory_allocated(None) == 0  # None: device 0 when torch is absent


def test_nested_stats_flatten_back_to_memory_stats(raw, device):
    """torch.cuda.memory_stats() flattens _cuda_memoryStats's nested dict by
    joining keys with '.'; doing that to nested_stats gives memory_stats."""
    raw.must_malloc(LARGE, device)
    nested = _torch.nested_stats(device)
    assert nested["allocated_bytes"]["all"]["current"] == BLOCK
    assert nested["goalloc.cache_misses"] == 1  # goalloc's extras stay flat

    flat = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = node

    walk("", nested)
    assert flat == goalloc.memory_stats(device)


def test_nested_stats_keep_clashing_names_flat(monkeypatch):
    """A name that is both a figure and a prefix of others cannot nest; it
    stays a dotted top-level key, which torch's flattening leaves as it is."""
    flat = {"allocation.all.current": 1, "goalloc.graph_pools": 2, "goalloc.graph_pools.reserved_bytes": 3,
            "x.y": 4, "x.y.z": 5}
    monkeypatch.setattr(goalloc, "memory_stats", lambda device: dict(flat))
    nested = _torch.nested_stats(0)
    assert nested == {"allocation": {"all": {"current": 1}}, "goalloc.graph_pools": 2,
                      "goalloc.graph_pools.reserved_bytes": 3, "x": {"y": 4}, "x.y.z": 5}


# --- with torch installed -------------------------------------------------------

def test_install_without_cuda_says_it_needs_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; tests/gpu covers install()")
    with pytest.raises(RuntimeError, match="needs a CUDA"):
        goalloc.install()


def test_torch_statistics_answer_from_goalloc(raw, device, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.cuda.memory as tcm

    # torch answers {} until CUDA is initialised; pretend it is (no GPU here).
    monkeypatch.setattr(tcm, "is_initialized", lambda: True)
    originals = {name: getattr(torch._C, name, None) for name in _torch._PATCHES}
    _torch.patch_torch(torch)
    try:
        p = raw.must_malloc(LARGE, device)
        assert torch.cuda.memory_allocated(device) == goalloc.memory_allocated(device) == BLOCK
        assert torch.cuda.max_memory_allocated(device) == BLOCK
        assert torch.cuda.memory_reserved(device) == BLOCK
        assert torch.cuda.max_memory_reserved(device) == BLOCK
        assert dict(torch.cuda.memory_stats(device)) == goalloc.memory_stats(device)
        raw.free(p, LARGE, device)
        torch.cuda.reset_peak_memory_stats(device)
        assert torch.cuda.max_memory_allocated(device) == 0
        torch.cuda.reset_accumulated_memory_stats(device)
        assert torch.cuda.memory_stats(device)["allocated_bytes.all.freed"] == 0
        summary = torch.cuda.memory_summary(device)
        assert "PyTorch CUDA memory summary" in summary and "Allocated memory" in summary
        assert torch.cuda.memory._snapshot()["segments"] == goalloc.snapshot()["segments"]

        torch.cuda.memory._record_memory_history(max_entries=1000)
        raw.must_malloc(LARGE, device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device]
        assert [e["action"] for e in trace] == ["alloc"]  # the cached block, reused
        torch.cuda.memory._record_memory_history(enabled=None)
        assert goalloc.snapshot()["device_traces"][device] == []
    finally:
        _torch.unpatch_torch(torch)
    for name, fn in originals.items():
        assert getattr(torch._C, name, None) is fn


INSTALL_PRELUDE = """
import json, torch, goalloc
from goalloc import _lib, _torch
# This machine has no GPU: let install() past its CUDA checks, and accept the
# simulated device, to check what it does to torch up to the allocator swap.
torch.cuda.is_available = lambda: True
_torch.init_library = lambda torch: _lib.init(0)
"""


def install_child(body: str) -> dict:
    proc = run_python(INSTALL_PRELUDE + textwrap.dedent(body))
    return json.loads(proc.stdout.splitlines()[-1])


def test_install_swaps_the_allocator_and_is_idempotent():
    pytest.importorskip("torch")
    out = install_child("""
    a = goalloc.install("large_cache:512M")
    b = goalloc.install()
    c = goalloc.install("large_cache:512M")
    try:
        goalloc.install("large_cache:1G")
        conflict = None
    except RuntimeError as e:
        conflict = str(e)
    current = torch.cuda.memory._get_current_allocator().allocator()
    print(json.dumps({
        "same": a is b is c,
        "current_is_goalloc": current is a.allocator(),
        "conf": goalloc.config()["conf"],
        "conflict": conflict,
        "patched": torch._C._cuda_memoryStats is _torch.nested_stats,
        "cxx": _torch.sys.modules["goalloc._cxx"].installed(),
    }))
    """)
    assert out["same"]
    assert out["current_is_goalloc"]
    assert "large_cache:536870912" in out["conf"]
    assert "already installed" in out["conflict"]
    # torch's statistics functions are replaced on the pluggable path only:
    # goalloc's C++ class answers them itself.
    assert out["patched"] != out["cxx"]


def test_install_after_cuda_started_says_what_to_do():
    pytest.importorskip("torch")
    out = install_child("""
    torch.cuda.is_initialized = lambda: True
    try:
        goalloc.install()
        msg = None
    except RuntimeError as e:
        msg = str(e)
    print(json.dumps({"msg": msg}))
    """)
    assert out["msg"].startswith("goalloc.install() must run before PyTorch initialises CUDA")
    assert "top of the script" in out["msg"]
    assert "goalloc.mempool()" in out["msg"]


def test_install_refuses_the_simulated_device():
    pytest.importorskip("torch")
    proc = run_python("""
    import torch, goalloc
    torch.cuda.is_available = lambda: True
    try:
        goalloc.install()
    except RuntimeError as e:
        print(e)
    """)
    assert "runs on the 'sim' device" in proc.stdout


def test_hook_addresses_are_the_librarys_functions():
    import ctypes

    from goalloc import _lib

    for name in ("goalloc_init", "goalloc_empty_cache", "goalloc_set_memory_fraction", "goalloc_record_stream"):
        assert _lib.address(name) == ctypes.cast(getattr(_lib.lib(), name), ctypes.c_void_p).value


def test_goalloc_conf_put_in_os_environ_after_start_is_applied_by_install():
    """The library sees GOALLOC_CONF as the process started; install() and
    mempool() apply a value set in os.environ since (before touching torch)."""
    proc = run_python("""
    import os, sys, warnings
    warnings.simplefilter("ignore")
    os.environ["GOALLOC_CONF"] = "large_cache:0"
    sys.modules["torch"] = None
    import goalloc
    try:
        goalloc.install()
    except ImportError:
        pass
    print(goalloc.config()["conf"])
    """)
    assert "large_cache:0," in proc.stdout
