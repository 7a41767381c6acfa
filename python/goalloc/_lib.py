"""ctypes binding of libgoalloc.so: finding it, loading it once, typed calls.

Every control function of the C ABI returns -1 (or NULL) on failure and
leaves the reason in goalloc_last_error() and its kind in
goalloc_last_error_kind(); the wrappers here turn that into a Python
exception carrying the library's own message, so that what a user reads is
what the allocator knows. The kind alone chooses the exception (ERROR_KINDS):
the message is for people and is never parsed. Every argument rule (ranges,
which devices exist) lives in the library alone; Python checks only what it
must before a value can be passed to C at all (its type, and that an int
fits a C int), and asks the library whether a device exists before it uses
one (check_device), so that a user's mistake is an exception and not also
one of the library's once-per-kind warnings.

The library holds process-global state (one allocator per device). A process
can load it only once: a second copy of a Go runtime in one process would
not work. So the path is fixed at the first load, and library_path() returns
that same path from then on, which is also the path PyTorch must dlopen.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from . import _abi, _warnings

LIBRARY_ENV = "GOALLOC_LIBRARY"
LIBRARY_NAME = "libgoalloc.so"

# The largest history ring the library accepts: caching.MaxHistoryEntries,
# which config()["max_history"] reports (a test keeps the two equal).
MAX_HISTORY_ENTRIES = 1 << 20


class GoallocError(RuntimeError):
    """The library refused a call; the message is goalloc_last_error()."""


class OutOfMemoryError(GoallocError):
    """The device, or the cap on it, had no room (the library's out_of_memory
    kind). Where torch is loaded the exception raised is also a
    torch.OutOfMemoryError (see _out_of_memory), as torch's own allocator
    raises."""


# The library's error kinds, by number (goalloc.h's GOALLOC_ERROR_KINDS, which
# says what each means; config()["error_kinds"] is the library's own list),
# and the exception each becomes: the caller's mistakes, a bad argument or a
# bad setting, are ValueError; out of memory is OutOfMemoryError (a
# GoallocError, and a torch.OutOfMemoryError where torch is loaded); a failed
# driver or device, a call made too late or one the allocator's state
# refuses (bad_state) are GoallocError, as is a failure of no kind (none).
ERROR_KINDS = _abi.names("GOALLOC_ERROR_KINDS")
def _out_of_memory(msg: str) -> Exception:
    """OutOfMemoryError, and torch.OutOfMemoryError too where torch is loaded
    (it is never imported here: a program without it gets the first alone)."""
    torch = sys.modules.get("torch")
    base = getattr(torch, "OutOfMemoryError", None)
    if not (isinstance(base, type) and issubclass(base, BaseException)):
        return OutOfMemoryError(msg)
    cls = _torch_oom_classes.get(base)
    if cls is None:
        cls = type("OutOfMemoryError", (OutOfMemoryError, base), {"__module__": __name__})
        _torch_oom_classes[base] = cls
    return cls(msg)


_torch_oom_classes: dict[type, type] = {}

_EXCEPTION_OF_KIND: dict[str, Callable[[str], Exception]] = {
    "bad_argument": ValueError,
    "bad_config": ValueError,
    "out_of_memory": _out_of_memory,
}

# The range of a C int, which ctypes refuses to go beyond with its own error.
C_INT_MIN, C_INT_MAX = -(1 << 31), (1 << 31) - 1


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_loaded_path: Optional[str] = None


def library_path() -> str:
    """Path of the libgoalloc.so this process uses.

    $GOALLOC_LIBRARY wins over the copy inside the package, so that a machine
    without Go can use a library built elsewhere. Once the library is loaded,
    the loaded path is returned whatever the environment says later.
    """
    if _loaded_path is not None:
        return _loaded_path
    env = os.environ.get(LIBRARY_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(
                f"goalloc: {LIBRARY_ENV}={env!r} is not a file; point it at a "
                f"libgoalloc.so built with `make lib`, or unset it to use the "
                f"library shipped in the package."
            )
        return str(p.resolve())
    p = Path(__file__).resolve().parent / LIBRARY_NAME
    if not p.is_file():
        raise FileNotFoundError(
            f"goalloc: {LIBRARY_NAME} is not in the package folder {p.parent}. "
            f"Install the package with `pip install .` from a goalloc checkout "
            f"(this builds it with Go), or set {LIBRARY_ENV}=/path/to/{LIBRARY_NAME}."
        )
    return str(p)


# The variables the library reads, with getenv(3), when it initialises
# (export/registry.go): os.environ changes made before goalloc's first call
# in the process count; later ones do not.
LIBRARY_SETTINGS = ("GOALLOC_DEVICE", "GOALLOC_SIM_DEVICES", "GOALLOC_SIM_MEMORY", "GOALLOC_CONF")


_c_int, _c_double, _c_ssize_t, _c_void_p, _c_char_p = (
    ctypes.c_int, ctypes.c_double, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_char_p)

#: Every function of libgoalloc.so the package calls through ctypes, as
#: (restype, argtypes). goalloc.h (csrc/) declares them;
#: tests/test_abi_header.py checks each entry against it, and that the
#: package calls no function this does not declare.
SIGNATURES: dict[str, tuple[Any, Optional[list[Any]]]] = {
    # The calls PyTorch makes.
    "goalloc_malloc": (_c_void_p, [_c_ssize_t, _c_int, _c_void_p]),
    "my_free": (None, [_c_void_p, _c_ssize_t, _c_int, _c_void_p]),
    "goalloc_init": (None, [_c_int]),
    "goalloc_empty_cache": (None, []),
    "goalloc_set_memory_fraction": (None, [_c_double, _c_int]),
    "goalloc_record_stream": (None, [_c_void_p, _c_void_p]),
    # Control functions: 0 / -1, or a malloc'd string / NULL, kept as a
    # void* so that it can be freed.
    "goalloc_configure": (_c_int, [_c_char_p]),
    "goalloc_init_checked": (_c_int, [_c_int]),
    "goalloc_device_count": (_c_int, []),
    "goalloc_check_device": (_c_int, [_c_int]),
    "goalloc_stats_json": (_c_void_p, [_c_int]),
    "goalloc_fragmentation_json": (_c_void_p, [_c_int]),
    "goalloc_snapshot_json": (_c_void_p, [_c_int]),
    "goalloc_config_json": (_c_void_p, []),
    "goalloc_reset_peak_stats": (_c_int, [_c_int]),
    "goalloc_reset_accumulated_stats": (_c_int, [_c_int]),
    "goalloc_set_fraction": (_c_int, [_c_int, _c_double]),
    "goalloc_empty_cache_device": (_c_int, [_c_int]),
    "goalloc_record_history": (_c_int, [_c_int]),
    # Memory tags, sleep and wake (NULL for a list: none for sleep, every
    # tag asleep for wake_up).
    "goalloc_set_memory_tag": (_c_int, [_c_char_p]),
    "goalloc_memory_tag": (_c_void_p, []),
    "goalloc_sleep": (_c_void_p, [_c_int, _c_char_p]),
    "goalloc_wake_up": (_c_void_p, [_c_int, _c_char_p]),
    "goalloc_sleep_state_json": (_c_void_p, [_c_int]),
    "goalloc_prepare_sleep": (_c_int, [_c_int, ctypes.c_ulonglong]),
    # CUDA IPC (the C++ class makes these calls itself; declared for
    # tests and tools that drive them through ctypes).
    "goalloc_ipc_export": (_c_int, [_c_void_p, ctypes.POINTER(_c_int), ctypes.POINTER(_c_int),
                                    ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong),
                                    ctypes.POINTER(_c_int), _c_int]),
    "goalloc_ipc_release": (_c_int, [_c_void_p]),
    "goalloc_ipc_import": (_c_void_p, [_c_int, _c_int, ctypes.c_ulonglong, ctypes.POINTER(_c_int), _c_int]),
    "goalloc_ipc_close": (_c_int, [_c_int, _c_void_p]),
    # The per-step figures (STAT_KEYS): a number, -1 on error. No
    # argtypes: converting each argument through c_int.from_param
    # would cost more than the call itself; stat()'s callers pass ints
    # that fit a C int.
    "goalloc_stat": (ctypes.c_longlong, None),
    "goalloc_stat_scalars": (_c_int, [_c_int, ctypes.POINTER(ctypes.c_int64), _c_int]),
    "goalloc_stat_keys_json": (_c_void_p, []),
    "goalloc_last_error": (_c_void_p, []),
    "goalloc_last_error_kind": (_c_int, []),
    "goalloc_string_free": (None, [_c_void_p]),
    # The library's warnings as Python warnings (_warnings.py).
    "goalloc_warnings_capture": (_c_int, [_c_int]),
    "goalloc_warnings_take": (_c_void_p, []),
    "goalloc_warnings_notify": (_c_int, [_warnings.NOTIFY]),
}

#: The functions of SIGNATURES a library built before them lacks: the
#: package goes on without them (such a library prints its warnings).
OPTIONAL = frozenset({"goalloc_warnings_capture", "goalloc_warnings_take", "goalloc_warnings_notify"})


def _declare(lib: ctypes.CDLL) -> None:
    """Give every function of SIGNATURES its C signature."""
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in OPTIONAL:
                continue
            raise
        fn.restype = restype
        fn.argtypes = argtypes


def lib() -> ctypes.CDLL:
    """The loaded library, loading it on first use.

    Loading is lazy so that `import goalloc` is cheap and the environment
    (GOALLOC_LIBRARY, GOALLOC_DEVICE, ...) can still be set after the import.
    """
    global _lib, _loaded_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                loaded = ctypes.CDLL(path)
            except OSError as e:
                raise OSError(f"goalloc: cannot load {path}: {e}") from e
            _declare(loaded)
            _warnings.attach(loaded)  # the library's warnings become GoallocWarning
            _loaded_path = path
            _lib = loaded
    return _lib


def address(name: str) -> int:
    """The C address of an exported function, as torch's hook setters take it."""
    addr = ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
    if not addr:
        raise GoallocError(f"goalloc: {library_path()} has no function {name}")
    return addr


def has_function(name: str) -> bool:
    """Whether the loaded library exports name (newer libraries add hooks)."""
    try:
        getattr(lib(), name)
    except AttributeError:
        return False
    return True


def _take_string(ptr: Optional[int]) -> Optional[str]:
    """Copy a string the library malloc'd, and free it."""
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        lib().goalloc_string_free(ptr)


def last_error() -> str:
    """The library's message for the last failed call (empty if none)."""
    return _take_string(lib().goalloc_last_error()) or ""


def last_error_kind() -> str:
    """The kind of the last failed call (ERROR_KINDS), read with last_error()."""
    k = lib().goalloc_last_error_kind()
    return ERROR_KINDS[k] if 0 <= k < len(ERROR_KINDS) else f"kind {k}"


def _error(what: str) -> Exception:
    """The exception for the call that just failed: its kind chooses the type,
    its message is the library's."""
    kind = last_error_kind()
    msg = last_error() or f"goalloc: {what} failed, and the library gave no reason"
    _warnings.drain()  # a refused call's warnings, too, come before it raises
    return _EXCEPTION_OF_KIND.get(kind, GoallocError)(msg)


def fits_c_int(value: int) -> bool:
    """Whether an int can be passed as a C int (ctypes raises otherwise)."""
    return C_INT_MIN <= value <= C_INT_MAX


def _check(rc: int, what: str) -> None:
    _warnings.drain()  # what this call warned of comes before its return
    if rc != 0:
        raise _error(what)


def _json(ptr: Optional[int], what: str) -> Any:
    _warnings.drain()  # what this call warned of comes before its return
    text = _take_string(ptr)
    if text is None:
        raise _error(what)
    return json.loads(text)


# Thin wrappers, one per control function. Devices are ints the caller has
# passed through check_device.

def configure(conf: str) -> None:
    """goalloc_configure: replace GOALLOC_CONF; only before the first allocation."""
    if lib().goalloc_configure(conf.encode("utf-8")) != 0:
        raise _error("configure")


_device_count: Optional[int] = None


def device_count() -> int:
    """goalloc_device_count, which initialises the library from the environment.

    Kept once known: the library fixes the count when it initialises.
    """
    global _device_count
    if _device_count is None:
        n = lib().goalloc_device_count()
        if n < 0:
            raise _error("device_count")
        _device_count = n
    return _device_count


# The devices the library has said exist: its count is fixed once it has
# initialised, so an answer holds for the life of the process.
_existing_devices: set[int] = set()


def check_device(device: int) -> int:
    """device, if the library says it exists (goalloc_check_device: its rule,
    asked as a question, so neither warned of nor counted as bad input);
    else ValueError with the library's message. device must fit a C int."""
    if device not in _existing_devices:
        if lib().goalloc_check_device(device) != 0:
            raise _error("device check")
        _existing_devices.add(device)
    return device


def init(torch_device_count: int) -> None:
    """goalloc_init_checked: what torch's init hook does, with errors reported."""
    if lib().goalloc_init_checked(torch_device_count) != 0:
        raise _error("init")


def config() -> dict[str, Any]:
    return _json(lib().goalloc_config_json(), "config")


def stats(device: int) -> dict[str, int]:
    return _json(lib().goalloc_stats_json(device), "memory_stats")


# The figures goalloc_stat answers without the allocator's lock or JSON, by
# index, in the library's order (export/stats_fast.go); stat_keys() is the
# library's own list.
STAT_KEYS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
)
ALLOCATED, ALLOCATED_PEAK, RESERVED, RESERVED_PEAK = range(len(STAT_KEYS))


def stat(device: int, key: int) -> int:
    """goalloc_stat: one figure of STAT_KEYS, about a microsecond."""
    v: int = (_lib or lib()).goalloc_stat(device, key)
    if v < 0:
        raise _error("memory statistics")
    return v


def stat_scalars(device: int) -> list[int]:
    """goalloc_stat_scalars: every figure of STAT_KEYS, in order."""
    out = (ctypes.c_int64 * len(STAT_KEYS))()
    if lib().goalloc_stat_scalars(device, out, len(out)) < 0:
        raise _error("memory statistics")
    return list(out)


def stat_keys() -> list[str]:
    return _json(lib().goalloc_stat_keys_json(), "stat_keys")


def fragmentation(device: int) -> dict[str, Any]:
    return _json(lib().goalloc_fragmentation_json(device), "fragmentation")


def snapshot(device: int = -1) -> list[dict[str, Any]]:
    """goalloc_snapshot_json: one {device, segments, device_traces} per device."""
    return _json(lib().goalloc_snapshot_json(device), "snapshot")


def reset_peak(device: int) -> None:
    _check(lib().goalloc_reset_peak_stats(device), "reset_peak_memory_stats")


def reset_accumulated(device: int) -> None:
    _check(lib().goalloc_reset_accumulated_stats(device), "reset_accumulated_memory_stats")


def set_fraction(device: int, fraction: float) -> None:
    if lib().goalloc_set_fraction(device, fraction) != 0:
        raise _error("set_memory_fraction")


def empty_cache_device(device: int) -> None:
    _check(lib().goalloc_empty_cache_device(device), "empty_cache")


def record_history(max_entries: int) -> None:
    _check(lib().goalloc_record_history(max_entries), "record_history")


# Memory tags, sleep and wake (goalloc.h, "memory tags, sleep and wake").

def set_memory_tag(name: str) -> None:
    """goalloc_set_memory_tag: the calling thread's allocations carry name
    ("": none)."""
    _check(lib().goalloc_set_memory_tag(name.encode("utf-8")), "memory_tag")


def memory_tag() -> str:
    """goalloc_memory_tag: the calling thread's tag, "" if none."""
    return _take_string(lib().goalloc_memory_tag()) or ""


def sleep(device: int, offload: str) -> dict[str, Any]:
    """goalloc_sleep: device -1 is every device; offload a comma-separated list."""
    return _json(lib().goalloc_sleep(device, offload.encode("utf-8")), "sleep")


def wake_up(device: int, tags: Optional[str]) -> dict[str, Any]:
    """goalloc_wake_up: tags None wakes every tag asleep."""
    arg = None if tags is None else tags.encode("utf-8")
    return _json(lib().goalloc_wake_up(device, arg), "wake_up")


def prepare_sleep(device: int, size: int) -> None:
    """goalloc_prepare_sleep: device -1 is every device."""
    _check(lib().goalloc_prepare_sleep(device, size), "prepare_sleep")


def sleep_state(device: int) -> dict[str, Any]:
    return _json(lib().goalloc_sleep_state_json(device), "sleep_state")
