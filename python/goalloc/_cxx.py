"""goalloc's C++ allocator class for PyTorch (csrc/goalloc_torch.cpp): find
it built, or build it, and load it.

The class implements PyTorch's c10 CUDAAllocator over libgoalloc.so, so
that everything torch asks of its allocator is answered by goalloc:
statistics and snapshots through torch's own functions, out-of-memory as
torch.OutOfMemoryError, cudnn.benchmark, torch.cuda.MemPool and
torch.compile(mode="reduce-overhead"). It must be compiled against the
installed torch, so it is built once per torch version and Python version,
with torch.utils.cpp_extension (a C++ compiler, ninja, torch's headers and
the CUDA runtime headers), and kept:

  - in the package, under cxxbuild/, when `python -m goalloc._cxx
    --into-package` ran where the package was installed;
  - otherwise in GOALLOC_CXX_CACHE, or ~/.cache/goalloc (XDG_CACHE_HOME),
    where the first goalloc.install() builds it (about a minute).

Where it cannot be built or loaded, install() falls back to torch's
CUDAPluggableAllocator, after one warning that says what is missing and what
then does not work. GOALLOC_CXX=0 asks for the fallback without a warning;
GOALLOC_CXX=1 makes a failure to build an error instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

SOURCE = Path(__file__).resolve().parent / "csrc" / "goalloc_torch.cpp"
#: What SOURCE includes from its folder: part of the source text.
HEADERS = tuple(Path(__file__).resolve().parent / "csrc" / h
                for h in ("goalloc.h", "goalloc_contexts.h", "goalloc_front.h", "goalloc_ipc.h",
                          "goalloc_sched.h", "goalloc_split.h"))
PACKAGE_BUILDS = Path(__file__).resolve().parent / "cxxbuild"

#: What the fallback, torch's CUDAPluggableAllocator, cannot do (PyTorch 2.11).
FALLBACK_LIMITS = (
    "goalloc stays torch's allocator through torch.cuda.memory.CUDAPluggableAllocator, where an "
    "out-of-memory raises RuntimeError instead of torch.OutOfMemoryError; torch.cuda.memory_stats() and "
    "its family answer through goalloc's replacements of torch's private statistics functions; and "
    "torch.backends.cudnn.benchmark, torch.compile(mode=\"reduce-overhead\") and torch.cuda.MemPool() "
    "fail with \"CUDAPluggableAllocator does not yet support ...\""
)

_lock = threading.Lock()
_module: Optional[ModuleType] = None
_failure: Optional[str] = None  # why the class is not available, once known


class Unavailable(RuntimeError):
    """The C++ allocator class cannot be built or loaded here."""


def mode() -> str:
    """GOALLOC_CXX: "auto" (default), "0" (never) or "1" (required)."""
    v = os.environ.get("GOALLOC_CXX", "auto").strip().lower()
    if v in ("0", "off", "no", "false"):
        return "0"
    if v in ("1", "on", "yes", "true"):
        return "1"
    return "auto"


def module_name() -> str:
    """The extension's name: one per source text, so that a changed source
    is a new module (Python cannot reload an extension of the same name)."""
    h = hashlib.sha256()
    for f in (SOURCE, *HEADERS):
        h.update(f.read_bytes())
    digest = h.hexdigest()[:12]
    return f"goalloc_torch_{digest}"


def build_tag(torch: ModuleType) -> str:
    """The folder of a build: the extension binds to one torch and one Python."""
    version = str(getattr(torch, "__version__", "unknown")).replace("/", "_").replace("+", "_")
    return f"torch-{version}-py{sys.version_info.major}{sys.version_info.minor}"


def cache_dir(torch: ModuleType) -> Path:
    root = os.environ.get("GOALLOC_CXX_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "goalloc")
    return Path(root) / build_tag(torch)


def _cuda_headers(torch: ModuleType) -> tuple[Optional[str], list[str], list[str]]:
    """Where the CUDA runtime headers are: ("toolkit", [], []) when
    torch.utils.cpp_extension finds a CUDA toolkit, or the include and link
    flags of the CUDA runtime wheel that pip installs with torch; None when
    neither has them."""
    from torch.utils import cpp_extension

    if getattr(cpp_extension, "CUDA_HOME", None):
        return "toolkit", [], []
    try:
        import nvidia  # the namespace package of the CUDA wheels
    except ImportError:
        return None, [], []
    for base in map(Path, getattr(nvidia, "__path__", [])):
        for inc in sorted(base.glob("*/include")):
            if (inc / "cuda_runtime_api.h").is_file() and (inc / "crt" / "host_config.h").is_file():
                lib = inc.parent / "lib"
                return "wheel", [str(inc)], [f"-L{lib}", "-l:libcudart.so" + _soversion(lib)]
    return None, [], []


def _soversion(lib: Path) -> str:
    found = sorted(lib.glob("libcudart.so.*"))
    return found[0].name[len("libcudart.so"):] if found else ""


def missing(torch: ModuleType) -> list[str]:
    """What building the class needs and this machine lacks."""
    lacks = []
    include = Path(getattr(torch, "__file__", "") or ".").parent / "include"
    if not (include / "torch" / "extension.h").is_file():
        lacks.append(f"PyTorch's C++ headers ({include}/torch/extension.h)")
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        lacks.append("a C++ compiler (c++ or g++ on PATH, or CXX)")
    if not shutil.which("ninja"):
        try:
            import ninja  # noqa: F401  (the pip package puts the binary on PATH)
        except ImportError:
            lacks.append("ninja (pip install ninja)")
    if not lacks:
        try:
            kind, _, _ = _cuda_headers(torch)
        except ImportError as e:
            lacks.append(f"torch.utils.cpp_extension ({e})")
        else:
            if kind is None:
                lacks.append("the CUDA runtime headers (a CUDA toolkit: set CUDA_HOME, or put nvcc on PATH; or "
                             "`pip install nvidia-cuda-crt` of torch's CUDA version, which completes the headers "
                             "of the CUDA wheels installed with torch)")
    return lacks


def _import_built(name: str, folder: Path) -> Optional[ModuleType]:
    """The extension built before in folder, or None."""
    for path in sorted(folder.glob(name + "*.so")):
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            continue
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return None


def build(torch: ModuleType, into: Optional[Path] = None, verbose: bool = False) -> ModuleType:
    """Build the class into `into` (the cache folder if None) and load it.

    Raises Unavailable with what is missing, or with the compiler's errors.
    """
    lacks = missing(torch)
    if lacks:
        raise Unavailable("missing " + "; ".join(lacks))
    from torch.utils import cpp_extension

    folder = into or cache_dir(torch)
    folder.mkdir(parents=True, exist_ok=True)
    kind, includes, ldflags = _cuda_headers(torch)
    sys.stderr.write(f"goalloc: building the C++ allocator class for torch {torch.__version__} in {folder} "
                     f"(once per torch version; about a minute)\n")
    try:
        return cpp_extension.load(
            name=module_name(),
            sources=[str(SOURCE)],
            build_directory=str(folder),
            extra_cflags=["-O2"],
            extra_include_paths=includes,
            extra_ldflags=ldflags + ([] if kind == "toolkit" else ["-lc10_cuda", "-ltorch_cuda"]),
            with_cuda=kind == "toolkit",
            verbose=verbose,
        )
    except Exception as e:  # a compiler error, a linker error, a failed import
        raise Unavailable(f"building {SOURCE.name} failed: {e}") from e


def load(torch: ModuleType) -> Optional[ModuleType]:
    """The class's extension module, built if need be; None, after one
    warning per process, where it cannot be had (see FALLBACK_LIMITS).
    With GOALLOC_CXX=0 it is None without a warning; with GOALLOC_CXX=1 a
    failure raises Unavailable."""
    global _module
    if mode() == "0":
        return None
    with _lock:
        if _module is not None:
            return _module
        if _failure is None:
            try:
                name = module_name()
                _module = (_import_built(name, PACKAGE_BUILDS / build_tag(torch))
                           or _import_built(name, cache_dir(torch))
                           or build(torch))
                return _module
            except Exception as e:  # Unavailable, an import error, an unwritable cache
                give_up(str(e), e)
        elif mode() == "1":
            raise Unavailable(f"goalloc: the C++ allocator class is required (GOALLOC_CXX=1): {_failure}")
        return None


def give_up(reason: str, cause: Optional[BaseException] = None) -> None:
    """Record why the class is not used in this process, and warn once (or,
    with GOALLOC_CXX=1, raise Unavailable)."""
    global _failure
    first = _failure is None
    _failure = reason
    if mode() == "1":
        raise Unavailable(f"goalloc: the C++ allocator class is required (GOALLOC_CXX=1): {reason}") from cause
    if first:
        warnings.warn(
            f"goalloc: the C++ allocator class is not available: {reason}. Falling back: {FALLBACK_LIMITS}. "
            f"Set GOALLOC_CXX=0 to choose the fallback without this warning.",
            RuntimeWarning,
            stacklevel=6,  # the caller of goalloc.install()
        )


def failure() -> Optional[str]:
    """Why the class could not be had in this process, if it could not."""
    return _failure


def main(argv: Optional[list[str]] = None) -> int:
    """python -m goalloc._cxx [--into-package] [--verbose]: build the class now."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m goalloc._cxx", description=main.__doc__)
    p.add_argument("--into-package", action="store_true",
                   help=f"build into {PACKAGE_BUILDS} instead of the user cache")
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = p.parse_args(argv)
    import torch

    into = PACKAGE_BUILDS / build_tag(torch) if args.into_package else None
    try:
        mod = build(torch, into=into, verbose=args.verbose)
    except Unavailable as e:
        print(f"goalloc: {e}", file=sys.stderr)
        return 1
    if into is not None:  # the package keeps the extension, not its build files
        for p in into.iterdir():
            if p.suffix != ".so":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    print(f"goalloc: built {mod.__file__}")
    return 0


def _loaded_library_path() -> str:
    """The path the package loaded libgoalloc.so from: the class must open
    that same library, so that both talk to one Go runtime."""
    from . import _lib

    return str(_lib.lib()._name)


def install(module: ModuleType) -> bool:
    """Make the class torch's CUDA allocator (before CUDA starts). False,
    having warned, when the class cannot open the library (one too old for
    it): torch's allocator is then unchanged and the fallback can be used.
    torch's refusal after CUDA has started is raised as it is."""
    try:
        module.install(_loaded_library_path())
    except RuntimeError as e:
        if "already initialized" in str(e):
            raise
        give_up(str(e).splitlines()[0], e)
        return False
    return True


def installed(module: Optional[ModuleType] = None) -> bool:
    mod = module or _module
    return bool(mod is not None and mod.is_installed())


if __name__ == "__main__":
    sys.exit(main())

