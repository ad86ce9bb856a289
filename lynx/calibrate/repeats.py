"""A measurement taken several times: the median is the value, the spread says how steady it was.

Example::

    >>> m = Repeated("matmul_flops", [90e9, 100e9, 110e9])
    >>> m.median, round(m.spread, 2)
    (100000000000.0, 0.2)
    >>> best_of(lambda: None, runs=3) >= 0.0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Repeated", "best_of"]


@dataclass
class Repeated:
    """One quantity's values over the repeats."""

    name: str
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> float:
        """``(max − min) / median``: 0 for a perfectly steady measurement."""
        mid = self.median
        return (max(self.values) - min(self.values)) / mid if mid else 0.0


def best_of(fn: Callable[[], object], runs: int) -> float:
    """The fastest of ``runs`` calls of ``fn``, in seconds: the run least disturbed by other load."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
