"""Memory tags, sleep and wake through the Python package, on the simulated
device (backend:vmm, the default, with 4 MiB handles): memory_tag nests
per thread, sleep and wake_up say what they did and memory_reserved()
follows, and every refusal is its own exception with the library's
message. Contents restored byte for byte are the Go tests' (the simulated
device's memory is not reachable from Python): arena/vmm_sleep_test.go,
caching/sleep_test.go, export/sleep_test.go."""

from __future__ import annotations

import ctypes
import json
import textwrap
import threading
import types

import pytest

import goalloc
from goalloc import GoallocError, OutOfMemoryError, _lib
from goalloc_testing import device_holds, run_python

MiB = 1 << 20


def tagged(raw, name, size, device, stream=0x1000):
    with goalloc.memory_tag(name):
        return raw.must_malloc(size, device, stream)


def tag_bytes(device):
    return {k: v["reserved_bytes"] for k, v in goalloc.sleep_state(device)["tags"].items()}


def test_memory_tag_nests_and_restores():
    assert goalloc.current_memory_tag() == ""
    with goalloc.memory_tag("outer") as outer:
        assert goalloc.current_memory_tag() == "outer"
        with goalloc.memory_tag("inner"):
            assert goalloc.current_memory_tag() == "inner", "the innermost tag"
        assert goalloc.current_memory_tag() == "outer"
        with outer:  # a tag object is reusable
            assert goalloc.current_memory_tag() == "outer"
        assert goalloc.current_memory_tag() == "outer"
    assert goalloc.current_memory_tag() == ""
    with pytest.raises(RuntimeError):
        with goalloc.memory_tag("raised"):
            raise RuntimeError("inside")
    assert goalloc.current_memory_tag() == "", "restored when the block raises"


def test_memory_tag_is_per_thread(raw, device):
    seen = {}

    def work(name, size):
        with goalloc.memory_tag(name):
            seen[name] = goalloc.current_memory_tag()
            raw.must_malloc(size, device)

    threads = [threading.Thread(target=work, args=(f"thread{i}", (i + 1) * MiB)) for i in range(3)]
    with goalloc.memory_tag("main"):
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert goalloc.current_memory_tag() == "main", "other threads' tags are theirs"
    assert seen == {f"thread{i}": f"thread{i}" for i in range(3)}
    assert tag_bytes(device) == {f"thread{i}": (i + 1) * MiB for i in range(3)}


@pytest.mark.parametrize("name, error", [
    ("a,b", ValueError), ("two words", ValueError), ("x" * 65, ValueError), ("", ValueError),
    ("nul\0", ValueError), (b"bytes", TypeError), (None, TypeError),
])
def test_bad_tag_names_are_refused(name, error):
    with pytest.raises(error, match="tag"):
        with goalloc.memory_tag(name):
            pass
    assert goalloc.current_memory_tag() == ""


def test_sleep_and_wake_return_values_and_reserved_figures(raw, device):
    weights = tagged(raw, "weights", 64 * MiB, device)
    cache = tagged(raw, "kv_cache", 32 * MiB, device, 0x2000)
    live = raw.must_malloc(16 * MiB, device)
    free = raw.must_malloc(8 * MiB, device)
    raw.free(free, 8 * MiB, device)  # cached: the free cache goes too
    reserved = goalloc.memory_reserved(device)
    allocated = goalloc.memory_allocated(device)

    r = goalloc.sleep(offload_tags=("weights",), device=device)
    assert isinstance(r, goalloc.SleepResult)
    assert r.offloaded_bytes == 64 * MiB
    assert r.prepare_seconds > 0 and r.offload_seconds > 0, "the first offload pins the host area, then copies"
    assert reserved - goalloc.memory_reserved(device) == r.released_bytes
    assert goalloc.memory_reserved(device) == device_holds(16 * MiB), "the untagged live memory alone"
    assert goalloc.memory_allocated(device) == allocated, "the tensors live on"
    state = goalloc.sleep_state(device)
    assert sorted(state["asleep"]) == ["kv_cache", "weights"]
    assert state["offloaded_bytes"] == 64 * MiB
    assert state["host_area_bytes"] >= 64 * MiB
    s = goalloc.memory_stats(device)
    assert s["goalloc.sleep.asleep_bytes"] == 96 * MiB
    assert s["goalloc.sleep.offloaded_bytes"] == 64 * MiB

    w = goalloc.wake_up(tags="kv_cache", device=device)
    assert w == goalloc.WakeResult(mapped_bytes=32 * MiB, restored_bytes=0, woken=("kv_cache",))
    w = goalloc.wake_up(device=device)
    assert w.woken == ("weights",) and w.restored_bytes == 64 * MiB
    assert w.map_seconds > 0 and w.restore_seconds > 0
    assert goalloc.memory_reserved(device) == device_holds(16 * MiB) + 96 * MiB, "what was woken is back; the free cache is not"
    assert goalloc.sleep_state(device)["asleep"] == []
    assert goalloc.memory_stats(device)["goalloc.sleep.asleep_bytes"] == 0
    for p, n, stream in ((weights, 64 * MiB, 0x1000), (cache, 32 * MiB, 0x2000), (live, 16 * MiB, 0x1000)):
        raw.free(p, n, device, stream)
    assert goalloc.memory_allocated(device) == 0


def test_frees_while_asleep_take_effect_on_wake(raw, device):
    keep = tagged(raw, "weights", 32 * MiB, device)
    gone = tagged(raw, "weights", 32 * MiB, device)
    goalloc.sleep(offload_tags=("weights",), device=device)
    raw.free(gone, 32 * MiB, device)
    assert goalloc.memory_stats(device)["goalloc.sleep.asleep_bytes"] == 32 * MiB
    w = goalloc.wake_up(device=device)
    assert w.mapped_bytes == 32 * MiB and w.restored_bytes == 32 * MiB, "the freed block is not mapped again"
    raw.free(keep, 32 * MiB, device)


def test_refusals_say_what_to_do(raw, device):
    with pytest.raises(GoallocError, match="nothing is asleep"):
        goalloc.wake_up(device=device)
    with pytest.raises(ValueError, match='memory tag "never-tagged" is unknown'):
        goalloc.sleep(offload_tags=["never-tagged"], device=device)
    with pytest.raises(ValueError, match="names no tag"):
        goalloc.wake_up(tags=(), device=device)
    with pytest.raises(TypeError, match="offload_tags"):
        goalloc.sleep(offload_tags=[3], device=device)
    p = tagged(raw, "weights", 4 * MiB, device)

    # During a CUDA graph capture (a capture window open on the device).
    L = _lib.lib()
    L.goalloc_begin_allocate_to_pool.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p]
    L.goalloc_end_allocate_to_pool.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
    L.goalloc_begin_allocate_to_pool(device, 0, 77, None)
    with pytest.raises(GoallocError, match="during a CUDA graph capture"):
        goalloc.sleep(offload_tags=(), device=device)
    L.goalloc_end_allocate_to_pool(device, 0, 77)
    assert goalloc.sleep_state(device)["asleep"] == []

    goalloc.sleep(offload_tags=(), device=device)
    with pytest.raises(GoallocError, match="are asleep: wake_up them first"):
        goalloc.sleep(offload_tags=(), device=device)
    with goalloc.memory_tag("weights"):
        assert raw.malloc(MiB, device) == 0, "an allocation in a sleeping tag is refused"
    assert _lib.last_error_kind() == "bad_state"
    assert "wake_up it first" in _lib.last_error()
    with pytest.raises(GoallocError, match='"kv_cache" are not asleep'):
        goalloc.wake_up(tags=["kv_cache"], device=device)
    goalloc.wake_up(device=device)
    raw.free(p, 4 * MiB, device)


def test_out_of_memory_on_wake_leaves_the_tag_asleep(raw, device):
    weights = tagged(raw, "weights", 1 << 30, device)
    goalloc.sleep(offload_tags=("weights",), device=device)
    big = raw.must_malloc(7 * (1 << 30) + 512 * MiB, device)  # of the 8 GiB
    with pytest.raises(OutOfMemoryError, match='wake_up of memory tag "weights"') as e:
        goalloc.wake_up(device=device)
    assert isinstance(e.value, GoallocError)
    assert "CUDA out of memory" in str(e.value)
    assert goalloc.sleep_state(device)["asleep"] == ["weights"], "still asleep, for another try"
    raw.free(big, 7 * (1 << 30) + 512 * MiB, device)
    assert goalloc.wake_up(device=device).restored_bytes == 1 << 30
    raw.free(weights, 1 << 30, device)


def test_out_of_memory_is_torchs_where_torch_is_loaded(monkeypatch):
    """Where torch is loaded, the library's out_of_memory kind raises an
    exception that torch.OutOfMemoryError catches too (a stand-in torch
    here); torch is never imported for it."""
    fake = types.ModuleType("torch")

    class TorchOOM(RuntimeError):
        pass

    fake.OutOfMemoryError = TorchOOM  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    monkeypatch.setattr(_lib, "last_error", lambda: "CUDA out of memory. Tried to allocate 1.00 GiB.")
    monkeypatch.setattr(_lib, "last_error_kind", lambda: "out_of_memory")
    e = _lib._error("wake_up")
    assert isinstance(e, TorchOOM) and isinstance(e, OutOfMemoryError) and isinstance(e, GoallocError)
    assert str(e) == "CUDA out of memory. Tried to allocate 1.00 GiB."
    assert type(_lib._error("wake_up")) is type(e), "one class per torch"


def test_every_device_and_the_async_backend():
    """device=None sleeps and wakes every device goalloc has used; on
    backend:async both say they need backend:vmm. Fresh interpreters: the
    configuration is read once."""
    body = """
    import json, goalloc
    from goalloc import _lib
    L = _lib.lib()
    _lib.init(0)
    with goalloc.memory_tag("weights"):
        ps = [L.goalloc_malloc(32 << 20, d, 0x1000) for d in (0, 1)]
    out = {}
    try:
        r = goalloc.sleep()
        out["sleep"] = [r.offloaded_bytes, r.released_bytes]
        out["reserved"] = [goalloc.memory_reserved(d) for d in (0, 1)]
        w = goalloc.wake_up()
        out["wake"] = [w.restored_bytes, list(w.woken)]
    except ValueError as e:
        out["error"] = str(e)
    print(json.dumps(out))
    """
    vmm = json.loads(run_python(textwrap.dedent(body)).stdout)
    assert vmm == {"sleep": [64 << 20, 64 << 20], "reserved": [0, 0], "wake": [64 << 20, ["weights"]]}
    code = 'import goalloc\ngoalloc.configure("backend:async")\n' + textwrap.dedent(body)
    async_ = json.loads(run_python(code).stdout)
    assert "need backend:vmm" in async_["error"], async_


def test_prepare_sleep_pins_ahead_of_the_first_sleep(raw, device):
    p = tagged(raw, "weights", 48 * MiB, device)
    goalloc.prepare_sleep(tag_bytes(device)["weights"], device=device)
    assert goalloc.sleep_state(device)["host_area_bytes"] == 64 * MiB, "whole 64 MiB steps"
    r = goalloc.sleep(offload_tags=("weights",), device=device)
    assert r.offloaded_bytes == 48 * MiB
    assert r.prepare_seconds < 0.05, "the area was there: nothing pinned (the simulated pinning is instant too, so this bounds only the bookkeeping)"
    with pytest.raises(GoallocError, match="holds .* bytes of memory asleep"):
        goalloc.prepare_sleep(1 << 30, device=device)
    goalloc.wake_up(device=device)
    goalloc.prepare_sleep(1 << 30, device=device)  # grows it once nothing is asleep
    assert goalloc.sleep_state(device)["host_area_bytes"] == 1 << 30
    goalloc.prepare_sleep(MiB, device=device)  # never shrinks
    assert goalloc.sleep_state(device)["host_area_bytes"] == 1 << 30
    for bad, error in ((-1, ValueError), (1 << 64, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error):
            goalloc.prepare_sleep(bad, device=device)
    with pytest.raises(ValueError, match="more than any request"):
        goalloc.prepare_sleep((1 << 48) + 1, device=device)
    raw.free(p, 48 * MiB, device)
