"""pytest plugin of torch_suite.py: runs inside each pytest process it starts.

- With TORCH_SUITE_ALLOCATOR=goalloc it installs goalloc as torch's allocator
  before pytest imports the test file (PyTorch's test_cuda.py starts CUDA at
  import).
- It appends one JSON line per event to TORCH_SUITE_LOG: "start" when a test
  starts, "done" with its outcome when it ends, "broken" when CUDA no longer
  works after it. torch_suite.py reads that file to learn where a process
  that crashed or hung was.
- After each test it checks that the process can still use the GPU (no
  capture left open, a kernel runs and completes); if not, the process
  exits at once, so that one broken test does not fail all that follow.
- With TORCH_SUITE_RESTART=1 it also ends the process after a test that
  failed: a test that fails midway skips its own clean-up (a memory cap
  set with set_per_process_memory_fraction, allocator settings), which
  would fail the tests after it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

_LOG = open(os.environ["TORCH_SUITE_LOG"], "a", buffering=1, encoding="utf-8")
BROKEN_EXIT = 3  # the exit status that says: the last test left CUDA unusable
FAILED_EXIT = 4  # the last test failed, and TORCH_SUITE_RESTART asks for a fresh process


def _write(**event: Any) -> None:
    event["t"] = round(time.time(), 3)
    _LOG.write(json.dumps(event) + "\n")
    _LOG.flush()


if os.environ.get("TORCH_SUITE_ALLOCATOR") == "goalloc":
    import goalloc

    goalloc.install()
    _write(ev="installed")

_reports: dict[str, dict[str, Any]] = {}


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _reports[nodeid] = {"outcome": None, "message": ""}
    _write(ev="start", test=nodeid)


def _message(report: pytest.TestReport) -> str:
    """The last lines of a failure: the exception, where it was raised."""
    text = report.longreprtext or ""
    lines = [line for line in text.splitlines() if line.strip()]
    tail = "\n".join(lines[-12:])
    return tail[-1500:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    r = _reports.setdefault(report.nodeid, {"outcome": None, "message": ""})
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            r["outcome"] = "xfailed" if report.skipped else "xpassed"
        elif report.skipped:
            r["outcome"] = "skipped"
            longrepr = report.longrepr
            r["message"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[-300:]
        elif report.failed:
            r["outcome"] = "error" if report.when == "setup" else "failed"
            r["message"] = _message(report)
        else:
            r["outcome"] = "passed"
    elif report.when == "teardown" and report.failed and r["outcome"] in (None, "passed", "skipped"):
        r["outcome"] = "error"
        r["message"] = _message(report)


def _cuda_broken() -> str:
    """Why the GPU cannot be used any more, or "" if it can."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return ""
    try:
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph capture is still open on the current stream"
        x = torch.ones(4, device="cuda")
        torch.cuda.synchronize()
        if x.sum().item() != 4:
            return "a kernel computed a wrong result"
    except Exception as e:  # noqa: BLE001 - any failure means the process is spoiled
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return ""


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    r = _reports.pop(nodeid, {"outcome": None, "message": ""})
    outcome = r["outcome"] or "error"
    _write(ev="done", test=nodeid, outcome=outcome, message=r["message"])
    why = _cuda_broken()
    if why:
        _write(ev="broken", test=nodeid, message=why)
        _LOG.close()
        os._exit(BROKEN_EXIT)
    if outcome in ("failed", "error") and os.environ.get("TORCH_SUITE_RESTART") == "1":
        _LOG.close()
        os._exit(FAILED_EXIT)
