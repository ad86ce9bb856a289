"""A measurement taken several times: the median is the value, the spread says how steady it was.

Each repeat is itself the fastest of several timed runs (:func:`fastest`), timed by the
thread's CPU clock where the work runs on the calling thread: other processes on the machine
take the core away, which adds wall time but not CPU time, and contention only ever adds time,
so the fastest run is the one least disturbed. What the runs got of a core (CPU time over wall
time) is kept beside it: 1.0 had a core to itself, 0.3 shared it with two other jobs.

Example::

    >>> m = Repeated("matmul_flops", [90e9, 100e9, 110e9])
    >>> m.median, round(m.spread, 2), round(m.deviation, 2)
    (100000000000.0, 0.2, 0.1)
    >>> link = Repeated("alpha_s", [31e-6, 30e-6, 45e-6], best="min")
    >>> link.value, round(link.deviation, 3)
    (3e-05, 0.033)
    >>> t = fastest(lambda: sum(range(1000)), runs=3)
    >>> t.seconds > 0 and 0 < t.cpu_share <= 1.0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Repeated", "Timing", "fastest", "best_of"]


@dataclass
class Repeated:
    """One quantity's values over the repeats, and the share of a core each was measured with.

    Its :attr:`value` is the median; with ``best`` (``"min"`` or ``"max"``) the best repeat
    instead — for what is timed in wall time across processes (a link, the runtime's ranks),
    where other load only ever slows a repeat down, so the best one is the least disturbed and
    the median follows the load. Such a figure is steady when its two best repeats agree."""

    name: str
    values: list[float] = field(default_factory=list)
    cpu_shares: list[float] = field(default_factory=list)
    best: str | None = None
    # the most cpus other processes took while a repeat was timed, where that was counted (a
    # figure timed in wall time across processes that idle between hand-offs: the TP stage)
    others_cpus: float | None = None

    def add(self, value: float, cpu_share: float | None = None) -> None:
        self.values.append(value)
        if cpu_share is not None:
            self.cpu_shares.append(cpu_share)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def value(self) -> float:
        """The figure: the median, or the best repeat (``best``)."""
        if self.best is None:
            return self.median
        return min(self.values) if self.best == "min" else max(self.values)

    @property
    def spread(self) -> float:
        """``(max − min) / median``: 0 for a perfectly steady measurement."""
        mid = self.median
        return (max(self.values) - min(self.values)) / mid if mid else 0.0

    @property
    def deviation(self) -> float:
        """How far the figure may be off, as a fraction of it: the farthest repeat from the
        median, or (``best``) the second-best repeat from the best."""
        if self.best is not None:
            ranked = sorted(self.values, reverse=self.best == "max")
            return abs(ranked[1] - ranked[0]) / abs(ranked[0]) if len(ranked) > 1 and ranked[0] else 0.0
        mid = self.median
        return max(abs(v - mid) for v in self.values) / mid if mid else 0.0

    @property
    def cpu_share(self) -> float | None:
        """The least share of a core any repeat was measured with (None: not CPU-timed)."""
        return min(self.cpu_shares) if self.cpu_shares else None


@dataclass(frozen=True)
class Timing:
    """The fastest of several runs (seconds of the clock used) and the share of a core they got."""

    seconds: float
    cpu_share: float


def fastest(fn: Callable[[], object], runs: int, min_total_s: float = 0.0) -> Timing:
    """Run ``fn`` at least ``runs`` times, and until ``min_total_s`` of CPU time has passed;
    the fastest run in this thread's CPU time (``time.thread_time``: time on a core, which
    other processes do not inflate), and the runs' CPU time over their wall time."""
    best, cpu_total, wall_total, n = float("inf"), 0.0, 0.0, 0
    while n < runs or cpu_total < min_total_s:
        wall, cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        best, cpu_total, wall_total, n = min(best, cpu), cpu_total + cpu, wall_total + wall, n + 1
    return Timing(best, min(1.0, cpu_total / wall_total) if wall_total > 0 else 1.0)


def best_of(fn: Callable[[], object], runs: int) -> float:
    """The fastest of ``runs`` calls of ``fn`` in wall seconds (work that leaves the thread:
    a GPU, another process); work on this thread is timed by :func:`fastest`."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
