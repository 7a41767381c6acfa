"""Helpers the Python tests share: the C ABI through ctypes, and child interpreters.

A module of its own (not conftest.py) so that tests can import it by name.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest

STREAM = 0x1000  # any integer is a stream to the simulated device
OTHER_STREAM = 0x2000


def device_holds(nbytes: int) -> int:
    """What the simulated device's backend (goalloc's default unless
    GOALLOC_CONF names one) holds for nbytes of goalloc's segments and blocks
    taken on one stream, so what memory_reserved() reports: backend:vmm packs
    them and maps handles of vmm_handle's size (4 MiB by default) around them,
    the stream-ordered pool (backend:async) maps 32 MiB chunks."""
    import goalloc

    conf = dict(kv.split(":", 1) for kv in goalloc.config()["conf"].split(","))
    unit = int(conf.get("vmm_handle", 4 << 20)) if conf.get("backend") == "vmm" else (32 << 20)
    return -(-nbytes // unit) * unit


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py as a module (bench/ is not a package), registered as
    bench_NAME so that its dataclasses and pickles resolve."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Raw:
    """The C ABI as PyTorch calls it, through the package's own ctypes loader."""

    def __init__(self) -> None:
        from goalloc import _lib

        self.lib = _lib.lib()
        # torch calls the init hook before its first allocation; so do the
        # tests (an allocation before it is bad input, and warned of).
        _lib.init(0)

    def malloc(self, size: int, device: int, stream: int = STREAM) -> int:
        """goalloc_malloc; 0 for NULL."""
        return self.lib.goalloc_malloc(size, device, stream) or 0

    def must_malloc(self, size: int, device: int, stream: int = STREAM) -> int:
        p = self.malloc(size, device, stream)
        assert p, f"goalloc_malloc({size}, {device}) returned NULL"
        return p

    def free(self, ptr: int, size: int, device: int, stream: int = STREAM) -> None:
        self.lib.my_free(ptr, size, device, stream)

    def record_stream(self, ptr: int, stream: int) -> None:
        self.lib.goalloc_record_stream(ptr, stream)



def run_python(code: str, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter with this process's environment.

    The child imports the same goalloc as the tests (installed, or from the
    source tree through PYTHONPATH), with a library no call has touched yet.
    """
    import goalloc

    full_env = dict(os.environ)
    # The same package and library as this process, whatever the child's cwd.
    package_parent = str(Path(goalloc.__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, full_env.get("PYTHONPATH")]))
    if full_env.get("GOALLOC_LIBRARY"):
        full_env["GOALLOC_LIBRARY"] = str(Path(full_env["GOALLOC_LIBRARY"]).resolve())
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env, cwd=cwd or Path(__file__).parent, capture_output=True, text=True, timeout=300,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"child exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc
