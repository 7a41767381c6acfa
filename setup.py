"""Build hook for the goalloc Python package.

The package is pure Python except for libgoalloc.so, the Go library that
PyTorch loads as its CUDA allocator. `pip install .` builds that library with
the Go toolchain (the same command as `make lib`) and ships it inside the
package, so a user never runs `go build`. Where Go is not available (the GPU
machine, a container), GOALLOC_LIBRARY=/path/to/libgoalloc.so ships a library
built elsewhere instead.

Everything else (name, version, layout) is in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
LIBRARY = "libgoalloc.so"


class GoallocBuildError(SetupError):
    """The Go library could not be built or found; the message says what to do."""


def build_library(dest: Path) -> None:
    """Put libgoalloc.so at dest: a copy of $GOALLOC_LIBRARY, or a fresh Go build."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    prebuilt = os.environ.get("GOALLOC_LIBRARY")
    if prebuilt:
        src = Path(prebuilt).expanduser()
        if not src.is_file():
            raise GoallocBuildError(
                f"goalloc: GOALLOC_LIBRARY={prebuilt!r} is not a file; point it at a "
                f"libgoalloc.so built with `make lib`, or unset it to build with Go."
            )
        print(f"goalloc: shipping the prebuilt library {src} (GOALLOC_LIBRARY)")
        shutil.copyfile(src, dest)
        return

    go = shutil.which(os.environ.get("GO", "go"))
    if go is None:
        raise GoallocBuildError(
            "goalloc: installing this package builds libgoalloc.so with the Go "
            "toolchain, and `go` was not found on PATH. Either install Go "
            "(the version named in go.mod) and run the install again, or build the "
            "library on another machine (`make lib`) and install with "
            "GOALLOC_LIBRARY=/path/to/libgoalloc.so set, which ships that file instead."
        )
    if not (ROOT / "go.mod").is_file() or not (ROOT / "export").is_dir():
        raise GoallocBuildError(
            f"goalloc: the Go sources (go.mod, export/) are not next to setup.py in "
            f"{ROOT}; install from a full checkout, or set GOALLOC_LIBRARY."
        )
    # Build into a scratch folder: -buildmode=c-shared also writes a C header,
    # which does not belong in the package.
    with tempfile.TemporaryDirectory(prefix="goalloc-build-") as tmp:
        out = Path(tmp) / LIBRARY
        cmd = [go, "build", "-buildmode=c-shared", "-trimpath", "-o", str(out), "./export"]
        print("goalloc: " + " ".join(cmd))
        env = dict(os.environ, CGO_ENABLED="1")
        try:
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        except subprocess.CalledProcessError as e:
            raise GoallocBuildError(
                f"goalloc: `{' '.join(cmd)}` failed (exit {e.returncode}); see the Go "
                f"output above. cgo needs a C compiler (cc). To skip the build, set "
                f"GOALLOC_LIBRARY=/path/to/libgoalloc.so."
            ) from None
        shutil.copyfile(out, dest)


class BuildPyWithLibrary(build_py):
    """build_py that also puts libgoalloc.so into the goalloc package.

    A regular install writes it into the build tree, from which it goes into
    the wheel. An editable install (`pip install -e .`) imports the package
    from python/goalloc, so the library is written there (it is gitignored).
    """

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            dest = ROOT / "python" / "goalloc" / LIBRARY
        else:
            dest = Path(self.build_lib) / "goalloc" / LIBRARY
        build_library(dest)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs.append(str(Path(self.build_lib) / "goalloc" / LIBRARY))
        return outputs


class BinaryDistribution(Distribution):
    """Marks the wheel as platform-specific: it carries a native library."""

    def has_ext_modules(self) -> bool:
        return True


class BdistWheelAnyPython(bdist_wheel):
    """Tag the wheel py3-none-<platform>: the library is loaded with ctypes and
    uses no Python C API, so one wheel serves every Python 3 on the platform
    (build it where Go is, install it where the GPU is)."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": BdistWheelAnyPython},
    distclass=BinaryDistribution,
)
