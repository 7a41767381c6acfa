"""Build hook for the goalloc Python package.

The package is Python plus two native files built with Go: libgoalloc.so,
the library PyTorch loads as its CUDA allocator, and bin/goalloc, the
command-line tool (`goalloc replay ...`), which the package's `goalloc`
command and `python -m goalloc` run. `pip install .` builds both with the Go
toolchain (the commands of `make lib` and `make tool`) and ships them inside
the package, so a user never runs `go build`. Where Go is not available (the
GPU machine, a container), GOALLOC_LIBRARY=/path/to/libgoalloc.so and
GOALLOC_TOOL=/path/to/goalloc ship files built elsewhere instead.

The native files are stripped: the Go builds link with -s -w, and prebuilt
copies (and a C++ class built here) go through `strip` where there is one.
The tool also carries the package's version (`goalloc --version`).

Everything is built in a scratch folder, never in ./build: that is the
Makefile's, and what an earlier build left there (`make tool`, an older
install) must not go into the wheel.

The wheel is tagged py3-none-manylinux_2_X_<arch>, X read off the native
files it carries (wheel_tag.py). Name and layout are in pyproject.toml; the
version is goalloc.__version__.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import wheel_tag  # noqa: E402  (beside this file; the sdist carries it)


# goalloc.__version__, read without importing the package (which needs its
# library to do anything).
VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "python" / "goalloc" / "__init__.py").read_text(),
                    re.M).group(1)

# setuptools builds under ./build unless told otherwise (build_base), and
# ships whatever lies in its build_lib there: a tool an earlier build left
# went into a wheel that was built without one. Each run of this script
# builds in a folder of its own instead, removed when it ends. A
# --build-base on the command line still wins.
BUILD_BASE = tempfile.mkdtemp(prefix="goalloc-setup-")
atexit.register(shutil.rmtree, BUILD_BASE, ignore_errors=True)


def strip(path: Path) -> None:
    """Strip path in place (its symbol table and debug sections; the
    dynamic symbols ctypes and torch look up stay), as the Go builds are
    (-s -w). Where there is no `strip` or it fails, the file is shipped as
    it is, saying so: a larger wheel, not a broken one."""
    tool = shutil.which(os.environ.get("STRIP", "strip"))
    if tool is None:
        print(f"goalloc: no `strip` on PATH: {path.name} is shipped unstripped")
        return
    r = subprocess.run([tool, "--strip-all", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"goalloc: `strip` failed on {path.name} ({r.stderr.strip()}); it is shipped unstripped")


class GoallocBuildError(SetupError):
    """A native file could not be built or found; the message says what to do."""


@dataclass(frozen=True)
class NativeFile:
    """One file the package carries that is built from the Go sources.

    A build step for another native file (or another language) is one more
    entry in NATIVE_FILES with its own build method.
    """

    name: str  # path inside the goalloc package
    env: str  # the variable naming a prebuilt copy
    go_args: tuple[str, ...]  # go build's arguments before -o; the package last
    ldflags: str  # the linker's flags (-s -w: no symbol table, no DWARF)
    make_target: str  # the Makefile target that builds it in a checkout
    # Whether an install without Go and without the prebuilt copy may go on
    # without it (the package then says how to get it when it is wanted).
    optional: bool

    def build(self, dest: Path) -> bool:
        """Put the file at dest: a copy of $env, or a fresh Go build.
        Returns False where an optional file was left out."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        prebuilt = os.environ.get(self.env)
        if prebuilt:
            src = Path(prebuilt).expanduser()
            if not src.is_file():
                raise GoallocBuildError(
                    f"goalloc: {self.env}={prebuilt!r} is not a file; point it at a "
                    f"{Path(self.name).name} built with `make {self.make_target}`, or unset it "
                    f"to build with Go."
                )
            print(f"goalloc: shipping the prebuilt {src} ({self.env})")
            shutil.copyfile(src, dest)
            shutil.copymode(src, dest)
            strip(dest)
            return True

        go = shutil.which(os.environ.get("GO", "go"))
        if go is None:
            if self.optional and any(os.environ.get(f.env) for f in NATIVE_FILES):
                print(f"goalloc: no Go and no {self.env}: the package goes without {self.name}")
                return False
            raise GoallocBuildError(
                f"goalloc: installing this package builds {Path(self.name).name} with the Go "
                f"toolchain, and `go` was not found on PATH. Either install Go (the "
                f"version named in go.mod) and run the install again, or build it on "
                f"another machine (`make {self.make_target}`) and install with "
                f"{self.env}=/path/to/{Path(self.name).name} set, which ships that file instead."
            )
        if not (ROOT / "go.mod").is_file() or not (ROOT / self.go_args[-1]).is_dir():
            raise GoallocBuildError(
                f"goalloc: the Go sources (go.mod, {self.go_args[-1]}/) are not next to "
                f"setup.py in {ROOT}; install from a full checkout or the sdist, or set "
                f"{self.env}."
            )
        # Build into a scratch folder: -buildmode=c-shared also writes a C
        # header, which does not belong in the package.
        with tempfile.TemporaryDirectory(prefix="goalloc-build-") as tmp:
            out = Path(tmp) / Path(self.name).name
            cmd = [go, "build", *self.go_args[:-1], "-trimpath", f"-ldflags={self.ldflags}",
                   "-o", str(out), self.go_args[-1]]
            print("goalloc: " + " ".join(cmd))
            env = dict(os.environ, CGO_ENABLED="1")
            try:
                subprocess.run(cmd, cwd=ROOT, env=env, check=True)
            except subprocess.CalledProcessError as e:
                raise GoallocBuildError(
                    f"goalloc: `{' '.join(cmd)}` failed (exit {e.returncode}); see the Go "
                    f"output above. cgo needs a C and C++ compiler (cc, c++). To skip the "
                    f"build, set {self.env}=/path/to/{Path(self.name).name}."
                ) from None
            shutil.copyfile(out, dest)
            shutil.copymode(out, dest)
        return True


NATIVE_FILES = [
    NativeFile("libgoalloc.so", "GOALLOC_LIBRARY", ("-buildmode=c-shared", "./export"), "-s -w", "lib",
               optional=False),
    NativeFile("bin/goalloc", "GOALLOC_TOOL", ("./cmd/goalloc",), f"-s -w -X main.version={VERSION}", "tool",
               optional=True),
]


class BuildPyWithNativeFiles(build_py):
    """build_py that also puts the native files into the goalloc package.

    A regular install writes them into the build tree, from which they go
    into the wheel. An editable install (`pip install -e .`) imports the
    package from python/goalloc, so they are written there (gitignored).
    """

    def run(self) -> None:
        super().run()
        self._built: list[str] = []
        for native in NATIVE_FILES:
            dest = self._package_dir() / native.name
            if native.build(dest):
                self._built.append(str(dest))
            elif dest.exists():
                # Left by an earlier build (an editable install writes into
                # python/goalloc): it would pass for this build's.
                dest.unlink()
        if build_cxx_class(self._package_dir()):
            for so in sorted((self._package_dir() / "cxxbuild").glob("*/*.so")):
                strip(so)

    def _package_dir(self) -> Path:
        if self.editable_mode:
            return ROOT / "python" / "goalloc"
        return Path(self.build_lib) / "goalloc"

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs += [str(self._package_dir() / n.name) for n in NATIVE_FILES
                        if (self._package_dir() / n.name).is_file()]
            outputs += [str(p) for p in sorted((self._package_dir() / "cxxbuild").glob("*/*.so"))]
        return outputs


def build_cxx_class(package_dir: Path) -> bool:
    """Where torch is importable while the package is built (`pip install
    --no-build-isolation .` beside torch), build goalloc's C++ allocator class
    into the package now (goalloc/cxxbuild/<torch version>/), so that the
    first goalloc.install() finds it instead of compiling for a minute.
    Otherwise, or if that build fails, the class is built at the first
    install(), cached per torch version: this never fails the package's
    build. GOALLOC_CXX=0 skips it, as it skips the class at run time."""
    if os.environ.get("GOALLOC_CXX") == "0":
        return False
    probe = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], capture_output=True)
    if probe.returncode != 0:
        return False  # no torch here: the first install() builds the class
    env = dict(os.environ, GOALLOC_LIBRARY=str(package_dir / "libgoalloc.so"),
               PYTHONPATH=os.pathsep.join([str(package_dir.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    print("goalloc: torch is importable here: building the C++ allocator class into the package")
    r = subprocess.run([sys.executable, "-m", "goalloc._cxx", "--into-package"], env=env, cwd=ROOT)
    if r.returncode != 0:
        print("goalloc: the C++ allocator class could not be built now; the first goalloc.install() "
              "will try again (and say what is missing)")
        return False
    return True


class BinaryDistribution(Distribution):
    """Marks the wheel as platform-specific: it carries native files."""

    def has_ext_modules(self) -> bool:
        return True


class BdistWheelManylinux(bdist_wheel):
    """Tag the wheel py3-none-manylinux_2_X_<arch>.

    py3-none: the library is loaded with ctypes and uses no Python C API, so
    one wheel serves every Python 3 on the platform (build it where Go is,
    install it where the GPU is). manylinux_2_X: the tag PyPI takes, X the
    newest glibc the native files need (wheel_tag.py). A --plat-name given
    on the command line is kept as it is.
    """

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        if not self.plat_name_supplied and platform.startswith("linux_"):
            files = [p for p in Path(self.bdist_dir).rglob("*") if p.is_file() and not p.is_symlink()]
            tag, why = wheel_tag.manylinux_tag(files, platform)
            if why and tag != getattr(self, "_reported_tag", None):
                print(f"goalloc: the wheel stays {tag}, which PyPI does not take: " + "; ".join(why))
            self._reported_tag = tag
            platform = tag
        return "py3", "none", platform


setup(
    cmdclass={"build_py": BuildPyWithNativeFiles, "bdist_wheel": BdistWheelManylinux},
    distclass=BinaryDistribution,
    options={"build": {"build_base": BUILD_BASE}},
)
