"""tests/gpu/torch_suite.py, the runner of PyTorch's CUDA tests, on a stand-in.

The runner's job is isolation: a test that crashes, hangs or leaves CUDA
unusable must not fail the tests after it. These tests give it a test file
that does each of those, over a stand-in `torch` module (the plugin asks it
whether CUDA still works), and check every outcome it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "gpu" / "torch_suite.py"

FAKE_TORCH = '''
__version__ = "0.0-stand-in"
import os

class _Cuda:
    def is_initialized(self):
        return True
    def is_current_stream_capturing(self):
        return os.path.exists(os.environ["FAKE_BROKEN"])
    def synchronize(self):
        pass
    def ones(self, *a, **k):
        raise AssertionError("not reached")

cuda = _Cuda()

class _T:
    def sum(self):
        return self
    def item(self):
        return 4

def ones(*a, **k):
    return _T()
'''

# unittest runs a class's tests in name order: the letters keep them in this order.
TESTS = '''
import os, signal, time, unittest

import torch  # noqa: F401 - the plugin asks the stand-in whether CUDA works

POISONED = False

class TestCuda(unittest.TestCase):
    def test_a_ok1(self):
        pass

    def test_b_bad2(self):
        global POISONED
        POISONED = True  # state a failing test leaves behind (a memory cap, say)
        self.assertEqual(1, 2)

    def test_bb_clean(self):
        # A fresh process after the failure: its state is gone.
        self.assertFalse(POISONED)

    def test_c_segv3(self):
        if os.environ.get("ALONE_MARK") and os.path.exists(os.environ["ALONE_MARK"]):
            return  # passes when run alone, after the first pass
        os.kill(os.getpid(), signal.SIGSEGV)

    def test_d_after4(self):
        pass

    def test_e_breaks5(self):
        open(os.environ["FAKE_BROKEN"], "w").close()

    def test_f_heal6(self):
        # A fresh process: the stand-in says CUDA works again.
        pass

    def test_g_hang7(self):
        time.sleep(60)

    def test_h_skip8(self):
        raise unittest.SkipTest("not here")

class TestOther(unittest.TestCase):
    def test_not_in_scope(self):
        pass
'''


@pytest.fixture()
def suite(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "torch.py").write_text(FAKE_TORCH)
    (tmp_path / "fake" / "goalloc.py").write_text("def install():\n    pass\n")
    test_file = tmp_path / "suite" / "test_cuda.py"
    test_file.parent.mkdir()
    test_file.write_text(TESTS)
    # The broken marker is removed by each new process's first test (the
    # runner starts a fresh one after a break), as a real restart heals CUDA.
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), FAKE_BROKEN=str(tmp_path / "broken"))
    return test_file, env


def run(test_file: Path, env: dict[str, str], out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RUNNER), str(test_file), "--out", str(out), "--test-timeout", "4",
                           "--classes", "TestCuda", *args], env=env, capture_output=True, text=True, timeout=240)


def test_each_test_gets_its_own_outcome(suite: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    test_file, env = suite
    out = tmp_path / "native.json"
    # test_e_breaks5 leaves the marker; the process after it must not
    # see it, so test_f removes it as the first thing a new process does.
    Path(env["FAKE_BROKEN"]).unlink(missing_ok=True)
    test_file.write_text(TESTS.replace(
        "    def test_f_heal6(self):\n",
        "    def test_f_heal6(self):\n        os.path.exists(os.environ['FAKE_BROKEN']) and os.remove(os.environ['FAKE_BROKEN'])\n"))
    p = run(test_file, env, out, "--allocator", "native", "--revision", "abc")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    got = res["native"]
    assert got["TestCuda::test_a_ok1"] == "passed"
    assert got["TestCuda::test_b_bad2"] == "failed"
    assert got["TestCuda::test_bb_clean"] == "passed", "the process after a failure is a fresh one"
    assert "TestCuda::test_bb_clean" not in res["native_sequence"], "it passed the first time, not only alone"
    assert got["TestCuda::test_c_segv3"] == "crashed"
    assert got["TestCuda::test_d_after4"] == "passed"
    assert got["TestCuda::test_e_breaks5"] == "broke"
    assert got["TestCuda::test_f_heal6"] == "passed"
    assert got["TestCuda::test_g_hang7"] == "timeout"
    assert got["TestCuda::test_h_skip8"] == "skipped"
    assert "TestOther::test_not_in_scope" not in got
    assert res["revision"] == "abc" and res["torch"] == "0.0-stand-in"
    assert "1 == 2" in res["native_messages"]["TestCuda::test_b_bad2"] or "2" in res["native_messages"]["TestCuda::test_b_bad2"]


def test_a_failure_that_passes_alone_is_reported_with_its_sequence_outcome(
        suite: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    test_file, env = suite
    mark = tmp_path / "alone"
    env = dict(env, ALONE_MARK=str(mark))
    # The crash happens in the first pass only: the mark appears once the
    # first pass is past it (test_d runs after the crash, in a new process).
    test_file.write_text(TESTS.replace(
        "    def test_d_after4(self):\n        pass\n",
        "    def test_d_after4(self):\n        open(os.environ['ALONE_MARK'], 'w').close()\n"))
    out = tmp_path / "goalloc.json"
    p = run(test_file, env, out, "--allocator", "native", "-k", "ok1 or bad2 or segv3 or after4")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["native"]["TestCuda::test_c_segv3"] == "passed", (res, p.stdout)
    assert res["native_sequence"] == {"TestCuda::test_c_segv3": "crashed"}, p.stdout
    assert res["native"]["TestCuda::test_b_bad2"] == "failed"
    assert "TestCuda::test_b_bad2" not in res["native_sequence"]


def test_merge_compares_the_two_allocators(suite: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    test_file, env = suite
    out = tmp_path / "both.json"
    out.write_text(json.dumps({"native": {"TestCuda::test_a_ok1": "passed", "TestCuda::test_b_bad2": "passed",
                                          "TestCuda::test_h_skip8": "skipped"}}))
    p = run(test_file, env, out, "--allocator", "goalloc", "--merge", str(out), "-k", "ok1 or bad2 or skip8")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["native"]["TestCuda::test_b_bad2"] == "passed"  # kept from the merged file
    assert res["summary"] == {"native_passed": 2, "goalloc_passed_of_those": 1, "excepted": 0,
                              "regressions": ["TestCuda::test_b_bad2"]}
    assert "1 of PyTorch's 2 passing tests pass under goalloc" in p.stdout
    # A run of all tests replaces the allocator's outcomes: its earlier runs leave the provenance.
    res["runs"] = [{"allocator": "goalloc", "select": "unpassed", "commit": "old"},
                   {"allocator": "native", "select": "all", "commit": "old"}]
    out.write_text(json.dumps(res))
    p = run(test_file, env, out, "--allocator", "goalloc", "--merge", str(out), "-k", "ok1")
    assert p.returncode == 0, p.stdout + p.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(r["allocator"], r["commit"]) for r in runs[:1]] == [("native", "old")] and len(runs) == 2, runs


def test_a_run_of_some_classes_keeps_the_others(suite: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """--select all over TestCuda replaces TestCuda's outcomes and runs alone:
    another class's goalloc outcomes, and the run that gave them, stay."""
    test_file, env = suite
    out = tmp_path / "both.json"
    out.write_text(json.dumps({
        "classes": ["TestCuda", "TestMemPool"],
        "native": {"TestCuda::test_a_ok1": "passed", "TestMemPool::test_pool": "passed"},
        "goalloc": {"TestCuda::test_a_ok1": "failed", "TestMemPool::test_pool": "passed"},
        "runs": [{"allocator": "goalloc", "select": "all", "commit": "old"}]}))
    p = run(test_file, env, out, "--allocator", "goalloc", "--merge", str(out), "-k", "ok1")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["goalloc"] == {"TestCuda::test_a_ok1": "passed", "TestMemPool::test_pool": "passed"}
    assert res["summary"]["regressions"] == [] and res["classes"] == ["TestCuda", "TestMemPool"]
    assert [(r["commit"], r.get("classes")) for r in res["runs"]][0] == ("old", None), res["runs"]
    assert res["runs"][1]["classes"] == ["TestCuda"]


def test_a_merge_across_two_revisions_of_the_file_is_refused(suite: tuple[Path, dict[str, str]],
                                                              tmp_path: Path) -> None:
    """Outcomes of PyTorch's file at one revision are not merged into those
    of another: the merged file would name one revision and hold both."""
    test_file, env = suite
    out = tmp_path / "both.json"
    earlier = {"revision": "aaa", "native": {"TestCuda::test_a_ok1": "passed"}}
    out.write_text(json.dumps(earlier))
    p = run(test_file, env, out, "--allocator", "goalloc", "--merge", str(out), "--revision", "bbb", "-k", "ok1")
    assert p.returncode == 2 and "at aaa, not bbb" in p.stderr, p.stdout + p.stderr
    assert json.loads(out.read_text()) == earlier, "nothing written"
    p = run(test_file, env, out, "--allocator", "goalloc", "--merge", str(out), "--revision", "aaa", "-k", "ok1")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["revision"] == "aaa" and res["goalloc"] == {"TestCuda::test_a_ok1": "passed"}


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "nope.py"), "--allocator", "native"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "no such file" in p.stderr


def test_select_runs_only_what_the_merged_file_lacks(suite: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    test_file, env = suite
    out = tmp_path / "part.json"
    # bad2 "passed" before: with --select missing it is not run again and keeps that outcome.
    out.write_text(json.dumps({"native": {"TestCuda::test_b_bad2": "passed", "TestCuda::test_a_ok1": "not run"},
                               "native_messages": {"TestCuda::test_zz_gone": "kept"}}))
    p = run(test_file, env, out, "--allocator", "native", "--merge", str(out), "--select", "missing",
            "-k", "ok1 or bad2 or skip8")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["native"] == {"TestCuda::test_b_bad2": "passed", "TestCuda::test_a_ok1": "passed",
                             "TestCuda::test_h_skip8": "skipped"}
    assert res["native_messages"]["TestCuda::test_zz_gone"] == "kept"
    assert "2 tests (missing)" in p.stdout
    # unpassed: only what did not pass runs again.
    p = run(test_file, env, out, "--allocator", "native", "--merge", str(out), "--select", "unpassed",
            "-k", "ok1 or bad2 or skip8")
    assert "0 tests (unpassed)" in p.stdout, p.stdout
    # regressions: what did not pass under this allocator but passed under PyTorch's.
    res = json.loads(out.read_text())
    res["goalloc"] = {"TestCuda::test_a_ok1": "failed", "TestCuda::test_b_bad2": "failed"}
    res["native"]["TestCuda::test_b_bad2"] = "failed"
    out.write_text(json.dumps(res))
    p = run(test_file, env, out, "--allocator", "goalloc", "--merge", str(out), "--select", "regressions",
            "-k", "ok1 or bad2 or skip8")
    assert "1 tests (regressions)" in p.stdout, p.stdout
    assert json.loads(out.read_text())["goalloc"] == {"TestCuda::test_a_ok1": "passed", "TestCuda::test_b_bad2": "failed"}
    p = subprocess.run([sys.executable, str(RUNNER), str(test_file), "--allocator", "native", "--select", "missing"],
                       env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "needs a --merge file" in p.stderr
