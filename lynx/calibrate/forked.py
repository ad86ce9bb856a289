"""The calibration's few-process measurements: start them, take their results, leave nothing behind.

Each measurement that needs two ranks (a link, the all-reduces, the runtime's own cost, a
tensor-parallel stage) forks its processes, which put what they measured on a queue.
:func:`collect` starts them, takes ``expected`` results (waiting at most ``timeout_s`` for
each), then joins every process, killing one that lingers.

    >>> import multiprocessing as mp
    >>> ctx = mp.get_context("spawn")
    >>> collect([], ctx.Queue(), 0, timeout_s=1.0)
    ([], None)
"""

from __future__ import annotations

from typing import Any

__all__ = ["collect"]


def collect(procs: list[Any], queue: Any, expected: int, timeout_s: float) -> tuple[list[Any], str | None]:
    """Start ``procs``; the first ``expected`` items they put on ``queue``, and None — or the items
    that came and why the rest did not (a worker died or hung)."""
    for p in procs:
        p.start()
    items: list[Any] = []
    try:
        for _ in range(expected):
            items.append(queue.get(timeout=timeout_s))
    except Exception:  # noqa: BLE001 - queue.Empty: a worker died or hung
        return items, f"no result within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return items, None
