"""CUDA IPC's C ABI through the package's ctypes declarations, on the
simulated device (backend:vmm, whose simulated processes are this one):
an export's fields, the free held until the release, an import on the
device and its close, and the refusals with their kinds. The bytes seen
through an import are the Go tests' (arena/vmm_ipc_test.go,
caching/ipc_test.go): the simulated device's memory is not reachable from
Python."""

from __future__ import annotations

import ctypes
import os

from goalloc import _lib

MiB = 1 << 20


def export(raw, p, cap=64):
    pid, dev = ctypes.c_int(), ctypes.c_int()
    gran, off = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    fds = (ctypes.c_int * max(cap, 1))()
    n = raw.lib.goalloc_ipc_export(p, ctypes.byref(pid), ctypes.byref(dev), ctypes.byref(gran),
                                   ctypes.byref(off), fds, cap)
    return n, pid.value, dev.value, gran.value, off.value, list(fds[:max(n, 0)])


def failure():
    """The last failed call's kind and message."""
    return _lib.last_error_kind(), _lib.last_error()


def test_export_import_release(raw, device):
    p = raw.must_malloc(40 * MiB, device)
    allocated = _lib.stat(device, _lib.ALLOCATED)
    n, pid, dev, gran, off, fds = export(raw, p)
    assert n == len(fds) >= 3 and pid == os.getpid() and dev == device and off < gran
    arr = (ctypes.c_int * n)(*fds)
    base = raw.lib.goalloc_ipc_import(device, pid, gran, arr, n)
    assert base, "import on the block's own device"
    assert raw.lib.goalloc_ipc_close(device, base) == 0
    raw.free(p, 40 * MiB, device)
    assert _lib.stat(device, _lib.ALLOCATED) == allocated, "held for the share"
    assert raw.lib.goalloc_ipc_release(p) == 0
    assert _lib.stat(device, _lib.ALLOCATED) == allocated - 40 * MiB


def test_refusals(raw, device):
    p = raw.must_malloc(MiB, device)
    n, pid, _, gran, _, fds = export(raw, p, cap=0)
    assert n == 1, "the count, with no room"
    assert raw.lib.goalloc_ipc_release(p) == -1, "no share was counted"
    assert failure()[0] == "bad_argument"
    n, pid, _, gran, _, fds = export(raw, p)
    other = device + 1 if device + 1 < 64 else device - 1
    arr = (ctypes.c_int * 1)(*fds)
    assert not raw.lib.goalloc_ipc_import(other, pid, gran, arr, 1)
    kind, msg = failure()
    assert kind == "failed" and "memory of device" in msg, (kind, msg)
    stale = (ctypes.c_int * 1)(99999)
    assert not raw.lib.goalloc_ipc_import(device, pid, gran, stale, 1)
    assert "bad file descriptor" in failure()[1]
    assert raw.lib.goalloc_ipc_release(p) == 0
    raw.free(p, MiB, device)
