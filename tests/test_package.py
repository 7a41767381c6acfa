"""The package itself: its names, where it finds libgoalloc.so, and that it
imports without torch."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import goalloc
from goalloc_testing import run_python

API = [
    "install", "mempool", "memory_stats", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "memory_summary",
    "empty_cache", "set_memory_fraction", "fragmentation", "snapshot", "dump_snapshot",
    "record_history", "library_path",
]


def test_version():
    assert goalloc.__version__ == "0.1.0"


@pytest.mark.parametrize("name", API)
def test_the_issues_api_is_there(name):
    assert callable(getattr(goalloc, name))
    assert name in goalloc.__all__
    assert getattr(goalloc, name).__doc__


def test_library_is_shipped_inside_the_package():
    if os.environ.get("GOALLOC_LIBRARY"):
        pytest.skip("GOALLOC_LIBRARY points elsewhere")
    package = Path(goalloc.__file__).resolve().parent
    assert Path(goalloc.library_path()) == package / "libgoalloc.so"


def test_make_pytest_tests_the_installed_package():
    """`make pytest` sets GOALLOC_EXPECT_INSTALLED: the tests must then import
    the package pip installed, not the source tree."""
    if not os.environ.get("GOALLOC_EXPECT_INSTALLED"):
        pytest.skip("not run by make pytest")
    package = Path(goalloc.__file__).resolve().parent
    assert "site-packages" in package.parts
    assert (package / "libgoalloc.so").is_file()


def test_goalloc_library_takes_precedence(tmp_path):
    copy = tmp_path / "elsewhere" / "libgoalloc.so"
    copy.parent.mkdir()
    shutil.copyfile(goalloc.library_path(), copy)
    proc = run_python("""
    import goalloc
    print(goalloc.library_path())
    print(goalloc.device_count())
    """, env={"GOALLOC_LIBRARY": str(copy)})
    path, count = proc.stdout.split()
    assert path == str(copy.resolve())
    assert count == "64"


def test_goalloc_library_that_is_not_a_file_is_reported(tmp_path):
    proc = run_python("""
    import goalloc
    try:
        goalloc.memory_stats(0)
    except FileNotFoundError as e:
        print(e)
    """, env={"GOALLOC_LIBRARY": str(tmp_path / "missing.so")})
    assert "GOALLOC_LIBRARY=" in proc.stdout and "is not a file" in proc.stdout


def test_import_and_statistics_without_torch():
    proc = run_python("""
    import sys
    sys.modules["torch"] = None  # `import torch` fails from here on
    import goalloc
    from goalloc import _lib
    p = _lib.lib().goalloc_malloc(1 << 20, 0, 0x1000)
    print(goalloc.memory_allocated(0), "torch" in sys.modules and sys.modules["torch"] is not None)
    """)
    assert proc.stdout.split() == [str(1 << 20), "False"]


def test_importing_goalloc_does_not_import_torch_or_load_the_library():
    proc = run_python("""
    import sys
    import goalloc
    from goalloc import _lib
    print("torch" in sys.modules, _lib._lib is not None)
    """)
    assert proc.stdout.split() == ["False", "False"]


def test_settings_set_in_os_environ_before_first_use_are_seen():
    """The library reads its settings with getenv(3) when it first
    initialises, so os.environ changes made before that count."""
    proc = run_python("""
    import os
    os.environ["GOALLOC_SIM_DEVICES"] = "3"
    os.environ["GOALLOC_CONF"] = "fraction:0.25"
    import goalloc
    print(goalloc.device_count(), goalloc.config()["fraction"])
    """)
    assert proc.stdout.split() == ["3", "0.25"], proc.stdout + proc.stderr
