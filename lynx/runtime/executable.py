"""Whether the runtime can execute a plan as planned — asked before any process group is made.

A plan the runtime cannot execute is refused, never run approximately: ``lynx.compile(...,
tp=2)`` makes a plan whose stages are meant to be sharded, and running it unsharded would
train something else than the plan describes (and measure nothing it predicts). What the
runtime executes is read from the runtime itself — its schedules from
:data:`lynx.planner.schedule.RUNTIME_SCHEDULES` (the schedules it runs, of those the planner
plans), so a schedule the runtime learns is accepted here at once.

Example::

    >>> missing({"pp": 2, "tp": 1, "schedule": "1f1b"})
    []
    >>> for gap in missing({"pp": 2, "tp": 2, "schedule": "interleaved1f1b"}):
    ...     print(gap)
    tensor parallelism (the plan is for tp 2; the runtime shards nothing: plan with tp=1)
    schedule 'interleaved1f1b' (the runtime executes 1f1b, gpipe: plan with one of them)
"""

from __future__ import annotations

from typing import Any

from lynx.errors import LynxConfigError

__all__ = ["missing", "check_executable"]


def missing(config: dict[str, Any]) -> list[str]:
    """What the runtime lacks to execute a plan made under ``config`` (its ``config`` record)."""
    from lynx.planner.schedule import RUNTIME_SCHEDULES

    gaps = []
    tp = int(config.get("tp", 1) or 1)
    if tp > 1:
        gaps.append(f"tensor parallelism (the plan is for tp {tp}; the runtime shards nothing: plan with tp=1)")
    schedule = config.get("schedule", "1f1b")
    if schedule not in RUNTIME_SCHEDULES:
        gaps.append(f"schedule {schedule!r} (the runtime executes {', '.join(RUNTIME_SCHEDULES)}: plan with one "
                    f"of them)")
    return gaps


def check_executable(config: dict[str, Any]) -> None:
    """Refuse a plan made under ``config`` that the runtime cannot execute, naming what is missing."""
    gaps = missing(config)
    if gaps:
        raise LynxConfigError("this plan cannot be run: the runtime does not execute " + "; nor ".join(gaps))
