"""CUDA IPC under goalloc on a GPU (issue 35; skipped without CUDA): each
scenario of ipc_check.py runs in a fresh process through goalloc's C++
class (a crash or hang ends that scenario alone), and the test asserts on
what it printed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rawlib import run_check  # noqa: E402

MiB = 1 << 20


def check(name, timeout=90):
    mp = pytest.MonkeyPatch()
    mp.setenv("GOALLOC_CXX", "1")
    mp.delenv("GOALLOC_CONF", raising=False)
    mp.setenv("GOALLOC_DEVICE", "cuda")
    try:
        res = run_check("ipc_check.py", f"ipc-{name}", name, timeout=timeout)
    finally:
        mp.undo()
    assert res["cxx"], res
    return res


def ok(res, name):
    r = res[name]
    assert "error" not in r, f"{name}: {r.get('error')}\n{r.get('trace', '')} (ptrace_scope {res['ptrace_scope']})"
    return r


def test_child_writes_parent_sees():
    r = ok(check("queue"), "queue")
    assert r["first"] == [0.0, 1.0, 2.0, 3.0] and r["all_42"] and r["exitcode"] == 0, r


def test_three_gib_tensor():
    r = ok(check("big", timeout=150), "big")
    assert r["first"] == [0.0, 1.0, 2.0, 3.0] and r["all_42"] and r["exitcode"] == 0, r


def test_many_small_tensors():
    r = ok(check("many"), "many")
    assert r["n"] == 300 and r["max_error"] == 0.0 and r["exitcode"] == 0, r


def test_both_directions():
    r = ok(check("back"), "back")
    assert r["seen"] == r["want_seen"] and r["child_sum"] == r["want"] and r["exitcode"] == 0, r


def test_sender_frees_while_receiver_holds():
    r = ok(check("held"), "held")
    assert r["cookie_intact"] and not r["reused_early"], r
    assert r["freed_at_collect"] >= r["block_bytes"], "the free waited for the child, then was made"


def test_receiver_without_goalloc():
    r = ok(check("native_rx"), "native_rx")
    assert r["backend"] == "native" and r["first"] == [0.0, 1.0, 2.0, 3.0] and r["all_42"], r


def test_native_sender_goalloc_receiver():
    r = ok(check("native_tx"), "native_tx")
    for kind in ("expandable", "cudamalloc"):
        assert r[kind]["read_ok"] and r[kind]["child_sum"] == r[kind]["want"], (kind, r)


def test_rl_weight_sync():
    r = ok(check("rl"), "rl")
    assert r["max_error"] == 0.0 and r["exitcode"] == 0, r


def test_exited_sender_is_a_clear_error():
    r = ok(check("exited"), "exited")
    assert r["error_text"] and "exited" in r["error_text"], "opening a handle of a process that exited must raise, not crash or succeed"


def test_timing_recorded():
    r = ok(check("timing"), "timing")
    assert r["share_s"] > 0 and r["open_s"] > 0, r


def test_small_tensor_and_view_any_receiver_any_order():
    r = ok(check("views", timeout=240), "views")
    for case, got in r.items():
        assert "error" not in got and got["filled"] and got["exitcode"] == 0, (case, got)
