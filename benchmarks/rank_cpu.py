"""Where a CPU rank's core time goes during a step: its main thread, its other threads, softirqs.

A rank's compute runs on its main thread; gloo's threads (the transport's loop, the process
group's workers) and the kernel's softirqs for the link's traffic run on the same core and take
time from it. Issue 27 traced the ranks of ``schedules_cpu.py`` computing 1.1–1.35× their plan
over the test bed's shaped link (0.96–1.03× over loopback in the same run) to exactly this:
:func:`cpu_sample` reads, from ``/proc`` (Linux; zeros elsewhere), the main thread's run time
and the time it waited runnable while another thread had the core (``schedstat``), the other
threads' run time, the main thread's involuntary context switches and the core's softirq time
(tick-sampled, 10 ms ticks); :func:`cpu_delta` turns two samples into one step's figures.

    >>> a = cpu_sample(); b = cpu_sample()
    >>> sorted(cpu_delta(a, b))
    ['main_s', 'main_waited_s', 'nonvoluntary_switches', 'other_threads_s', 'softirq_s']
"""

from __future__ import annotations

import os

__all__ = ["cpu_sample", "cpu_delta"]

_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _schedstat(tid: str) -> tuple[int, int]:
    """(ns on the CPU, ns waited runnable) of thread ``tid`` of this process; (0, 0) if gone."""
    try:
        run, waited, _ = open(f"/proc/self/task/{tid}/schedstat").read().split()
    except (OSError, ValueError):
        return 0, 0
    return int(run), int(waited)


def cpu_sample() -> tuple[int, int, int, int, int]:
    """(main ns run, main ns waited runnable, other threads' ns run, main's involuntary switches,
    softirq ticks of the first core this process may run on); zeros where ``/proc`` lacks them."""
    main = str(os.getpid())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0, 0, 0, 0, 0
    run = waited = other = switches = 0
    for tid in tids:
        r, w = _schedstat(tid)
        if tid == main:
            run, waited = r, w
        else:
            other += r
    try:
        for line in open(f"/proc/self/task/{main}/status"):
            if line.startswith("nonvoluntary_ctxt_switches"):
                switches = int(line.split()[1])
        core = min(os.sched_getaffinity(0))
        softirq = next(int(line.split()[7]) for line in open("/proc/stat") if line.startswith(f"cpu{core} "))
    except (OSError, StopIteration, IndexError, ValueError):
        softirq = 0
    return run, waited, other, switches, softirq


def cpu_delta(before: tuple[int, ...], after: tuple[int, ...]) -> dict[str, float]:
    """One interval's figures from two :func:`cpu_sample` results (seconds, and a count)."""
    d = [b - a for a, b in zip(before, after)]
    return {"main_s": d[0] * 1e-9, "main_waited_s": d[1] * 1e-9, "other_threads_s": d[2] * 1e-9,
            "nonvoluntary_switches": d[3], "softirq_s": d[4] * _TICK_S}
