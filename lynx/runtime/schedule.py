"""Per-stage action order of the pipeline schedules the runtime executes (1F1B, GPipe).

Each stage runs a list of ``Action("F"|"B", microbatch)``. 1F1B warms up with
``min(p - s - 1, m)`` forwards, then alternates one forward and one backward, then drains, so
at most ``min(p - s, m)`` microbatches are in flight on stage ``s``; GPipe runs every forward,
then every backward (``m`` in flight). These are the orders ``torch.distributed.pipelining``'s
``Schedule1F1B`` / ``ScheduleGPipe`` use; the runtime lowers them to its own send/receive and
window-recompute steps (see :mod:`lynx.runtime.pipeline`).

Example::

    >>> [str(a) for a in stage_actions("1f1b", stage=0, stages=2, microbatches=3)]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> max_in_flight("gpipe", stage=0, stages=2, microbatches=3)
    3
"""

from __future__ import annotations

from typing import NamedTuple

from lynx.errors import LynxConfigError

__all__ = ["Action", "SCHEDULES", "stage_actions", "max_in_flight"]

SCHEDULES = ("1f1b", "gpipe")


class Action(NamedTuple):
    kind: str         # "F" forward | "B" backward
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def stage_actions(schedule: str, *, stage: int, stages: int, microbatches: int) -> list[Action]:
    """The order stage ``stage`` of ``stages`` runs its forwards and backwards."""
    if schedule not in SCHEDULES:
        raise LynxConfigError(f"runtime schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 <= stage < stages:
        raise LynxConfigError(f"stage {stage} is out of range 0..{stages - 1}")
    if microbatches < 1:
        raise LynxConfigError(f"microbatches must be >= 1, got {microbatches}")
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)]
    warmup = min(stages - stage - 1, m)
    actions = [Action("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", j) for j in range(m - warmup, m)]
    return actions


def max_in_flight(schedule: str, *, stage: int, stages: int, microbatches: int) -> int:
    """Most microbatches whose forward ran and backward did not, on ``stage``."""
    live = peak = 0
    for action in stage_actions(schedule, stage=stage, stages=stages, microbatches=microbatches):
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak
