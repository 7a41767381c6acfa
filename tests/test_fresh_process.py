"""What needs a library no call has touched: configuration, and the stderr
of an out-of-memory. Each test runs its scenario in a child interpreter."""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Optional

from goalloc_testing import device_holds, run_python

PRELUDE = """
import json, goalloc
from goalloc import _lib
L = _lib.lib()
STREAM = 0x1000
MiB = 1 << 20
"""


def child(body: str, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """Run body after PRELUDE in a fresh interpreter."""
    return run_python(PRELUDE + textwrap.dedent(body), env=env)


def test_fraction_cap_fails_an_allocation_with_goallocs_message_and_the_process_goes_on():
    proc = child("""
    goalloc.set_memory_fraction(0.01, 0)    # set before the device is first used
    cap = goalloc.config()["limits"]        # devices made so far: none yet
    ok = L.goalloc_malloc(4 * MiB, 0, STREAM)    # fits under 8G x 0.01 = 81.9 MiB (in the pool's 32 MiB chunk)
    big = L.goalloc_malloc(128 * MiB, 0, STREAM) # does not
    after = L.goalloc_malloc(2 * MiB, 0, STREAM) # the process keeps working
    s = goalloc.memory_stats(0)
    L.my_free(ok, 4 * MiB, 0, STREAM)
    L.my_free(after, 2 * MiB, 0, STREAM)
    print(json.dumps({"ok": bool(ok), "big": big, "after": bool(after), "cap": cap,
                      "limit": goalloc.config()["limits"]["0"],
                      "num_ooms": s["num_ooms"], "retries": s["num_alloc_retries"],
                      "allocated": goalloc.memory_allocated(0)}))
    """)
    out = json.loads(proc.stdout)
    assert out["ok"] and out["after"]
    assert out["big"] is None  # NULL
    assert out["cap"] == {}
    assert out["limit"] == int(0.01 * 8 * (1 << 30))
    assert out["num_ooms"] == 1
    assert out["allocated"] == 0
    oom_lines = [line for line in proc.stderr.splitlines() if "out of memory" in line]
    assert len(oom_lines) == 1, proc.stderr
    assert oom_lines[0].startswith("goalloc: CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which ")
    assert "(cap 81.92 MiB)" in oom_lines[0]


def test_lowering_the_fraction_releases_cached_memory():
    proc = child("""
    p = L.goalloc_malloc(16 * MiB, 0, STREAM)
    L.my_free(p, 16 * MiB, 0, STREAM)          # cached
    before = goalloc.memory_reserved(0)
    goalloc.set_memory_fraction(0.001, 0)      # below what is cached
    print(json.dumps([before, goalloc.memory_reserved(0)]))
    """)
    before, after = json.loads(proc.stdout)
    assert before == device_holds(16 * (1 << 20))  # what the device holds around the block
    assert after == 0


def test_configure_before_the_first_allocation_only():
    proc = child("""
    goalloc.configure("large_cache:0,quiet:true")
    conf = goalloc.config()["conf"]
    p = L.goalloc_malloc(16 * MiB, 1, STREAM)
    L.my_free(p, 16 * MiB, 1, STREAM)
    reserved = goalloc.memory_stats(1)["goalloc.own_reserved_bytes.current"]  # large_cache:0 caches nothing
    try:
        goalloc.configure("large_cache:1G")
        late = None
    except goalloc.GoallocError as e:
        late = str(e)
    print(json.dumps({"conf": conf, "reserved": reserved, "late": late}))
    """)
    out = json.loads(proc.stdout)
    assert "large_cache:0" in out["conf"] and "quiet:true" in out["conf"]
    assert out["reserved"] == 0
    assert out["late"].startswith("goalloc: configure after the first allocation")


def test_bad_goalloc_conf_in_the_environment_is_reported_by_the_first_call():
    proc = child("""
    try:
        goalloc.memory_stats(0)
        print("no error")
    except ValueError as e:
        print(e)
    """, env={"GOALLOC_CONF": "fraction:7"})
    assert "GOALLOC_CONF: fraction: 7 is outside [0, 1]" in proc.stdout


def test_bad_simulated_device_settings_are_value_errors():
    proc = child("""
    try:
        goalloc.device_count()
    except ValueError as e:
        print(e)
    """, env={"GOALLOC_SIM_DEVICES": "0"})
    assert 'GOALLOC_SIM_DEVICES="0" is not a device count' in proc.stdout


def test_history_records_across_a_fresh_start_and_caps_its_length():
    proc = child("""
    goalloc.record_history(True, max_entries=5)
    for _ in range(10):
        p = L.goalloc_malloc(1000, 2, STREAM)
        L.my_free(p, 1000, 2, STREAM)
    trace = goalloc.snapshot()["device_traces"][2]
    print(json.dumps([e["action"] for e in trace]))
    """)
    actions = json.loads(proc.stdout)
    assert len(actions) == 5  # the last five events only
    assert actions[-1] == "free_completed"


def test_record_stream_defers_the_free():
    """In a fresh process: record_stream takes no device, so the library looks
    the pointer up on every device, and the simulated devices share one
    address range (real ones do not), so other tests' blocks must not exist."""
    proc = child("""
    p = L.goalloc_malloc(3_000_000, 3, STREAM)
    L.goalloc_record_stream(p, 0x9000)
    L.my_free(p, 3_000_000, 3, STREAM)
    s = goalloc.memory_stats(3)
    print(json.dumps([s["goalloc.deferred_frees"], s["allocation.all.current"], s["active.all.current"]]))
    """)
    deferred, allocations, active = json.loads(proc.stdout)
    assert deferred == 1
    assert allocations == 0
    # The simulated streams finish their work at once, so the free has completed.
    assert active == 0


def test_each_thread_gets_its_own_error():
    """goalloc_last_error is per OS thread: 16 Python threads whose calls fail
    for different reasons each raise their own message, as the right type."""
    proc = child("""
    import threading
    L.my_free(L.goalloc_malloc(MiB, 0, STREAM), MiB, 0, STREAM)   # the device exists: configure is too late
    wrong = []

    def bad_key(i):
        for _ in range(1000):
            try:
                goalloc.configure(f"bogus{i}:1")
            except ValueError as e:
                if f'"bogus{i}"' not in str(e):
                    wrong.append(str(e))
            except Exception as e:
                wrong.append(f"{type(e).__name__}: {e}")

    def too_late(i):
        for _ in range(1000):
            try:
                goalloc.configure("quiet:true")
            except goalloc.GoallocError as e:
                if "configure after the first allocation" not in str(e):
                    wrong.append(str(e))
            except Exception as e:
                wrong.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=(bad_key if i % 2 else too_late), args=(i,)) for i in range(16)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps({"wrong": len(wrong), "examples": wrong[:3]}))
    """)
    out = json.loads(proc.stdout)
    assert out["wrong"] == 0, out["examples"]
