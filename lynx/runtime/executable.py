"""Whether the runtime can execute a plan as planned — asked before any process group is made.

A plan the runtime cannot execute is refused, never run approximately: a schedule it does
not run would train in another order than the plan describes (and measure nothing it
predicts). What the runtime executes is read from the runtime itself — its schedules from
:data:`lynx.planner.schedule.RUNTIME_SCHEDULES` (the schedules it runs, of those the planner
plans), so a schedule the runtime learns is accepted here at once. Tensor parallelism
(``tp > 1``) runs under :data:`TP_SCHEDULES` (each rank's stage holds its shards,
``docs/tensor_parallel.md``), without offload and without compiled stage graphs: those are
refused until the TP backward graph is checked under them. A plan for ``tp > 1`` also needs
the sharding plan it was priced with, which :class:`lynx.runtime.Pipeline` checks on the
compiled model.

Example::

    >>> missing({"pp": 2, "tp": 2, "schedule": "1f1b"})
    []
    >>> for gap in missing({"pp": 2, "tp": 2, "schedule": "zbh1"}):
    ...     print(gap)
    schedule 'zbh1' with tensor parallelism (tp 2 runs under 1f1b, gpipe: plan with one of them, or with tp=1)
    >>> missing({"pp": 2, "schedule": "zbv"})
    ["schedule 'zbv' (the runtime executes 1f1b, gpipe, interleaved1f1b, zbh1: plan with one of them)"]
    >>> missing({"pp": 2, "tp": 2, "schedule": "1f1b", "offload": True})
    ['offload with tensor parallelism (tp 2: plan with offload off, or with tp=1)']
"""

from __future__ import annotations

from typing import Any

from lynx.errors import LynxConfigError

__all__ = ["missing", "check_executable", "TP_SCHEDULES"]

# the schedules whose TP backward graphs (recompute between all-reduce and wait) are checked
# against single-process PyTorch (tests/runtime/test_tp_pipeline.py)
TP_SCHEDULES = ("1f1b", "gpipe")


def missing(config: dict[str, Any]) -> list[str]:
    """What the runtime lacks to execute a plan made under ``config`` (its ``config`` record)."""
    from lynx.planner.schedule import RUNTIME_SCHEDULES

    gaps = []
    schedule = config.get("schedule", "1f1b")
    if schedule not in RUNTIME_SCHEDULES:
        gaps.append(f"schedule {schedule!r} (the runtime executes {', '.join(RUNTIME_SCHEDULES)}: plan with one "
                    f"of them)")
    tp = int(config.get("tp", 1) or 1)
    if tp > 1 and schedule in RUNTIME_SCHEDULES and schedule not in TP_SCHEDULES:
        gaps.append(f"schedule {schedule!r} with tensor parallelism (tp {tp} runs under {', '.join(TP_SCHEDULES)}: "
                    f"plan with one of them, or with tp=1)")
    if tp > 1 and config.get("offload"):
        gaps.append(f"offload with tensor parallelism (tp {tp}: plan with offload off, or with tp=1)")
    if tp > 1 and config.get("compile"):
        gaps.append(f"compiled stage graphs with tensor parallelism (tp {tp}: plan with compile off)")
    return gaps


def check_executable(config: dict[str, Any]) -> None:
    """Refuse a plan made under ``config`` that the runtime cannot execute, naming what is missing."""
    gaps = missing(config)
    if gaps:
        raise LynxConfigError("this plan cannot be run: the runtime does not execute " + "; nor ".join(gaps))
