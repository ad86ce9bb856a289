"""Pipeline schedules and window names: the one definition the planner and the runtime share.

:func:`schedule_order` gives, per device, the order of its forward and backward actions in one
training step. 1F1B warms up with ``min(p - s - 1, m)`` forwards, alternates one forward and one
backward, then drains, so at most ``min(p - s, m)`` microbatches are in flight on stage ``s``;
GPipe runs every forward, then every backward (``m`` in flight); interleaved 1F1B runs
``virtual`` chunks per device (Megatron's order). These are the orders
``torch.distributed.pipelining``'s ``Schedule1F1B`` / ``ScheduleGPipe`` /
``ScheduleInterleaved1F1B`` use.

Window ids name the idle intervals recomputation may fill; the planner writes them into plans
and the runtime looks them up, so both build them here.

Example::

    >>> [str(a) for a in schedule_order("1f1b", pp=2, microbatches=3)[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> max_in_flight("gpipe", stage=0, stages=2, microbatches=3)
    3
    >>> recv_window_id(0, "recv_grad", microbatch=3), tp_window_id(1, layer=5, microbatch=0)
    ('s0.recv_grad.mb3', 's1.tp.l5.b.mb0')
    >>> window_place("s1.tp.l5.b.mb0"), window_place(dp_window_id(0, block=2))
    ((1, 'tp_allreduce'), (0, 'dp_collective'))
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from lynx.errors import LynxConfigError

__all__ = [
    "SCHEDULES",
    "RUNTIME_SCHEDULES",
    "ScheduledAction",
    "schedule_order",
    "stage_actions",
    "max_in_flight",
    "recv_window_id",
    "tp_window_id",
    "dp_window_id",
    "window_place",
]

SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b")
# what the multi-process runtime executes (interleaved schedules are planned, not run)
RUNTIME_SCHEDULES = ("1f1b", "gpipe")


class ScheduledAction(NamedTuple):
    """One forward (``"F"``) or backward (``"B"``) of a microbatch on a chunk of the model."""

    kind: str
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _device_order(schedule: str, s: int, pp: int, m: int, virtual: int) -> list[ScheduledAction]:
    A = ScheduledAction
    if schedule == "gpipe":
        return [A("F", s, j) for j in range(m)] + [A("B", s, j) for j in range(m)]
    if schedule == "1f1b":
        warm = min(pp - s - 1, m)
        acts = [A("F", s, j) for j in range(warm)]
        for i in range(m - warm):
            acts += [A("F", s, warm + i), A("B", s, i)]
        return acts + [A("B", s, j) for j in range(m - warm, m)]
    # interleaved1f1b: k-th forward (backward) of this device runs chunk local*pp + s
    total = m * virtual

    def fwd(k: int) -> ScheduledAction:
        local = (k % (pp * virtual)) // pp
        return A("F", local * pp + s, (k // (pp * virtual)) * pp + k % pp)

    def bwd(k: int) -> ScheduledAction:
        local = virtual - 1 - (k % (pp * virtual)) // pp
        return A("B", local * pp + s, (k // (pp * virtual)) * pp + k % pp)

    warm = min((pp - s - 1) * 2 + (virtual - 1) * pp, total)
    acts = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        acts += [fwd(warm + i), bwd(i)]
    return acts + [bwd(k) for k in range(total - warm, total)]


def schedule_order(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[ScheduledAction]]:
    """Per device the ordered actions of one training step."""
    if schedule not in SCHEDULES:
        raise LynxConfigError(f"unknown schedule {schedule!r}; use {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise LynxConfigError(f"microbatches must be >= 1, got {microbatches}")
    if schedule == "interleaved1f1b" and microbatches % pp:
        raise LynxConfigError(f"interleaved1f1b needs microbatches divisible by pp ({microbatches} % {pp} != 0)")
    return [_device_order(schedule, s, pp, microbatches, virtual if schedule == "interleaved1f1b" else 1)
            for s in range(pp)]


def stage_actions(schedule: str, *, stage: int, stages: int, microbatches: int) -> list[ScheduledAction]:
    """The order stage ``stage`` of ``stages`` runs its forwards and backwards (one chunk per stage)."""
    if schedule not in RUNTIME_SCHEDULES:
        raise LynxConfigError(f"runtime schedule must be one of {RUNTIME_SCHEDULES}, got {schedule!r}")
    if not 0 <= stage < stages:
        raise LynxConfigError(f"stage {stage} is out of range 0..{stages - 1}")
    if microbatches < 1:
        raise LynxConfigError(f"microbatches must be >= 1, got {microbatches}")
    return _device_order(schedule, stage, stages, microbatches, 1)


def max_in_flight(schedule: str, *, stage: int, stages: int, microbatches: int) -> int:
    """Most microbatches whose forward ran and backward did not, on ``stage``."""
    live = peak = 0
    for action in stage_actions(schedule, stage=stage, stages=stages, microbatches=microbatches):
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def recv_window_id(device: int, kind: str, microbatch: int, chunk: Optional[int] = None) -> str:
    """The wait for a pipeline receive (``kind``: ``recv_grad`` or ``recv_act``) of ``microbatch``;
    ``chunk`` only under interleaved schedules (several chunks per device)."""
    return f"s{device}.{kind}.mb{microbatch}" if chunk is None else f"s{device}.{kind}.c{chunk}.mb{microbatch}"


def tp_window_id(device: int, layer: int, microbatch: int) -> str:
    """The tensor-parallel all-reduces inside ``layer``'s backward of ``microbatch``."""
    return f"s{device}.tp.l{layer}.b.mb{microbatch}"


def dp_window_id(device: int, block: int) -> str:
    """The data-parallel collective of ``block``'s gradients (launched in the last backward)."""
    return f"s{device}.dp.b{block}"


_WINDOW_RE = re.compile(r"^s(\d+)\.(recv_grad|recv_act|tp|dp)\.")
_WINDOW_KIND = {"recv_grad": "recv_grad", "recv_act": "recv_act", "tp": "tp_allreduce", "dp": "dp_collective"}


def window_place(window_id: str) -> tuple[int, str]:
    """``(device, kind)`` of a window id built here; kind is ``recv_grad``, ``recv_act``,
    ``tp_allreduce`` or ``dp_collective``."""
    match = _WINDOW_RE.match(window_id)
    if match is None:
        raise LynxConfigError(f"{window_id!r} is not a Lynx window id (e.g. 's0.recv_grad.mb3')")
    return int(match.group(1)), _WINDOW_KIND[match.group(2)]
