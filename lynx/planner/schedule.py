"""Pipeline schedules as typed per-device action lists: the one definition planner and runtime share.

A schedule is generated here once, per device, as a list of :class:`Action` s; the timeline's
replay (:mod:`lynx.planner.timeline`) times it, the runtime (:mod:`lynx.runtime.runner`)
executes it. Adding a schedule is adding a generator of its compute order.

* :func:`compute_order`: the order of each device's forwards ``F``, backwards ``B`` — or, for
  zero-bubble schedules, input-gradient ``I`` and deferred weight-gradient ``W`` halves — per
  model chunk and microbatch. ``1f1b`` warms up with ``min(p - s - 1, m)`` forwards and
  alternates; ``gpipe`` runs every forward then every backward; ``interleaved1f1b`` runs
  ``virtual`` chunks per device (Megatron's order; chunk ``c`` on device ``c mod p``);
  ``zbh1`` is 1F1B with each backward split into ``I`` and ``W``, device ``s`` deferring its
  ``W`` by ``s`` steps so they fill the cool-down bubbles at 1F1B's memory (the ZB-H1 order of
  ``torch.distributed.pipelining``'s ``ScheduleInterleavedZeroBubble`` with one chunk per
  device). These are the orders of the library's ``Schedule1F1B``, ``ScheduleGPipe``,
  ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``.
* :func:`rank_actions`: the same order with everything a device does around it — each
  receive posted before the sends of its gap (``RECV_B`` as the activation is sent, ``RECV_F``
  ahead of the compute action before the previous receiving forward, so never more than two
  activation receives await their forward), the plan's window recompute ``R`` right before the
  action that waits on a receive, sends, ``DP`` (this chunk's gradients become final in the
  next action: launch their data-parallel buckets as they do) and the closing ``OPT``. gloo
  writes a message only once the receiver's readiness notice is in, and that notice queues
  behind the receiver's own outgoing bytes on the connection: a receive posted after a send
  would hold the peer's message back by up to a whole transfer.

Messages carry a tag per kind, boundary and microbatch (:func:`message_tag`), so a receive
posted early can never take another message's place.

Example::

    >>> [str(a) for a in compute_order("1f1b", pp=2, microbatches=3)[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> [str(a) for a in compute_order("zbh1", pp=2, microbatches=3)[1]]
    ['F0', 'I0', 'F1', 'I1', 'W0', 'F2', 'I2', 'W1', 'W2']
    >>> print(" ".join(str(a) for a in rank_actions("1f1b", pp=2, microbatches=2)[0]))
    F0 RECV_B0 SEND_F0 F1 RECV_B1 SEND_F1 R[s0.recv_grad.mb0] B0 R[s0.recv_grad.mb1] DP B1 OPT
    >>> max_in_flight("gpipe", stage=0, stages=2, microbatches=3)
    3
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from lynx.errors import LynxConfigError
from lynx.planner.windows import WindowId

__all__ = [
    "SCHEDULES",
    "RUNTIME_SCHEDULES",
    "Op",
    "Action",
    "POSTS",
    "list_actions",
    "compute_order",
    "rank_actions",
    "stage_actions",
    "max_in_flight",
    "message_tag",
    "chunks_of",
    "link_order_problems",
]

SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b", "zbh1")
# what the multi-process runtime executes
RUNTIME_SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b", "zbh1")


class Op(str, Enum):
    """What an action does (its ``value`` is how it prints)."""

    FORWARD = "F"
    BACKWARD = "B"            # input and weight gradients together
    BACKWARD_INPUT = "I"      # zero bubble: the input gradients (what the previous chunk waits for)
    BACKWARD_WEIGHT = "W"     # zero bubble: the weight gradients, deferred
    RECOMPUTE = "R"           # the plan's recompute for ``window``, while the next receive is in flight
    SEND_ACT = "SEND_F"
    RECV_ACT = "RECV_F"       # post the receive; the forward that needs it waits for it
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"
    DP_LAUNCH = "DP"          # the next action makes this chunk's gradients final: launch their buckets
    OPTIMIZER = "OPT"         # the step's end: gradient syncs finish, the optimizer steps


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
POSTS = (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD)   # the sends and receives a device posts


@dataclass(frozen=True)
class Action:
    """One action of one device: ``op`` on model ``chunk`` for ``microbatch`` (``window`` for ``R``)."""

    op: Op
    chunk: int = -1
    microbatch: int = -1
    window: Optional[WindowId] = None

    @property
    def kind(self) -> str:
        """``op``'s letter(s), e.g. ``"F"``."""
        return self.op.value

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE

    def __str__(self) -> str:
        if self.op is Op.RECOMPUTE:
            return f"R[{self.window}]"
        if self.microbatch < 0:
            return self.op.value
        return f"{self.op.value}{self.microbatch}"


def chunks_of(device: int, pp: int, virtual: int = 1) -> list[int]:
    """The model chunks device ``device`` runs: ``device, device + pp, …`` (``virtual`` of them)."""
    return [k * pp + device for k in range(virtual)]


def message_tag(kind: Op, boundary: int, microbatch: int) -> int:
    """The tag of the message crossing ``boundary`` (between chunks ``boundary`` and ``boundary + 1``):
    activations (``SEND_ACT``/``RECV_ACT``) and gradients (``SEND_GRAD``/``RECV_GRAD``) apart."""
    direction = 0 if kind in (Op.SEND_ACT, Op.RECV_ACT) else 1
    return ((boundary << 20) + microbatch) * 2 + direction


def _check(schedule: str, pp: int, microbatches: int, virtual: int) -> int:
    if schedule not in SCHEDULES:
        raise LynxConfigError(f"unknown schedule {schedule!r}; use {', '.join(SCHEDULES)}")
    if pp < 1:
        raise LynxConfigError(f"pp must be >= 1, got {pp}")
    if microbatches < 1:
        raise LynxConfigError(f"microbatches must be >= 1, got {microbatches}")
    if schedule != "interleaved1f1b":
        return 1
    if virtual < 2:
        raise LynxConfigError(f"interleaved1f1b needs virtual_stages >= 2, got {virtual}")
    if microbatches % pp:
        raise LynxConfigError(f"interleaved1f1b needs microbatches divisible by pp ({microbatches} % {pp} != 0)")
    return virtual


def _device_order(schedule: str, s: int, pp: int, m: int, virtual: int) -> list[Action]:
    F, B, In, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    if schedule == "gpipe":
        return [Action(F, s, j) for j in range(m)] + [Action(B, s, j) for j in range(m)]
    if schedule in ("1f1b", "zbh1"):
        warm = min(pp - s - 1, m)
        back = B if schedule == "1f1b" else In
        acts = [Action(F, s, j) for j in range(warm)]
        steps = [[Action(F, s, warm + i), Action(back, s, i)] for i in range(m - warm)]
        steps += [[Action(back, s, j)] for j in range(m - warm, m)]
        if schedule == "zbh1":   # W of the k-th backward after the (k + s)-th: device s defers by s
            for k, step in enumerate(steps):
                if k >= s:
                    step.append(Action(W, s, k - s))
            steps.append([Action(W, s, j) for j in range(max(0, m - s), m)])
        return acts + [a for step in steps for a in step]
    # interleaved1f1b: k-th forward (backward) of this device runs chunk local*pp + s
    total = m * virtual

    def fwd(k: int) -> Action:
        local = (k % (pp * virtual)) // pp
        return Action(F, local * pp + s, (k // (pp * virtual)) * pp + k % pp)

    def bwd(k: int) -> Action:
        local = virtual - 1 - (k % (pp * virtual)) // pp
        return Action(B, local * pp + s, (k // (pp * virtual)) * pp + k % pp)

    warm = min((pp - s - 1) * 2 + (virtual - 1) * pp, total)
    acts = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        acts += [fwd(warm + i), bwd(i)]
    return acts + [bwd(k) for k in range(total - warm, total)]


def compute_order(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per device the ordered compute actions (``F``, ``B``, ``I``, ``W``) of one training step."""
    virtual = _check(schedule, pp, microbatches, virtual)
    return [_device_order(schedule, s, pp, microbatches, virtual) for s in range(pp)]


def rank_actions(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per device the whole action list of one training step (see module docstring)."""
    virtual = _check(schedule, pp, microbatches, virtual)
    return [_device_actions(s, order, pp * virtual - 1, virtual > 1)
            for s, order in enumerate(compute_order(schedule, pp, microbatches, virtual))]


def _device_actions(s: int, order: list[Action], last_chunk: int, interleaved: bool) -> list[Action]:
    """One device's list: around each compute action of ``order`` its window, sends and receives.

    A receive's readiness notice travels to the sender on the same connection as this device's
    own outgoing data (gloo writes a message only once the receiver has posted its receive), so
    a receive posted after a send waits for that send's bytes to cross first. Receives are
    therefore posted before the sends of the same gap, and a forward's activation receive in the
    gap before the compute action preceding the previous receiving forward — ahead of that
    action's sends (a backward sends its input gradients inside it) — so its notice crosses
    while the link is still free."""
    grads_final = {}   # chunk -> index of the action that makes its weight gradients final
    for i, a in enumerate(order):
        if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            grads_final[a.chunk] = i
    # recvs[i]: the receives posted right before compute action i (after action i - 1, before its sends)
    recvs: list[list[Action]] = [[] for _ in range(len(order) + 1)]
    receiving = [i for i, a in enumerate(order) if a.op is Op.FORWARD and a.chunk > 0]
    for n, i in enumerate(receiving):
        at = receiving[n - 1] - 1 if n else 0
        if at < 0 or (n > 1 and at == receiving[n - 2]):   # no more than two activation buffers awaited
            at += 1
        recvs[at].append(Action(Op.RECV_ACT, order[i].chunk, order[i].microbatch))
    for i, a in enumerate(order):
        if a.op is Op.FORWARD and a.chunk < last_chunk:   # its gradient: posted as the activation is sent
            recvs[i + 1].insert(0, Action(Op.RECV_GRAD, a.chunk, a.microbatch))
    acts: list[Action] = list(recvs[0])
    for i, a in enumerate(order):
        chunk, j = a.chunk, a.microbatch
        window_chunk = chunk if interleaved else None
        if a.op is Op.FORWARD and chunk > 0:
            acts.append(Action(Op.RECOMPUTE, chunk, j, WindowId.recv(s, "recv_act", j, window_chunk)))
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            acts.append(Action(Op.RECOMPUTE, chunk, j, WindowId.recv(s, "recv_grad", j, window_chunk)))
        if grads_final.get(chunk) == i:
            acts.append(Action(Op.DP_LAUNCH, chunk))
        acts.append(a)
        acts += recvs[i + 1]
        if a.op is Op.FORWARD and chunk < last_chunk:
            acts.append(Action(Op.SEND_ACT, chunk, j))
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and chunk > 0:
            acts.append(Action(Op.SEND_GRAD, chunk, j))
    acts.append(Action(Op.OPTIMIZER))
    return acts


def list_actions(schedule: str, pp: int, microbatches: int, device: int, virtual: int = 1) -> int:
    """Actions of ``device``'s list the runtime spends host work on: its compute actions and the
    sends and receives it posts (each costs ``HardwareSpec.runtime_action_s`` in the timeline).

    Example::

        >>> list_actions("1f1b", pp=2, microbatches=4, device=0)   # 4 F, 4 B, 4 SEND_F, 4 RECV_B
        16
    """
    acts = rank_actions(schedule, pp, microbatches, virtual)[device]
    return sum(1 for a in acts if a.is_compute or a.op in POSTS)


def stage_actions(schedule: str, *, stage: int, stages: int, microbatches: int,
                  virtual: int = 1) -> list[Action]:
    """The compute order of device ``stage`` of ``stages`` (what the trace of a step shows)."""
    if not 0 <= stage < stages:
        raise LynxConfigError(f"stage {stage} is out of range 0..{stages - 1}")
    return compute_order(schedule, stages, microbatches, virtual)[stage]


def max_in_flight(schedule: str, *, stage: int, stages: int, microbatches: int, virtual: int = 1) -> int:
    """Most chunk-microbatch pairs whose forward ran and whose backward (its ``W`` under zero
    bubble: what holds the weight gradient's inputs) did not, on ``stage``."""
    live = peak = 0
    for action in stage_actions(schedule, stage=stage, stages=stages, microbatches=microbatches, virtual=virtual):
        if action.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif action.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            live -= 1
    return peak


def _peer(a: Action, device: int, pp: int) -> int:
    """The device on the other end of a send or receive."""
    toward_next = a.op in (Op.SEND_ACT, Op.RECV_GRAD)
    return (a.chunk + 1) % pp if toward_next else (a.chunk - 1) % pp


def link_order_problems(lists: list[list[Action]], pp: int) -> list[str]:
    """Where a receive is posted out of its peer's send order (empty: none).

    Lynx's tags make any order safe on gloo; NCCL ignores tags and matches a pair of ranks'
    point-to-point operations in the order they are posted, so there each link's receives must
    follow the sender's order."""
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    posted: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for device, acts in enumerate(lists):
        for a in acts:
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                boundary = a.chunk if a.op is Op.SEND_ACT else a.chunk - 1
                sent.setdefault((device, _peer(a, device, pp)), []).append((a.op.value[-1], boundary, a.microbatch))
            elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                boundary = a.chunk - 1 if a.op is Op.RECV_ACT else a.chunk
                posted.setdefault((_peer(a, device, pp), device), []).append((a.op.value[-1], boundary, a.microbatch))
    problems = []
    for link in sorted(set(sent) | set(posted)):
        mine, theirs = sent.get(link, []), posted.get(link, [])
        if mine != theirs:
            k = next(i for i, (x, y) in enumerate(zip(mine + [None], theirs + [None])) if x != y)
            sent_as = mine[k] if k < len(mine) else None
            received_as = theirs[k] if k < len(theirs) else None
            problems.append(f"device {link[0]} -> {link[1]}: message {k} is sent as {sent_as} "
                            f"but received as {received_as}")
    return problems
