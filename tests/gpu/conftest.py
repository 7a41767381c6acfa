"""Set-up for the GPU tests: the package from the source tree, the library
from build/ (the GPU machine has no Go), and a fresh process per scenario.

    make lib                                   # where Go is; carry build/ over
    GOALLOC_GPU_OUT=gpu-out python -m pytest -q tests/gpu

GOALLOC_LIBRARY, if set, names the library instead of build/libgoalloc.so;
GOALLOC_GPU_OUT is where the memory_viz HTML goes (default: a temporary folder).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from scenarios import ROOT, child_env  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the GPU tests, saying why, when the library is not there. (The
    test module itself skips without torch or CUDA.)"""
    library = Path(child_env()["GOALLOC_LIBRARY"])
    if library.is_file():
        return
    reason = f"needs {library}: run `make lib` where Go is and bring build/ along, or set GOALLOC_LIBRARY"
    gpu = Path(__file__).parent
    for item in items:
        if gpu in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where scenarios write their files (the memory_viz HTML)."""
    out = os.environ.get("GOALLOC_GPU_OUT")
    path = Path(out).resolve() if out else tmp_path_factory.mktemp("goalloc-gpu")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT
