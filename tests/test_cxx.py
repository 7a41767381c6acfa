"""goalloc.install() without its C++ allocator class: where the class cannot
be built (here: a torch without its C++ headers), install falls back to
torch's CUDAPluggableAllocator after exactly one warning that says what is
missing and what will not work. A stand-in torch module records what
install does with it; tests/gpu/test_cxx_gpu.py covers the class itself.
"""

from __future__ import annotations

import re
from pathlib import Path
import types
import warnings

import pytest

from goalloc import _cxx, _torch


class FakePluggable:
    """torch.cuda.memory.CUDAPluggableAllocator, recording what it is given."""

    made: list["FakePluggable"] = []

    def __init__(self, path: str, malloc: str, free: str) -> None:
        self.path, self.malloc, self.free = path, malloc, free
        self.hooks: dict[str, int] = {}
        FakePluggable.made.append(self)

    def allocator(self) -> "FakePluggable":
        return self

    def __getattr__(self, name: str):  # set_init_fn, set_reset_fn, ...
        if not name.startswith("set_"):
            raise AttributeError(name)
        return lambda address: self.hooks.__setitem__(name, address)


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    """A torch whose folder has no C++ headers, so the class cannot be built."""
    swapped: list[object] = []
    memory = types.SimpleNamespace(CUDAPluggableAllocator=FakePluggable,
                                   change_current_allocator=swapped.append)
    torch = types.SimpleNamespace(__version__="0.0+fake", __file__=str(tmp_path / "torch" / "__init__.py"),
                                  cuda=types.SimpleNamespace(memory=memory), _C=types.SimpleNamespace(),
                                  swapped=swapped)
    monkeypatch.setattr(_cxx, "_module", None)
    monkeypatch.setattr(_cxx, "_failure", None)
    monkeypatch.setattr(_torch, "_allocator", None)
    monkeypatch.setenv("GOALLOC_CXX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GOALLOC_CXX", raising=False)
    FakePluggable.made.clear()
    yield torch
    _torch.unpatch_torch(torch)


def test_unbuildable_class_falls_back_with_one_warning(fake_torch):
    with pytest.warns(RuntimeWarning) as caught:
        alloc = _torch.swap_in(fake_torch)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "C++ allocator class is not available" in msg
    assert "PyTorch's C++ headers" in msg, "says what is missing"
    assert "torch.OutOfMemoryError" in msg and "reduce-overhead" in msg, "says what will not work"

    assert isinstance(alloc, FakePluggable) and fake_torch.swapped == [alloc], "the pluggable path is used"
    assert alloc.malloc == "my_malloc" and alloc.free == "my_free"
    assert {"set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_record_stream_fn"} <= set(alloc.hooks)
    assert fake_torch._C._cuda_memoryStats is _torch.nested_stats, "statistics patched in for the fallback"
    assert "PyTorch's C++ headers" in (_cxx.failure() or "")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert _cxx.load(fake_torch) is None


def test_goalloc_cxx_0_chooses_the_fallback_silently(fake_torch, monkeypatch):
    monkeypatch.setenv("GOALLOC_CXX", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alloc = _torch.swap_in(fake_torch)
    assert fake_torch.swapped == [alloc]
    assert _cxx.failure() is None, "nothing was tried"


def test_goalloc_cxx_1_makes_a_failed_build_an_error(fake_torch, monkeypatch):
    monkeypatch.setenv("GOALLOC_CXX", "1")
    with pytest.raises(_cxx.Unavailable, match=r"required \(GOALLOC_CXX=1\).*C\+\+ headers"):
        _torch.swap_in(fake_torch)
    assert fake_torch.swapped == [], "no allocator was swapped in"
    with pytest.raises(_cxx.Unavailable, match="required"):
        _cxx.load(fake_torch)  # and again, from the remembered failure


def test_missing_names_every_tool(fake_torch, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(_cxx.shutil, "which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "ninja", None)
    lacks = " | ".join(_cxx.missing(fake_torch))
    assert "PyTorch's C++ headers" in lacks
    assert "a C++ compiler" in lacks
    assert "ninja" in lacks


def test_the_module_name_follows_the_headers_too(tmp_path, monkeypatch):
    """A changed header is a new module: the class is rebuilt, not reused."""
    included = set(re.findall(r'^#include "([^"]+)"', _cxx.SOURCE.read_text(), re.M))
    assert {h.name for h in _cxx.HEADERS} == included, "HEADERS is what goalloc_torch.cpp includes"
    assert all(h.is_file() for h in _cxx.HEADERS)
    before = _cxx.module_name()
    header = tmp_path / "goalloc_front.h"
    header.write_bytes(_cxx.HEADERS[0].read_bytes() + b"// changed\n")
    monkeypatch.setattr(_cxx, "HEADERS", (header,))
    assert _cxx.module_name() != before


def test_the_headers_are_what_the_source_includes_from_its_folder():
    """Every header the class's source includes from csrc/ is in HEADERS, so
    that a change to any of them builds a new module."""
    import re
    included = set(re.findall(r'^#include "([^"]+)"', _cxx.SOURCE.read_text(), re.M))
    assert included == {h.name for h in _cxx.HEADERS}


def test_builds_are_kept_per_torch_and_python_version(fake_torch):
    tag = _cxx.build_tag(fake_torch)
    assert tag.startswith("torch-0.0_fake-py3")
    assert _cxx.cache_dir(fake_torch).name == tag
    assert _cxx.module_name().startswith("goalloc_torch_")


class FakeExtension:
    """The built class, whose install() fails as the real one can."""

    def __init__(self, error: str) -> None:
        self.error = error

    def install(self, path: str) -> None:
        raise RuntimeError(self.error)

    def is_installed(self) -> bool:
        return False


def test_a_library_too_old_for_the_class_falls_back_with_one_warning(fake_torch, monkeypatch):
    monkeypatch.setattr(_cxx, "_module", FakeExtension(
        "goalloc: /x/libgoalloc.so lacks goalloc_pool_malloc; it is older than this allocator class: rebuild it"))
    with pytest.warns(RuntimeWarning, match="lacks goalloc_pool_malloc") as caught:
        alloc = _torch.swap_in(fake_torch)
    assert len(caught) == 1
    assert fake_torch.swapped == [alloc] and isinstance(alloc, FakePluggable)


def test_the_class_after_cuda_started_says_what_to_do(fake_torch, monkeypatch):
    monkeypatch.setattr(_cxx, "_module", FakeExtension("Can't swap an already initialized allocator"))
    with pytest.raises(RuntimeError, match="before PyTorch initialises CUDA"):
        _torch.swap_in(fake_torch)
    assert fake_torch.swapped == [] and _cxx.failure() is None


def _build_py(tmp_path, extra_path):
    """setup.py's build_py into tmp_path/lib, the native files prebuilt
    (GOALLOC_LIBRARY, GOALLOC_TOOL), with extra_path on PYTHONPATH."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    lib, tool = root / "build" / "libgoalloc.so", root / "build" / "goalloc"
    if not lib.is_file() or not tool.is_file():
        pytest.skip("needs build/libgoalloc.so and build/goalloc (make lib tool)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOALLOC_CXX", "PYTHONPATH")}
    env.update(GOALLOC_LIBRARY=str(lib), GOALLOC_TOOL=str(tool), GOALLOC_CXX_CACHE=str(tmp_path / "cache"))
    if extra_path:
        env["PYTHONPATH"] = str(extra_path)
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return out


def test_package_build_tries_the_class_where_torch_is_importable(tmp_path):
    """A torch importable at build time gets the class built into the
    package; where that build fails (this stand-in torch has no compiler
    support), the package still builds and says the first install() will
    try again. Without torch nothing is tried."""
    fake = tmp_path / "fake"
    (fake / "torch" / "utils").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("__version__ = '0.0+fake'\n")
    (fake / "torch" / "utils" / "__init__.py").write_text("")
    (fake / "torch" / "utils" / "cpp_extension.py").write_text("")
    with_torch = _build_py(tmp_path / "a", fake)
    assert with_torch.returncode == 0, with_torch.stderr[-2000:]
    assert "torch is importable here" in with_torch.stdout
    assert "could not be built now" in with_torch.stdout
    assert (tmp_path / "a" / "lib" / "goalloc" / "libgoalloc.so").is_file()
    without = _build_py(tmp_path / "b", None)
    assert without.returncode == 0, without.stderr[-2000:]
    assert "torch is importable here" not in without.stdout


# What the class's messages may be built from: string literals and these
# expressions, all strings (a number goes through std::to_string first).
STRING_ARGS = re.compile(
    r'^(".*"|std::to_string\(.*\)|std::string\(1, c\)|last_error\(\)|pool_name\(.*\)|dlerror\(\)'
    r'|ex\.what\(\)|msg|err|path|missing|res\["error"\]\.str)$',
    re.S,
)
MESSAGE_MACROS = {"TORCH_CHECK": 1, "TORCH_CHECK_WITH": 2, "TORCH_WARN": 0, "TORCH_WARN_ONCE": 0}


def macro_calls(src: str):
    """(macro, [top-level arguments]) of each message macro in src."""
    for m in re.finditer(r"\b(TORCH_CHECK_WITH|TORCH_CHECK|TORCH_WARN_ONCE|TORCH_WARN)\(", src):
        depth, i, args, start, quote = 1, m.end(), [], m.end(), False
        while depth:
            c = src[i]
            if quote:
                if c == "\\":
                    i += 1
                elif c == '"':
                    quote = False
            elif c == '"':
                quote = True
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 1:
                args.append(src[start:i].strip())
                start = i + 1
            i += 1
        args.append(src[start : i - 1].strip())
        yield m.group(1), args


def test_the_class_writes_no_number_to_a_message_stream():
    """The H200 run crashed (SIGSEGV in ostream's integer insertion, inside
    the module) where getIpcDevPtr was to raise a message holding a
    process id: the class's checks and warnings get strings alone."""
    src = (Path(_cxx.__file__).parent / "csrc" / "goalloc_torch.cpp").read_text()
    calls = list(macro_calls(src))
    assert len(calls) > 20
    bad = [
        (name, arg)
        for name, args in calls
        for arg in args[MESSAGE_MACROS[name] :]
        if not STRING_ARGS.match(" ".join(arg.split()))
    ]
    assert not bad, f"message arguments that are not strings: {bad}"
