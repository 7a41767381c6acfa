"""Everything that needs PyTorch. Imported lazily: `import goalloc` must work
without torch, and a missing torch must be reported by the call that needs it.

Two jobs:

1. Make goalloc torch's allocator (install): goalloc's C++ allocator class
   (_cxx.py), which answers everything torch asks of its allocator; where
   that cannot be built, a CUDAPluggableAllocator over libgoalloc.so with
   all its hooks set. Or a torch.cuda.MemPool backed by goalloc (mempool).
2. With the pluggable fallback, keep torch's statistics calls working: torch
   2.11's torch.cuda.memory_stats() and everything built on it
   (memory_allocated, max_memory_reserved, memory_summary, ...) raise
   "CUDAPluggableAllocator does not yet support ...". All of them reach the
   allocator through a handful of torch._C functions, called at run time by
   attribute lookup, so replacing those attributes with functions that ask
   goalloc makes the whole family answer from goalloc, in torch's own format,
   for code that already calls them (training loops, Lightning, Accelerate).
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional

from . import _lib

_lock = threading.RLock()
_allocator: Any = None  # the CUDAPluggableAllocator, made once per process
_installed: Any = None  # set once install() has swapped torch's allocator
_applied_conf: Optional[str] = None  # the conf install()/mempool() configured
_originals: dict[str, Any] = {}  # torch._C attributes replaced by patch_torch()

AFTER_INIT = (
    "goalloc.install() must run before PyTorch initialises CUDA, and CUDA is "
    "already initialised in this process (a CUDA tensor was made, or a call such "
    "as torch.cuda.current_device() ran). Call goalloc.install() at the top of "
    "the script, right after `import torch` and before any CUDA tensor or "
    "torch.cuda call. To use goalloc for part of a program that has already "
    "started CUDA, use `with torch.cuda.use_mem_pool(goalloc.mempool()):` instead."
)


def require_torch(what: str) -> ModuleType:
    """Import torch, or say clearly that `what` needs it."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"{what} needs PyTorch, which could not be imported ({e}). Install a "
            f"CUDA build of torch. goalloc's statistics, snapshot and configuration "
            f"functions work without it."
        ) from e
    return torch


def require_cuda(torch: ModuleType, what: str) -> None:
    """Say clearly that `what` needs a CUDA build of torch and a GPU."""
    if not getattr(torch.version, "cuda", None):
        raise RuntimeError(
            f"{what} needs a CUDA build of PyTorch; torch {torch.__version__} was "
            f"built without CUDA."
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA device, and torch.cuda.is_available() is False "
            f"(no GPU visible, or no NVIDIA driver). goalloc's simulated device "
            f"(GOALLOC_DEVICE=sim) serves its C ABI and statistics only, not torch."
        )


def apply_conf(conf: Optional[str]) -> None:
    """Give the library install()'s or mempool()'s conf, before torch is touched.

    conf=None keeps GOALLOC_CONF from the environment, which the library reads
    itself (getenv) when it initialises (see init_library). A conf string
    replaces GOALLOC_CONF; the library accepts that only before its first
    allocation.
    A bad string raises ValueError with the library's message, naming the key.
    """
    global _applied_conf
    if conf is None:
        return
    if not isinstance(conf, str):
        raise TypeError(f"goalloc: conf must be a string like 'fraction:0.8', not {type(conf).__name__}")
    if conf != _applied_conf:
        _lib.configure(conf)
        _applied_conf = conf


def init_library(torch: ModuleType) -> None:
    """Initialise the library now, with torch's device count.

    Torch would call the init hook itself, later, where a failure can only
    show as NULL pointers; doing it here turns a bad GOALLOC_CONF into a
    ValueError and a missing driver into a GoallocError at the call that the
    user made. Neither reading the device count nor goalloc's own driver
    initialisation starts torch's CUDA state.
    """
    _lib.init(torch.cuda.device_count())
    kind = _lib.config().get("device")
    if kind != "cuda":
        raise RuntimeError(
            f"goalloc: the library runs on the {kind!r} device (GOALLOC_DEVICE), whose "
            f"addresses are not real GPU memory; unset GOALLOC_DEVICE (or set it to "
            f"cuda) to give goalloc to torch."
        )


# (setter on torch's pluggable allocator, function of libgoalloc.so)
GRAPH_HOOKS = (
    ("set_begin_allocate_to_pool", "goalloc_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "goalloc_end_allocate_to_pool"),
    ("set_release_pool", "goalloc_release_pool"),
)


def _pluggable(torch: ModuleType) -> Any:
    """The process's one CUDAPluggableAllocator over libgoalloc.so, all hooks set.

    Without a hook the matching torch call is a silent no-op (torch 2.11's
    CUDAPluggableAllocator does nothing for a hook never set), so all are set: empty_cache, set_per_process_memory_fraction and
    Tensor.record_stream then reach goalloc, and torch's init call tells
    goalloc how many devices torch sees.
    """
    global _allocator
    if _allocator is None:
        # my_malloc raises where goalloc_malloc returns NULL: torch does
        # not check the pointer, so a NULL would become a tensor whose first
        # kernel faults and breaks the CUDA context (export/torch_malloc.cpp).
        alloc = torch.cuda.memory.CUDAPluggableAllocator(_lib.library_path(), "my_malloc", "my_free")
        raw = alloc.allocator()
        raw.set_init_fn(_lib.address("goalloc_init"))
        raw.set_reset_fn(_lib.address("goalloc_empty_cache"))
        raw.set_memory_fraction_fn(_lib.address("goalloc_set_memory_fraction"))
        raw.set_record_stream_fn(_lib.address("goalloc_record_stream"))
        # CUDA graph hooks, in libraries that export them: capture then
        # allocates from a private pool per graph instead of silently not.
        for setter, name in GRAPH_HOOKS:
            if _lib.has_function(name):
                getattr(raw, setter)(_lib.address(name))
        _allocator = alloc
    return _allocator


def install(conf: Optional[str]) -> Any:
    global _installed
    with _lock:
        if _installed is not None:
            in_force = _applied_conf if _applied_conf is not None else os.environ.get("GOALLOC_CONF", "")
            if conf is not None and conf != in_force:
                raise RuntimeError(
                    f"goalloc.install(): already installed with conf {in_force!r}; the "
                    f"configuration cannot change once goalloc is torch's allocator "
                    f"(asked for {conf!r})."
                )
            return _installed
        apply_conf(conf)
        torch = require_torch("goalloc.install()")
        require_cuda(torch, "goalloc.install()")
        if torch.cuda.is_initialized():
            raise RuntimeError(AFTER_INIT)
        init_library(torch)
        _installed = swap_in(torch)
        return _installed


def swap_in(torch: ModuleType) -> Any:
    """Make goalloc torch's allocator: goalloc's C++ allocator class where it
    can be built and loaded (_cxx.py), else torch's CUDAPluggableAllocator
    with goalloc's statistics functions patched in. Returns torch's object
    for the allocator now in force."""
    from . import _cxx

    ext = _cxx.load(torch)
    try:
        if ext is not None and _cxx.install(ext):
            return torch.cuda.memory._get_current_allocator()
        alloc = _pluggable(torch)
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        if "already initialized" in str(e):
            raise RuntimeError(AFTER_INIT) from e
        raise
    patch_torch(torch)
    return alloc


def mempool(conf: Optional[str]) -> Any:
    with _lock:
        apply_conf(conf)
        torch = require_torch("goalloc.mempool()")
        require_cuda(torch, "goalloc.mempool()")
        if not hasattr(torch.cuda, "MemPool"):
            raise RuntimeError(
                f"goalloc.mempool() needs torch.cuda.MemPool, which torch "
                f"{torch.__version__} does not have (PyTorch 2.11 does)."
            )
        # torch calls the init hook only when goalloc is the global allocator.
        init_library(torch)
        from . import _cxx

        if _cxx.installed():
            # goalloc's C++ class is torch's allocator: it serves MemPools itself.
            return torch.cuda.MemPool()
        alloc = _pluggable(torch)
        return torch.cuda.MemPool(allocator=alloc.allocator())


def current_device() -> int:
    """torch's current CUDA device if torch has CUDA running, else 0.

    Never initialises CUDA: asking torch for its current device would, and
    install() must still be possible after a goalloc statistics call.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    try:
        if torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # a torch without CUDA support
        pass
    return 0


# --- torch's statistics functions, answered by goalloc -----------------------

def nested_stats(device: int) -> dict[str, Any]:
    """goalloc's memory_stats in torch._C._cuda_memoryStats's nested form.

    torch.cuda.memory_stats() flattens the nested dict by joining keys with
    '.', so torch's own keys are nested by splitting them on '.'. goalloc's
    extras ("goalloc.*") stay single top-level keys, which flatten to
    themselves: among them one name can be both a figure and the prefix of
    others ("goalloc.graph_pools", "goalloc.graph_pools.reserved_bytes"),
    which a nested dict cannot hold. Any other such clash is kept flat too.
    """
    from . import memory_stats

    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        if key.startswith("goalloc.") or not _nest(nested, key.split("."), value):
            nested[key] = value
    return nested


def _nest(tree: dict[str, Any], path: list[str], value: Any) -> bool:
    """Put value at path in tree; False, changing nothing, if a figure is in the way."""
    node = tree
    for p in path[:-1]:
        child = node.get(p, {})
        if not isinstance(child, dict):
            return False
        node = node.setdefault(p, child)
    if isinstance(node.get(path[-1]), dict):
        return False
    node[path[-1]] = value
    return True


def _reset_peak(device: int) -> None:
    from . import reset_peak_memory_stats

    reset_peak_memory_stats(device)


def _reset_accumulated(device: int) -> None:
    from . import reset_accumulated_memory_stats

    reset_accumulated_memory_stats(device)


def _memory_snapshot(arg: Any = None) -> dict[str, Any]:
    """torch._C._cuda_memorySnapshot: None, or (pool id, pool id, include_traces)."""
    from . import snapshot

    snap = snapshot()
    if isinstance(arg, tuple) and len(arg) == 3 and not arg[2]:
        snap["device_traces"] = [[] for _ in snap["device_traces"]]
    return snap


def _record_history(enabled: Any = "all", context: Any = None, stacks: Any = None,
                    max_entries: int = _lib.MAX_HISTORY_ENTRIES, *_: Any) -> None:
    """torch._C._cuda_record_memory_history (torch.cuda.memory._record_memory_history).

    enabled=None turns recording off; "state" keeps no history in torch, and
    goalloc has no state-only mode, so it records like "all". Stack traces
    are not recorded.
    """
    from . import record_history

    if enabled is None:
        record_history(False)
    else:
        record_history(True, max_entries=min(int(max_entries), _lib.MAX_HISTORY_ENTRIES))


def _record_history_legacy(enabled: bool, record_context: Any = True,
                           trace_alloc_max_entries: int = 1, *_: Any) -> None:
    from . import record_history

    if enabled:
        record_history(True, max_entries=min(max(int(trace_alloc_max_entries), 1), _lib.MAX_HISTORY_ENTRIES))
    else:
        record_history(False)


_PATCHES: dict[str, Callable[..., Any]] = {
    "_cuda_memoryStats": nested_stats,
    "_cuda_resetPeakMemoryStats": _reset_peak,
    "_cuda_resetAccumulatedMemoryStats": _reset_accumulated,
    "_cuda_memorySnapshot": _memory_snapshot,
    "_cuda_record_memory_history": _record_history,
    "_cuda_record_memory_history_legacy": _record_history_legacy,
}


def patch_torch(torch: ModuleType) -> None:
    """Point torch's allocator-statistics entry points at goalloc.

    The originals are kept, so that unpatch_torch() can restore them (tests).
    """
    with _lock:
        for name, fn in _PATCHES.items():
            if name not in _originals:
                _originals[name] = getattr(torch._C, name, None)
            setattr(torch._C, name, fn)
        patch_scalars(torch)


def unpatch_torch(torch: ModuleType) -> None:
    """Undo patch_torch(). The allocator swap itself cannot be undone."""
    with _lock:
        for name, fn in _originals.items():
            if fn is None:
                if hasattr(torch._C, name):
                    delattr(torch._C, name)
            else:
                setattr(torch._C, name, fn)
        _originals.clear()
        unpatch_scalars()


# --- torch's per-step statistics, answered without memory_stats() --------------
#
# torch.cuda.memory_allocated() and its three siblings build the whole
# memory_stats() dict (a nested dict, flattened and sorted) to return one
# number. A training loop may ask every step, so install() replaces the four
# functions themselves, in torch.cuda.memory and in torch.cuda, with ones
# that read goalloc's published figure (BENCHMARKS.md, "The per-step
# statistics"). torch's deprecated memory_cached()
# and max_memory_cached() call memory_reserved() and max_memory_reserved()
# of torch.cuda.memory, so they follow.

_SCALARS = {
    "memory_allocated": _lib.ALLOCATED,
    "max_memory_allocated": _lib.ALLOCATED_PEAK,
    "memory_reserved": _lib.RESERVED,
    "max_memory_reserved": _lib.RESERVED_PEAK,
}
# (id(module), name) -> (module, the function patch_scalars() replaced there).
# Keyed by id: a module need not be hashable (stand-ins in tests are not).
_scalar_originals: dict[tuple[int, str], tuple[Any, Any]] = {}


def torch_scalar(torch: ModuleType, name: str, key: int) -> Callable[..., int]:
    """torch.cuda.<name>, answered from goalloc's figure number key."""
    from . import _stat_device

    cuda = torch.cuda

    def scalar(device: Any = None) -> int:
        # As torch: nothing is allocated before CUDA starts.
        if not cuda.memory.is_initialized():
            return 0
        if device is None:
            index = cuda.current_device()
        elif type(device) is int:
            index = device
        else:  # torch.device, "cuda:1", torch.cuda.device: torch's own parsing
            index = int(cuda._get_device_index(device, optional=True))
        return _lib.stat(_stat_device(index), key)

    scalar.__name__ = scalar.__qualname__ = name
    scalar.__doc__ = f"torch.cuda.{name}, answered by goalloc (goalloc.{name})."
    return scalar


def patch_scalars(torch: ModuleType) -> None:
    """Replace torch.cuda's four per-step functions (patch_torch calls it);
    the originals are kept for unpatch_scalars()."""
    with _lock:
        for name, key in _SCALARS.items():
            fn = torch_scalar(torch, name, key)
            original = getattr(torch.cuda.memory, name, None)
            for module in (torch.cuda.memory, torch.cuda):
                current = getattr(module, name, None)
                # torch.cuda's name is the same function as torch.cuda.memory's
                # (from .memory import *); leave it if someone rebound it.
                if module is torch.cuda and current is not original and (id(module), name) not in _scalar_originals:
                    continue
                _scalar_originals.setdefault((id(module), name), (module, current))
                setattr(module, name, fn)


def unpatch_scalars() -> None:
    """Put back what patch_scalars() replaced."""
    with _lock:
        for (_, name), (module, fn) in _scalar_originals.items():
            setattr(module, name, fn)
        _scalar_originals.clear()
