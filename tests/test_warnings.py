"""The library's warnings reach Python as goalloc.GoallocWarning, not stderr.

Each case runs in a fresh interpreter: the library warns once per kind of
bad input per process, so only a fresh one is sure to warn.
"""

from __future__ import annotations

import json
import textwrap

import goalloc
from goalloc_testing import run_python

# A child that records every warning from the start.
RECORD = """
import json, sys, time, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: caught.append(
    [category.__name__, str(message), filename])
import goalloc
from goalloc import _lib, _warnings
L = _lib.lib()
"""


def recording(code: str) -> str:
    """code run in a child that records every warning from its start."""
    return RECORD + textwrap.dedent(code)


def test_bad_input_from_the_c_abi_is_a_goalloc_warning_not_a_stderr_line():
    proc = run_python(recording("""
    L.my_free(0x1234, 512, 0, 0x1000)   # as torch would: no Python call follows
    deadline = time.monotonic() + 10
    while not caught and time.monotonic() < deadline:
        time.sleep(0.01)                # the library's notifier delivers it
    print(json.dumps(caught))
    """))
    caught = json.loads(proc.stdout)
    assert len(caught) == 1, proc.stdout
    category, message, _ = caught[0]
    assert category == "GoallocWarning"
    assert "free of 0x1234 on device 0" in message
    assert message.endswith("(goalloc warns once per kind; counter goalloc.bad_input.unknown_pointer)")
    assert "0x1234" not in proc.stderr, "not printed as well"


def test_a_control_call_issues_its_warning_before_it_returns():
    """The library refuses a history of -5 entries as bad input: the
    ValueError (its kind is bad_argument) and the warning come from the same
    call, the warning pointing at the caller's line."""
    proc = run_python(recording("""
    L.goalloc_warnings_notify(_warnings.NOTIFY())  # the call's own drain only, not the notifier's thread
    try:
        _lib.record_history(-5)
    except ValueError as e:
        error = str(e)
    print(json.dumps([caught, error, __file__ if "__file__" in dir() else "<string>"]))
    """))
    caught, error, here = json.loads(proc.stdout)
    assert "history of -5 entries" in error
    assert [c[:2] for c in caught] == [["GoallocWarning", error +
                                        " (goalloc warns once per kind; counter goalloc.bad_input.invalid_argument)"]]
    assert caught[0][2] == here, "attributed to the caller, not to goalloc's own files"


def test_warnings_can_be_logged_or_made_errors():
    proc = run_python("""
    import logging, sys, warnings
    logging.basicConfig(stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
    logging.captureWarnings(True)
    import goalloc
    from goalloc import _lib, _warnings
    # Delivery by the explicit drains only: the notifier's thread has no
    # caller to raise into (it prints instead), and would race them.
    _lib.lib().goalloc_warnings_notify(_warnings.NOTIFY())
    _lib.lib().goalloc_malloc(-1, 0, 0x1000)
    _warnings.drain()
    warnings.filterwarnings("error", category=goalloc.GoallocWarning)
    _lib.lib().my_free(0x1234, 512, 0, 0x1000)
    try:
        _warnings.drain()
        print("no error")
    except goalloc.GoallocWarning as e:
        print("raised", e)
    """)
    assert "py.warnings WARNING" in proc.stdout and "GoallocWarning: goalloc: malloc of a negative size (-1)" in proc.stdout
    assert "raised goalloc: free of 0x1234" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == ""


def test_warnings_left_at_exit_are_issued_and_later_ones_print():
    proc = run_python("""
    import goalloc
    from goalloc import _lib, _warnings
    L = _lib.lib()
    L.goalloc_warnings_notify(_warnings.NOTIFY())  # no deliveries: the queue keeps it
    L.my_free(0x1234, 512, 0, 0x1000)
    """)
    assert "GoallocWarning: goalloc: free of 0x1234" in proc.stderr, proc.stderr


def test_without_the_package_the_library_prints_on_stderr():
    """A C program (or a ctypes user not going through goalloc._lib) gets the
    lines on stderr, as before."""
    proc = run_python(f"""
    import ctypes
    L = ctypes.CDLL({goalloc.library_path()!r})
    L.my_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    L.my_free(0x1234, 512, 0, 0x1000)
    """)
    assert "free of 0x1234 on device 0" in proc.stderr
    assert "counter goalloc.bad_input.unknown_pointer" in proc.stderr
