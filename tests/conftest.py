"""Shared set-up for the Python tests, on goalloc's simulated device.

The library reads its environment once, when the first call initialises it,
and keeps one allocator per device for the life of the process. So:

- the environment is fixed here, before any test loads the library;
- every test that allocates takes a device of its own (`device` fixture), so
  that tests see exact statistics whatever ran before them;
- whatever must start from a fresh library (configuration, the stderr of an
  out-of-memory, torch's allocator swap) runs in a subprocess (`run_python`).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Iterator

import pytest

from goalloc_testing import Raw

SIM_DEVICES = 64  # the library's maximum; one per test that allocates
SIM_MEMORY = "8G"

# The library reads these when it first initialises; `make pytest` sets them
# on the command line, and a run without them is a mistake worth naming.
REQUIRED_ENV = {"GOALLOC_DEVICE": "sim", "GOALLOC_SIM_DEVICES": str(SIM_DEVICES), "GOALLOC_SIM_MEMORY": SIM_MEMORY}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check the environment once it is known that tests outside tests/gpu run
    (those set up their own children and need none of this)."""
    gpu = Path(__file__).parent / "gpu"
    if any(gpu not in Path(item.fspath).parents for item in items):
        _check_start_environment()


def _check_start_environment() -> None:
    start = dict(os.environ)
    wrong = {k: v for k, v in REQUIRED_ENV.items() if start.get(k) != v}
    if wrong or "GOALLOC_CONF" in start:
        settings = " ".join(f"{k}={v}" for k, v in REQUIRED_ENV.items())
        pytest.exit(
            f"the Python tests run on goalloc's simulated device and need, from the start "
            f"of the process, {settings} and no GOALLOC_CONF; run them with `make pytest`, "
            f"or as `env -u GOALLOC_CONF {settings} python -m pytest tests --ignore=tests/gpu`.",
            returncode=4,
        )


# Device 0 is left untouched by in-process tests (see test_untouched_device).
_devices = itertools.count(1)


@pytest.fixture
def device() -> int:
    """A simulated device no other test in this process has used."""
    d = next(_devices)
    if d >= SIM_DEVICES:
        pytest.fail(f"more than {SIM_DEVICES - 1} tests asked for a fresh device; raise SIM_DEVICES")
    return d


@pytest.fixture(scope="session")
def raw() -> Raw:
    return Raw()


@pytest.fixture
def history() -> Iterator[None]:
    """Event recording on for the test, off after it (it is process-wide)."""
    import goalloc

    goalloc.record_history(True, max_entries=10_000)
    yield
    goalloc.record_history(False)


