"""goalloc's warnings as Python warnings.

The library warns once per kind of bad input it survives (a free of a
pointer it never made, a double free, a negative size, ...). A C program
reads those lines on stderr; in Python they are GoallocWarning warnings, so
that the usual tools apply: warnings.filterwarnings("error",
category=goalloc.GoallocWarning) makes them errors in a test suite,
logging.captureWarnings(True) sends them to the "py.warnings" logger,
pytest records them.

When the package loads the library it asks it to queue its warnings rather
than print them (export/warnings.go), and takes the queue:

- after every control call that can fail (so a warning raised by that call
  is issued before the call returns), and
- whenever the library says the queue gained a warning: a ctypes callback
  that the library calls from a thread of its own, outside its locks. This
  is how warnings raised inside torch's calls into the allocator (which
  never pass through Python) arrive, within moments.

At exit the callback is unregistered, what is left is issued, and the
library goes back to printing, for whatever happens during shutdown. None of
this is on the allocation path: the library only queues on the slow path
that already counts the bad input.

Out-of-memory lines are not warnings: they stay on stderr, and the
exception torch or goalloc raises carries the same message.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys
import threading
import warnings
from typing import Any, Optional


class GoallocWarning(UserWarning):
    """A warning from the goalloc library: bad input it counted and survived
    (the message names the goalloc.bad_input.* counter)."""


# One reader of the queue at a time, so that a warning taken by one thread
# is issued before another thread's drain() returns. Reentrant: a warnings
# handler may call into goalloc, which drains again.
_lock = threading.RLock()
_lib: Optional[ctypes.CDLL] = None

#: The C type of the library's notifier, goalloc_notify_fn.
NOTIFY = ctypes.CFUNCTYPE(None)
# The callback the library holds; it must stay alive while registered.
_callback: Optional[Any] = None

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def attach(lib: ctypes.CDLL) -> None:
    """Route lib's warnings here. Called once, by _lib.lib(), right after
    the library is loaded and its functions declared; it does not
    initialise the allocator. A library without the warning functions keeps
    printing them on stderr."""
    global _lib, _callback
    if not all(hasattr(lib, f"goalloc_warnings_{f}") for f in ("capture", "take", "notify")):
        return
    _lib = lib
    lib.goalloc_warnings_capture(1)
    _callback = NOTIFY(_on_notify)
    lib.goalloc_warnings_notify(_callback)
    atexit.register(_detach)


def _take() -> list[dict[str, str]]:
    assert _lib is not None
    ptr = _lib.goalloc_warnings_take()
    if not ptr:
        return []
    try:
        return json.loads(ctypes.string_at(ptr).decode("utf-8", "replace"))
    finally:
        _lib.goalloc_string_free(ptr)


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel for the first frame outside the package,
    so that the warning points at the user's call where there is one."""
    level, frame = 2, sys._getframe(2)  # drain's caller
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame, level = frame.f_back, level + 1
    return level


def drain() -> None:
    """Issue the library's queued warnings as GoallocWarning, in order."""
    if _lib is None:
        return
    with _lock:
        queued = _take()
        if queued:
            level = _caller_stacklevel()
            for w in queued:
                warnings.warn(w["message"], GoallocWarning, stacklevel=level)


def _on_notify() -> None:
    """The library's callback, on a thread of the library's own. There is no
    caller to hand an exception to (under an "error" filter warn raises),
    so such a warning is printed instead of lost."""
    try:
        drain()
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        print(f"{type(e).__name__}: {e}", file=sys.stderr)


def _detach() -> None:
    """At exit: no more callbacks (this waits for one in flight), issue
    what is left, and let the library print again."""
    global _callback
    if _lib is None:
        return
    _lib.goalloc_warnings_notify(NOTIFY())  # a NULL function pointer
    _callback = None
    drain()
    _lib.goalloc_warnings_capture(0)
