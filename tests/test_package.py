"""The package itself: its names, where it finds libgoalloc.so, that it
imports without torch, its `goalloc` command, and that the sdist builds a
wheel that installs and works."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
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


REPO = Path(__file__).resolve().parent.parent


def test_version_is_written_once():
    """pyproject.toml reads the version from goalloc.__version__, and the
    installed metadata says the same."""
    from importlib import metadata

    assert re.fullmatch(r"\d+\.\d+\.\d+", goalloc.__version__)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "goalloc.__version__" }' in pyproject
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M)
    if os.environ.get("GOALLOC_EXPECT_INSTALLED"):
        assert metadata.version("goalloc") == goalloc.__version__


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


# --- the goalloc command --------------------------------------------------------

def _tool_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GOALLOC_TOOL"}
    env.update(extra)
    return env


def test_python_m_goalloc_runs_the_tool_with_its_arguments_and_exit_status():
    if not (Path(goalloc.__file__).parent / "bin" / "goalloc").is_file():
        pytest.skip("the package was installed without the tool")
    ok = subprocess.run([sys.executable, "-m", "goalloc", "help", "replay"],
                        env=_tool_env(), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "Usage: goalloc replay" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "goalloc", "replay", "--policy", "no-such-policy"],
                         env=_tool_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr  # the tool's usage-error status
    assert "no-such-policy" in bad.stderr


def test_goalloc_command_without_the_tool_says_how_to_get_it(tmp_path):
    """A package installed without Go and without GOALLOC_TOOL has no tool:
    the command says so and exits 127, as a shell does for a missing command."""
    package = tmp_path / "goalloc"
    shutil.copytree(Path(goalloc.__file__).parent, package,
                    ignore=shutil.ignore_patterns("bin", "*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "goalloc", "--help"], cwd=tmp_path,
                          env=_tool_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 127
    assert "the goalloc tool is not in this installation" in proc.stderr
    assert "GOALLOC_TOOL=" in proc.stderr and "make tool" in proc.stderr


def test_goalloc_tool_that_is_not_a_file_is_reported(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "goalloc", "--help"],
                          env=_tool_env(GOALLOC_TOOL=str(tmp_path / "missing")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 127
    assert "GOALLOC_TOOL=" in proc.stderr and "is not an executable file" in proc.stderr


def test_goalloc_version_prints_the_package_version(tmp_path):
    """`goalloc --version` answers with goalloc.__version__, from the
    package, so also where the tool is missing."""
    runs = [([sys.executable, "-m", "goalloc", "--version"], None, _tool_env())]
    package = tmp_path / "goalloc"
    shutil.copytree(Path(goalloc.__file__).parent, package,
                    ignore=shutil.ignore_patterns("bin", "__pycache__"))
    runs.append(([sys.executable, "-m", "goalloc", "--version"], tmp_path,
                 _tool_env(PYTHONPATH=str(tmp_path))))
    for cmd, cwd, env in runs:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"goalloc {goalloc.__version__}\n", "")


def _section_names(path: Path) -> set[str]:
    """The section names of a 64-bit little-endian ELF file."""
    data = Path(path).read_bytes()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    return {data[strtab + h[0]:data.index(b"\0", strtab + h[0])].decode() for h in headers}


def _unstripped(path: Path) -> set[str]:
    """The sections of path a stripped file does not have."""
    return {n for n in _section_names(path) if n == ".symtab" or n.startswith((".debug", ".zdebug"))}


def test_a_wheel_build_writes_nothing_into_build_and_ships_no_stale_file(tmp_path):
    """`pip install .` builds in a scratch folder, never in ./build, the
    Makefile's, where files of an earlier build (`make tool`'s build/goalloc,
    an older install's build/lib/goalloc/bin/goalloc) would go into the
    wheel. Built here without Go, from a prebuilt library (GOALLOC_LIBRARY),
    so the wheel has no tool, not a stale one, and its library is stripped."""
    try:
        from setuptools.command import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        if os.environ.get("GOALLOC_EXPECT_INSTALLED"):
            pytest.fail("`make pytest` installs setuptools>=70.1; it is missing")
        pytest.skip("needs setuptools >= 70.1 where pytest runs")
    src = tmp_path / "src"
    for name in ["setup.py", "pyproject.toml", "wheel_tag.py", "README.md", "MANIFEST.in"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, src / name)
    shutil.copytree(REPO / "python" / "goalloc", src / "python" / "goalloc",
                    ignore=shutil.ignore_patterns("bin", "*.so", "*.h.gch", "cxxbuild", "__pycache__", "libgoalloc.h"))
    platlib = f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"  # setuptools' build_lib
    stale = {"build/goalloc": "#!/bin/sh\necho stale make tool\n",
             f"build/{platlib}/goalloc/bin/goalloc": "#!/bin/sh\necho stale build_py output\n"}
    for rel, text in stale.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
        (src / rel).chmod(0o755)
    library = Path(goalloc.library_path())
    before = library.read_bytes()
    env = {k: v for k, v in os.environ.items() if k not in ("GOALLOC_TOOL", "PYTHONPATH")}
    env.update(GOALLOC_LIBRARY=str(library), GO=str(tmp_path / "no-go-here"), GOALLOC_CXX="0")
    out = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = out.glob("goalloc-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "goalloc/libgoalloc.so" in names
        assert not [n for n in names if "/bin/" in n], names
        zf.extract("goalloc/libgoalloc.so", tmp_path / "unpacked")
    after = {str(p.relative_to(src)) for p in (src / "build").rglob("*") if p.is_file()}
    assert after == set(stale), "the build wrote into ./build"
    for rel, text in stale.items():
        assert (src / rel).read_text() == text
    shipped = tmp_path / "unpacked" / "goalloc" / "libgoalloc.so"
    if shutil.which("strip"):
        assert _unstripped(shipped) == set(), "the prebuilt library is shipped stripped"
    # The library found may itself be an installed, stripped one: what
    # matters is that the build stripped a copy.
    assert library.read_bytes() == before, "the prebuilt library itself is left as it was"


# --- the wheel's platform tag ---------------------------------------------------

def _wheel_tag():
    sys.path.insert(0, str(REPO))
    try:
        import wheel_tag
    finally:
        sys.path.remove(str(REPO))
    return wheel_tag


def test_manylinux_tag_is_the_newest_glibc_the_library_needs():
    """The tag's glibc is the newest GLIBC_2.X symbol version named in the
    library's dynamic string table (read here by a plain byte search, apart
    from wheel_tag's ELF reader)."""
    wheel_tag = _wheel_tag()
    library = Path(goalloc.library_path())
    newest = max(int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", library.read_bytes()))
    tag, why = wheel_tag.manylinux_tag([library], "linux_x86_64")
    assert why == []
    assert tag == f"manylinux_2_{max(newest, 17)}_x86_64"


def test_a_library_manylinux_does_not_allow_keeps_the_linux_tag():
    wheel_tag = _wheel_tag()
    info = wheel_tag.ELFInfo("x86_64", ["libc.so.6", "libcuda.so.1"], {"libc.so.6": {"GLIBC_2.17"}})
    floor, problems = wheel_tag.glibc_floor(info)
    assert problems == ["links libcuda.so.1, which manylinux does not allow"]
    newer_cxx = wheel_tag.ELFInfo("x86_64", ["libstdc++.so.6"], {"libstdc++.so.6": {"GLIBCXX_3.4.30"}})
    assert wheel_tag.glibc_floor(newer_cxx) == (35, [])


# --- sdist -> wheel -> fresh venv ------------------------------------------------

@pytest.mark.packaging
def test_wheel_built_from_the_sdist_installs_and_works(tmp_path):
    """What a release does: `python -m build` makes the sdist and then the
    wheel from that sdist (so the sdist must carry every Go source the
    build needs); the wheel goes into a fresh venv, where the library, the
    `goalloc` command and `python -m goalloc` work, away from the checkout."""
    try:
        import build  # noqa: F401
    except ImportError:
        if os.environ.get("GOALLOC_EXPECT_INSTALLED"):
            pytest.fail("`make pytest` installs the build package; it is missing")
        pytest.skip("needs the build package (pip install build)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOALLOC_LIBRARY", "GOALLOC_TOOL", "PYTHONPATH")}
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "-o", str(dist), str(REPO)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Built from the sdist, not from the checkout.
    log = proc.stdout + proc.stderr
    assert "Building wheel from sdist" in log, log[-2000:]
    # MANIFEST.in names only what exists: no wall of warnings. One is left
    # where the wheel is built from the sdist: setuptools adds tests/test*.py
    # to every sdist, MANIFEST.in prunes them, and the sdist has no tests/.
    sdist_log, _, wheel_log = log.partition("Building wheel from sdist")
    found = re.compile(r"^.*no (?:previously-included )?(?:files|directories) found.*$", re.M)
    assert not found.findall(sdist_log), "\n".join(found.findall(sdist_log))
    expected = "no previously-included directories found matching 'tests'"
    assert not [w for w in found.findall(wheel_log) if w != expected], "\n".join(found.findall(wheel_log))
    (sdist,) = dist.glob("goalloc-*.tar.gz")
    (wheel,) = dist.glob("goalloc-*.whl")

    version = goalloc.__version__
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ["go.mod", "go.sum", "setup.py", "wheel_tag.py", "export/main.go",
                   "export/torch_malloc.cpp", "cmd/goalloc/main.go", "arena/cuda.go",
                   "caching/allocator.go", "streams/streams.go", "replay/reference/reference.go",
                   "replay/replay.go", "replay/report.html.tmpl", "units/units.go",
                   "python/goalloc/__main__.py", "python/goalloc/csrc/goalloc.h"]:
        assert needed in names, needed
    assert not [n for n in names if n.endswith("_test.go") or "testdata" in n
                or n.startswith(("traces/", "bench/", "tests/", "build/"))
                or n.endswith((".so", "libgoalloc.h")) or "/bin/" in n]

    assert re.fullmatch(rf"goalloc-{re.escape(version)}-py3-none-manylinux_2_\d+_x86_64\.whl", wheel.name)
    with zipfile.ZipFile(wheel) as zf:
        tool = zf.getinfo("goalloc/bin/goalloc")
        assert tool.external_attr >> 16 & 0o111, "the tool must be executable"
        assert "goalloc/libgoalloc.so" in zf.namelist()
        # The C++ class is built from the installed package: its source and
        # every header it includes ship with it.
        for f in (_cxx_sources()):
            assert f"goalloc/csrc/{f}" in zf.namelist(), f
        # The native files are stripped (go build -ldflags=-s -w).
        for name in ["goalloc/libgoalloc.so", "goalloc/bin/goalloc"]:
            path = Path(zf.extract(name, tmp_path / "unpacked"))
            assert _unstripped(path) == set(), name

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                              "--no-deps", "--no-index", str(wheel)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr

    away = tmp_path / "elsewhere"  # no goalloc source folder here
    away.mkdir()
    smoke = subprocess.run([str(py), "-c", (
        "import goalloc, json; from goalloc import _lib\n"
        "p = _lib.lib().goalloc_malloc(1 << 20, 0, 0x1000)\n"
        "print(json.dumps([goalloc.__file__, goalloc.__version__, goalloc.memory_allocated(0)]))")],
        cwd=away, env=env, capture_output=True, text=True, timeout=120)
    assert smoke.returncode == 0, smoke.stderr
    path, installed_version, allocated = json.loads(smoke.stdout)
    assert Path(path).is_relative_to(env_dir)
    assert (installed_version, allocated) == (version, 1 << 20)
    # The tool carries the package's version (setup.py links it in), and the
    # `goalloc` command answers with it.
    for cmd in ([str(Path(path).parent / "bin" / "goalloc")], [str(env_dir / "bin" / "goalloc")]):
        v = subprocess.run(cmd + ["--version"], cwd=away, env=env, capture_output=True, text=True, timeout=60)
        assert (v.returncode, v.stdout) == (0, f"goalloc {version}\n"), (cmd, v.stderr)

    # A two-event trace, replayed by the installed tool.
    trace = away / "tiny.jsonl.gz"
    with gzip.open(trace, "wt") as f:
        f.write(json.dumps({"workload": "tiny"}) + "\n")
        f.write(json.dumps({"a": "alloc", "addr": 4096, "size": 1 << 20, "stream": 0, "t": 1}) + "\n")
        f.write(json.dumps({"a": "free_completed", "addr": 4096, "size": 1 << 20, "stream": 0, "t": 2}) + "\n")
    for cmd in ([str(env_dir / "bin" / "goalloc")], [str(py), "-m", "goalloc"]):
        help_ = subprocess.run(cmd + ["--help"], cwd=away, env=env, capture_output=True, text=True, timeout=60)
        assert help_.returncode == 0, help_.stderr
        assert "goalloc replay" in help_.stdout + help_.stderr
        replay = subprocess.run(cmd + ["replay", str(trace), "--json"], cwd=away, env=env,
                                capture_output=True, text=True, timeout=60)
        assert replay.returncode == 0, replay.stderr
        assert json.loads(replay.stdout)["policy"] == "goalloc"
        bad = subprocess.run(cmd + ["replay", "--device", "abacus"], cwd=away, env=env,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2, bad.stderr


def _cxx_sources() -> list[str]:
    """The file names the C++ class is built from (goalloc._cxx's SOURCE and HEADERS)."""
    from goalloc import _cxx

    return [_cxx.SOURCE.name] + [h.name for h in _cxx.HEADERS]
