"""Short scheduler slices for a CPU rank's threads: hand-offs wait 0.1 ms, not a whole slice.

A CPU rank spends its step handing work between threads: each tensor-parallel all-reduce wakes
a gloo worker thread of the rank, whose message wakes the peer's gloo loop and worker threads,
whose completion wakes the rank's main thread again — five or so wake-ups per all-reduce, 64
all-reduces per step for gpt-tiny at pp 1 × tp 2 with 4 microbatches. Linux's EEVDF scheduler
(6.6 and later) lets the task a wake-up finds on the core run on until its slice is used (1.4 ms
by default on a 2-core host: ``se.slice`` in ``/proc/<pid>/sched``), and that task is often
another rank's busy main thread or another job's, so a woken gloo thread waited up to a slice at
each hand-off and the steps spread out: on the 2-core development VM at load 8 (the runs at nice
-5, other jobs at 19), 30 steps of that run had a median of 273 ms and a fastest of 167 ms.

Since Linux 6.12 a task may ask for a shorter slice (``sched_setattr`` with ``SCHED_OTHER`` and
``sched_runtime``, 0.1-100 ms): its virtual deadline comes sooner, so its wake-ups preempt the
running task at once, and a task that protects its slice protects at most the shortest slice
queued beside it. :func:`request_short_slices` asks for :data:`SHORT_SLICE_S` for every thread
of this process (threads and processes started later inherit it); the same run, next in line,
had a median of 143 ms and a fastest of 108 ms. :class:`lynx.runtime.Pipeline` does this for a
CPU rank (``short_slices=False`` leaves the process as it is), and ``lynx calibrate``'s ranks
do it too, so the calibrated TP and pipeline links are the ones a training rank sees. It changes
no priority and needs no privilege; on other systems, or kernels without custom slices, it
changes nothing.

Example::

    >>> from lynx.runtime.sched_slice import request_short_slices
    >>> isinstance(request_short_slices(threads=[]), int)
    True
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading
from collections.abc import Iterable

__all__ = ["SHORT_SLICE_S", "request_short_slices", "thread_slice_s", "custom_slices"]

# the shortest slice the kernel grants (sched_setattr clamps sched_runtime to 0.1-100 ms)
SHORT_SLICE_S = 100e-6

# sched_setattr's number where Linux runs (x86-64's own table; arm64 and riscv use the generic one)
_SYSCALL = {"x86_64": 314, "aarch64": 274, "arm64": 274, "riscv64": 274}
_SCHED_OTHER = 0
_ATTR = "IIQiIQQQII"   # struct sched_attr (SCHED_ATTR_SIZE_VER1, 56 bytes)


def _set_slice(libc: ctypes.CDLL, number: int, tid: int, slice_ns: int) -> bool:
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)   # kept: sched_setattr sets the nice value too
    except OSError:   # the thread ended meanwhile
        return False
    attr = struct.pack(_ATTR, struct.calcsize(_ATTR), _SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0, 0, 0)
    return libc.syscall(number, tid, ctypes.create_string_buffer(attr, len(attr)), 0) == 0


def request_short_slices(slice_s: float = SHORT_SLICE_S, threads: Iterable[int] | None = None) -> int:
    """Ask the scheduler for ``slice_s`` slices for ``threads`` (thread ids; default: every
    thread of this process, which later threads and children inherit). Returns how many took:
    0 where the system has no ``sched_setattr`` (not Linux, an unknown architecture)."""
    number = _SYSCALL.get(platform.machine())
    if platform.system() != "Linux" or number is None:
        return 0
    if threads is None:
        try:
            threads = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return 0
    libc = ctypes.CDLL(None, use_errno=True)
    return sum(_set_slice(libc, number, tid, int(slice_s * 1e9)) for tid in threads)


def custom_slices() -> bool:
    """Whether this kernel grants a task the slice it asks for (Linux 6.12 or later)."""
    if platform.system() != "Linux":
        return False
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 12)


def thread_slice_s(tid: int | None = None) -> float | None:
    """The slice the scheduler gives thread ``tid`` (default: the calling one), from
    ``/proc/self/task/<tid>/sched``; None where the kernel does not show it."""
    tid = tid if tid is not None else threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1]) / 1e9
    except (OSError, ValueError):
        return None
    return None
