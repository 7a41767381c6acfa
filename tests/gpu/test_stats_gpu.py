"""torch.cuda.memory_allocated() and its siblings after goalloc.install(), on
a real GPU (skipped without CUDA): stats_check.py in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from scenarios import child_env  # noqa: E402


def test_torch_per_step_statistics_answer_from_goalloc_within_2us():
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("stats_check.py"))], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        print(lines[-1])  # the per-call costs, for the run's log
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert not result["over_budget"]
