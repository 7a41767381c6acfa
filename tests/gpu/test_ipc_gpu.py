"""CUDA IPC under goalloc on a GPU (issue 35; skipped without CUDA): runs
ipc_check.py in a fresh process through goalloc's C++ class and asserts on
what it printed. NOT YET RUN ON A GPU: written in a session without one;
the first GPU session runs `bash tests/gpu/run_gpu.sh ipc` and fixes what
fails."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rawlib import run_check  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def result():
    mp = pytest.MonkeyPatch()
    mp.setenv("GOALLOC_CXX", "1")
    mp.delenv("GOALLOC_CONF", raising=False)
    mp.setenv("GOALLOC_DEVICE", "cuda")
    try:
        res = run_check("ipc_check.py", "ipc", timeout=440)
    finally:
        mp.undo()
    assert res["cxx"], res
    return res


def ok(res, name):
    r = res[name]
    assert "error" not in r, f"{name}: {r.get('error')}\n{r.get('trace', '')} (ptrace_scope {res['ptrace_scope']})"
    return r


def test_child_writes_parent_sees(result):
    r = ok(result, "queue")
    assert r["first"] == [0.0, 1.0, 2.0, 3.0] and r["all_42"] and r["exitcode"] == 0, r


def test_three_gib_tensor(result):
    r = ok(result, "big")
    assert r["first"] == [0.0, 1.0, 2.0, 3.0] and r["all_42"] and r["exitcode"] == 0, r


def test_many_small_tensors(result):
    r = ok(result, "many")
    assert r["n"] == 300 and r["max_error"] == 0.0 and r["exitcode"] == 0, r


def test_both_directions(result):
    r = ok(result, "back")
    assert r["seen"] == r["want_seen"] and r["child_sum"] == r["want"] and r["exitcode"] == 0, r


def test_sender_frees_while_receiver_holds(result):
    r = ok(result, "held")
    assert r["cookie_intact"] and not r["reused_early"], r
    assert r["freed_at_collect"] >= r["block_bytes"], "the free waited for the child, then was made"


def test_receiver_without_goalloc(result):
    r = ok(result, "native_rx")
    assert r["backend"] == "native" and r["first"] == [0.0, 1.0, 2.0, 3.0] and r["all_42"], r


def test_native_sender_goalloc_receiver(result):
    r = ok(result, "native_tx")
    for kind in ("expandable", "cudamalloc"):
        assert r[kind]["read_ok"] and r[kind]["child_sum"] == r[kind]["want"], (kind, r)


def test_rl_weight_sync(result):
    r = ok(result, "rl")
    assert r["max_error"] == 0.0 and r["exitcode"] == 0, r


def test_exited_sender_is_a_clear_error(result):
    r = ok(result, "exited")
    assert r["error_text"], "opening a handle of a process that exited must raise, not crash or succeed"


def test_timing_recorded(result):
    r = ok(result, "timing")
    assert r["share_s"] > 0 and r["open_s"] > 0, r
