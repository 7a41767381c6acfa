"""What this process's host side spends, read before and after each training step.

A ResNet-50 step on the H200 is bound by the host: the GPU waits for the
host to launch its kernels, so whatever slows the host slows the step.
Wall time alone says that a configuration is slower, not why. These
counters split it:

  cpu_ms          CPU time of the whole process (every thread; getrusage)
  main_cpu_ms     CPU time of the thread that reads them (the training
                  loop's; time.thread_time); the autograd thread's backward
                  is in cpu_ms only
  vol_switches    voluntary context switches of the process: a thread went
                  to sleep (a lock, a wait for the device)
  invol_switches  involuntary ones: the kernel took the CPU away

and, where the kernel lets a process count its own events
(perf_event_open; containers often refuse it), per process, user mode
only:

  cycles, instructions    so also instructions per cycle: extra work shows
                          as more instructions, a host made slower by cache
                          misses (its own or another library's) as fewer
                          instructions per cycle
  llc_misses              last-level cache misses
  l1i_misses              first-level instruction cache misses: code that
                          evicts other code

thread_times() reads every thread's CPU time from /proc (its run time from
schedstat, in nanoseconds, where the kernel keeps it; else utime + stime, in
clock ticks), with its name: read before and after the timed steps, it says
which threads spent the CPU time, the training thread, torch's autograd
thread, or threads the allocator brought (a Go runtime's own threads carry
the process's name).

pin_threads() pins the threads by role (the training thread, torch's
autograd thread, the rest) to given CPUs: bench/lockstep.py pins the two
processes it compares alike.

The perf counters are opened with inherit, so they count the threads started
after they were opened: open them before importing torch. What could not be
opened is kept in `unavailable`, with the reason, and left out of the
readings; the getrusage figures are always there. Standard library only
(ctypes); Linux x86-64 for the perf counters.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct
import time
from typing import Optional

# perf_event_open(2): the system call's number on x86-64, and the event kinds.
SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
PERF_TYPE_HARDWARE, PERF_TYPE_HW_CACHE = 0, 3
PERF_FORMAT_TOTAL_TIME_ENABLED, PERF_FORMAT_TOTAL_TIME_RUNNING = 1, 2
# perf_event_attr's flags: bit 1 inherit, 5 exclude_kernel, 6 exclude_hv.
FLAG_INHERIT, FLAG_EXCLUDE_KERNEL, FLAG_EXCLUDE_HV = 1 << 1, 1 << 5, 1 << 6
# The first published layout of perf_event_attr (PERF_ATTR_SIZE_VER0):
# type, size, config, sample_period, sample_type, read_format, flags,
# wakeup_events, bp_type, config1. Every kernel accepts it.
ATTR_VER0 = struct.Struct("=IIQQQQQIIQ")

# (name, type, config): L1I read misses are cache 1, operation read (0),
# result miss (1): 1 | 0 << 8 | 1 << 16.
PERF_EVENTS = (
    ("cycles", PERF_TYPE_HARDWARE, 0),
    ("instructions", PERF_TYPE_HARDWARE, 1),
    ("llc_misses", PERF_TYPE_HARDWARE, 3),
    ("l1i_misses", PERF_TYPE_HW_CACHE, 1 | 0 << 8 | 1 << 16),
)


def attr_bytes(kind: int, config: int) -> bytes:
    """A perf_event_attr for counting kind/config in user mode, inherited by new threads."""
    flags = FLAG_INHERIT | FLAG_EXCLUDE_KERNEL | FLAG_EXCLUDE_HV
    return ATTR_VER0.pack(kind, ATTR_VER0.size, config, 0, 0,
                          PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING, flags, 0, 0, 0)


class HostCounters:
    """This process's counters; read() gives their totals so far, delta() a step's."""

    def __init__(self, perf: bool = True) -> None:
        self.fds: dict[str, int] = {}
        self.unavailable: dict[str, str] = {}
        if perf:
            self._open_perf()

    def _open_perf(self) -> None:
        nr = SYS_PERF_EVENT_OPEN.get(platform.machine())
        if nr is None or not hasattr(ctypes, "CDLL"):
            for name, _, _ in PERF_EVENTS:
                self.unavailable[name] = f"no perf_event_open on {platform.machine()}"
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        for name, kind, config in PERF_EVENTS:
            attr = ctypes.create_string_buffer(attr_bytes(kind, config))
            # pid 0 (this process), cpu -1 (any), no group, no flags.
            fd = libc.syscall(ctypes.c_long(nr), attr, ctypes.c_int(0), ctypes.c_int(-1),
                              ctypes.c_int(-1), ctypes.c_ulong(0))
            if fd < 0:
                err = ctypes.get_errno()
                self.unavailable[name] = f"perf_event_open: {os.strerror(err)} (errno {err})"
            else:
                self.fds[name] = int(fd)

    def read(self) -> dict[str, float]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out = {"cpu_ms": (ru.ru_utime + ru.ru_stime) * 1e3, "main_cpu_ms": time.thread_time() * 1e3,
               "vol_switches": float(ru.ru_nvcsw), "invol_switches": float(ru.ru_nivcsw)}
        for name, fd in self.fds.items():
            value, enabled, running = struct.unpack("=QQQ", os.read(fd, 24))
            # Scaled where the kernel shared the hardware counter with others.
            out[name] = float(value) * (enabled / running) if 0 < running < enabled else float(value)
        return out

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """after - before, for the counters both readings have."""
        return {k: after[k] - before[k] for k in after if k in before}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def thread_times(task_dir: str = "/proc/self/task") -> dict[int, tuple[str, float]]:
    """Every thread of this process: tid -> (name, CPU ms so far)."""
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        try:
            with open(f"{task_dir}/{tid}/schedstat") as f:
                run_ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            run_ns = 0  # a kernel without schedstat: the clock ticks below
        # "tid (name) state ...": the name may hold spaces and parentheses.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
        out[int(tid)] = (name, run_ns / 1e6 if run_ns > 0 else ticks * tick_ms)
    return out


def thread_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                 main: int) -> list[dict[str, object]]:
    """The CPU ms each thread spent between two thread_times() readings (a
    thread started between them counts from zero), the busiest first; main
    is the training thread's id."""
    rows = [{"tid": tid, "name": name, "main": tid == main, "cpu_ms": ms - before.get(tid, (name, 0.0))[1]}
            for tid, (name, ms) in after.items()]
    return sorted(rows, key=lambda r: -float(r["cpu_ms"]))  # type: ignore[arg-type]


def ipc(step: dict[str, float]) -> Optional[float]:
    """Instructions per cycle of a step's delta, where both were counted."""
    c, i = step.get("cycles"), step.get("instructions")
    return i / c if c and i is not None else None


def cpu_roles(s: str) -> list[int]:
    """MAIN,AUTOGRAD,OTHER[,OTHER...]: the CPUs pin_threads takes, checked
    against the CPUs this process may use (an argparse type)."""
    import argparse

    try:
        cpus = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: want MAIN,AUTOGRAD,OTHER[,OTHER...], CPU numbers") from None
    allowed = os.sched_getaffinity(0)
    if len(cpus) < 3 or not set(cpus) <= allowed:
        raise argparse.ArgumentTypeError(f"{s!r}: want at least three CPUs of this process's {sorted(allowed)}")
    return cpus


def pin_threads(main_cpu: int, autograd_cpu: int, other_cpus: set[int], main_tid: int,
                task_dir: str = "/proc/self/task") -> dict[str, list[int]]:
    """Pin this process's threads by role: the training thread (main_tid) to
    main_cpu, torch's autograd threads (named pt_autograd_*) to autograd_cpu,
    every other thread to other_cpus. Two processes pinned alike give each
    CPU the same role in both, so that a CPU the hypervisor slows for a
    while slows both alike, which leaving the placement to the scheduler
    does not (it keeps a thread where it last ran). Threads started later
    inherit their starter's CPUs. Returns the thread ids pinned, by role."""
    pinned: dict[str, list[int]] = {"main": [], "autograd": [], "others": []}
    for tid_s in os.listdir(task_dir):
        tid = int(tid_s)
        try:
            with open(f"{task_dir}/{tid}/comm") as f:
                name = f.read().rstrip("\n")
        except OSError:
            continue  # the thread ended meanwhile
        role = "main" if tid == main_tid else "autograd" if name.startswith("pt_autograd_") else "others"
        cpus = {main_cpu} if role == "main" else {autograd_cpu} if role == "autograd" else other_cpus
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue
        pinned[role].append(tid)
    return pinned
