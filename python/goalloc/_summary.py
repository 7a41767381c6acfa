"""memory_summary(): the statistics as a table a person reads.

The layout follows torch.cuda.memory_summary() (same rows, same columns,
75 characters between the borders), so that anyone used to reading PyTorch's
table reads this one the same way; below it come the figures only goalloc
has (cache hits, driver pool calls, fragmentation, bad input).
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

from . import _abi

WIDTH = 75


@functools.lru_cache(maxsize=None)
def rows() -> tuple[tuple[str, str, str], ...]:
    """(stat key, row label, formatter kind), in torch's order: the
    statistics of goalloc.h's table (GOALLOC_STAT_ARRAYS), which gives each
    its row and label; a *_bytes statistic is a size, the others counts."""
    return tuple((name, label, "bytes" if name.endswith("_bytes") else "count")
                 for name, _, label in sorted(_abi.table("GOALLOC_STAT_ARRAYS"), key=lambda e: int(e[1])))


_POOLS = (("all", None), ("large_pool", "      from large pool"), ("small_pool", "      from small pool"))
# The figures of each row, under the titles of the table's header line.
_FIGURES = ("current", "peak", "allocated", "freed")

_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = (" ", "K", "M", "G")


def _size_cell(n: int, ref: int) -> str:
    """n in the unit that suits ref (the row's 'all' figure), 10 characters."""
    u = 0
    while u < len(_SIZE_UNITS) - 1 and abs(ref) >= 10000 * 1024**u:
        u += 1
    return f"{round(n / 1024**u):6d} {_SIZE_UNITS[u]:<3}"


def _count_cell(n: int, ref: int) -> str:
    u = 0
    while u < len(_COUNT_UNITS) - 1 and abs(ref) >= 1_000_000 * 1000**u:
        u += 1
    return f"{round(n / 1000**u):7d} {_COUNT_UNITS[u]} "


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB': the unit goalloc's own messages use."""
    for unit in _SIZE_UNITS[:-1]:
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} {_SIZE_UNITS[-1]}"


def _line(text: str) -> str:
    return "|" + text[:WIDTH].ljust(WIDTH) + "|"


def _rule(ch: str) -> str:
    return "|" + ch * WIDTH + "|"


def format_summary(
    stats: Mapping[str, int],
    frag: Mapping[str, float],
    device: int,
    abbreviated: bool = False,
) -> str:
    """Render memory_stats() and fragmentation() of one device."""
    out = [_rule("="), _line(f"goalloc CUDA memory summary, device ID {device}".center(WIDTH)), _rule("-")]
    ooms = f"CUDA OOMs: {stats.get('num_ooms', 0)}"
    retries = f"cudaMalloc retries: {stats.get('num_alloc_retries', 0)}"
    out.append(_line(f"{ooms:^37}|{retries:^37}"))
    out.append(_rule("="))
    out.append(_line("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "))
    for key, label, kind in rows():
        cell: Callable[[int, int], str] = _size_cell if kind == "bytes" else _count_cell
        out.append(_rule("-"))
        refs = [stats.get(f"{key}.all.{f}", 0) for f in _FIGURES]
        for pool, sublabel in _POOLS[:1] if abbreviated else _POOLS:
            values = [stats.get(f"{key}.{pool}.{f}", 0) for f in _FIGURES]
            cells = " | ".join(cell(v, r) for v, r in zip(values, refs))
            out.append(_line(f" {sublabel or label:<21} | {cells} "))
    out.append(_rule("="))

    hits, misses = stats.get("goalloc.cache_hits", 0), stats.get("goalloc.cache_misses", 0)
    rate = f" ({100 * hits / (hits + misses):.1f}% hits)" if hits + misses else ""
    out.append(_line(f" goalloc cache: {hits} hits, {misses} misses{rate}"))
    out.append(_line(
        f" Driver pool calls: {stats.get('num_device_alloc', 0)} allocs, "
        f"{stats.get('num_device_free', 0)} frees; "
        f"{stats.get('num_sync_all_streams', 0)} device synchronisations"))
    out.append(_line(
        f" Out of memory: {stats.get('num_ooms', 0)}; "
        f"deferred frees (record_stream): {stats.get('goalloc.deferred_frees', 0)}"))
    out.append(_line(
        f" Cached free: {human_bytes(frag.get('free_bytes', 0))}, largest free block "
        f"{human_bytes(frag.get('largest_free_block', 0))}, "
        f"fragmentation {frag.get('fragmentation', 0.0):.3f}"))
    bad = {k[len("goalloc.bad_input."):]: v for k, v in stats.items()
           if k.startswith("goalloc.bad_input.") and v}
    if bad:
        listed = ", ".join(f"{k} {v}" for k, v in sorted(bad.items()))
        out.append(_line(f" Bad input: {listed}"))
    out.append(_rule("="))
    return "\n".join(out) + "\n"
