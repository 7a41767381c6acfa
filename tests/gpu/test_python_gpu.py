"""The Python package on a real GPU (skipped without CUDA): install, training
a small transformer, the fraction cap, the MemPool path, memory_viz HTML.

Each scenario of scenarios.py runs in a fresh interpreter, since install()
must precede CUDA's start and lasts for the process; the scenario checks
what it measures and prints it, and the test checks what only the parent can
see (stderr, the files written).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from scenarios import child_env  # noqa: E402

SCENARIOS = Path(__file__).with_name("scenarios.py")


def run_scenario(name: str, out: Path) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, str(out)], env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"scenario {name} failed\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    result_lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert result_lines, proc.stdout
    result = json.loads(result_lines[-1][len("RESULT "):])
    print(f"{name}: {json.dumps(result)}")
    return result, proc


def test_install_sets_every_hook_and_torch_stats_answer_from_goalloc(gpu_out):
    result, _ = run_scenario("install", gpu_out)
    assert result["deferred_frees"] >= 1
    assert result["reserved_after_empty_cache"] < result["reserved_before_empty_cache"]


def test_install_after_cuda_started_says_what_to_do(gpu_out):
    result, _ = run_scenario("install_after_cuda", gpu_out)
    assert "goalloc.install() must run before PyTorch initialises CUDA" in result["message"]


def test_train_small_transformer_memory_allocated_matches_live_tensors(gpu_out):
    result, _ = run_scenario("train", gpu_out)
    last = result["last_step"]
    assert last["torch_memory_allocated"] == last["allocated"]
    assert last["requested"] - last["live_tensor_bytes"] == result["non_tensor_bytes"]


def test_memory_fraction_cap_fails_with_goallocs_message_and_process_goes_on(gpu_out):
    """The message is in the exception, in PyTorch's words, and only there
    (goalloc's C++ class, as PyTorch's allocator: nothing on stderr)."""
    result, proc = run_scenario("fraction", gpu_out)
    assert result["torch_error"].startswith("CUDA out of memory. Tried to allocate"), result["torch_error"]
    assert "(cap " in result["torch_error"]
    assert "out of memory" not in proc.stderr, proc.stderr


def test_mempool_routes_the_block_to_goalloc(gpu_out):
    result, _ = run_scenario("mempool", gpu_out)
    assert result["goalloc_reserved_during"] > 0


def test_dump_snapshot_makes_memory_viz_html(gpu_out):
    result, _ = run_scenario("viz", gpu_out)
    for html in ("goalloc_trace.html", "goalloc_segments.html"):
        assert (gpu_out / html).stat().st_size > 1000
    assert result["events"] > 100
