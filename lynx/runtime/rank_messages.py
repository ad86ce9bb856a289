"""What one step of a :class:`~lynx.runtime.runner.StageRunner` has in flight, and its messages.

:class:`StepState` holds a step's posted receives and sends and the forwards awaiting their
backward. :class:`RankMessages` is the runner's point-to-point side (its base class): posting
the receives of activations and gradients where the action list posts them (with the boundary
flags saying which sent values need a gradient back), sending them, and the bounded wait every
receive and send goes through — blocking on a :class:`~lynx.runtime.p2p.Pollable`'s completion
in slices, with the :class:`~lynx.runtime.faults.FaultMonitor` asked between them, so a failed
peer is named instead of hanging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lynx.planner.schedule import Action, Op, message_tag
from lynx.runtime.faults import FaultMonitor, PeerTimeoutError
from lynx.runtime.p2p import BoundaryMeta, Pollable, flags_tag, post_recv, post_send
from lynx.runtime.stats import StepStats
from lynx.runtime.step import InFlight, needs_grad
from lynx.runtime.topology import Topology

__all__ = ["StepState", "RankMessages"]

_MAX_CHECK_S = 1.0   # longest gap between two looks at the store while a receive is awaited


@dataclass
class StepState:
    """What one step has in flight: posted receives and sends, forwards awaiting backward."""

    stats: StepStats
    start: float
    recv: dict[tuple[Op, int, int], tuple[list, list]] = field(default_factory=dict)
    flights: dict[tuple[int, int], InFlight] = field(default_factory=dict)
    to_send: dict[tuple[int, int], list] = field(default_factory=dict)     # input gradients, until sent
    sends: list[tuple[list, list]] = field(default_factory=list)
    # an activation send holds its tensors: dropped once that microbatch's gradient is back
    # (the peer has used it), so a stage holds no more than the plan counts
    act_sends: dict[tuple[int, int], tuple[list, list]] = field(default_factory=dict)
    flag_recv: dict[int, Any] = field(default_factory=dict)   # chunk -> (buffer, works) of its flags
    sent_first: set[tuple[int, int]] = field(default_factory=set)   # (chunk, mb): input gradients sent inside B
    # chunk -> gradient receives listed before the chunk's first activation send of the runner's
    # first step, which tells which values get a gradient back: posted right after it learns that
    unflagged: dict[int, list[Action]] = field(default_factory=dict)
    armed: bool = False


class RankMessages:
    """The messages of a rank's chunks: receives posted, activations and gradients sent, bounded
    waits (the base of :class:`~lynx.runtime.runner.StageRunner`, which sets these attributes)."""

    topo: Topology
    monitor: FaultMonitor
    device: torch.device
    recv_meta: dict[int, list[BoundaryMeta]]   # chunk -> what it receives from the previous chunk
    send_meta: dict[int, list[BoundaryMeta]]   # chunk -> what it sends to the next
    send_flags: dict[int, list[bool]]          # chunk -> which sent values need a gradient back
    recv_flags: dict[int, list[bool]]
    _watched: set[tuple[Op, int, int]]         # the receives a window polls

    config: Any                                # the runner's RuntimeConfig (trace, virtual)

    def _what(self, op: str, chunk: int) -> str:
        return op if self.config.virtual == 1 else f"{op}.c{chunk}"

    def _mark(self, stats: StepStats, what: str, j: int, t0: float) -> None:
        if self.config.trace:
            # absolute perf_counter (CLOCK_MONOTONIC on Linux): comparable across the ranks of a machine
            stats.events.append((what, j, t0, time.perf_counter()))

    def _rank_of(self, chunk: int) -> int:
        return self.topo.rank_of(chunk % self.topo.pp, self.topo.dp_rank)

    def _wait(self, work: Any, what: str, peer: int | None) -> float:
        """The monitor's bounded wait, but blocking on a :class:`Pollable`'s completion event in
        slices instead of the monitor's sleep-polling, so a receive on the critical path is
        picked up at once (the monitor polls every 2 ms: ~1 ms lost per message on average)."""
        start = time.monotonic()
        if isinstance(work, Pollable):
            # the store is asked after the first slice, then at doubling intervals up to a second:
            # each check is a round trip to rank 0's store thread (~10 ms on a loaded core), and one
            # under way when the message lands delays the rank by that much
            slice_s = min(self.monitor.check_every_s, 0.05)
            every, next_check = slice_s, start + slice_s
            while not work.block(slice_s):
                now = time.monotonic()
                if now >= next_check:
                    self.monitor.check()
                    every = min(2 * every, _MAX_CHECK_S)
                    next_check = now + every
                if now - start > self.monitor.timeout_s:
                    who = f" from rank {peer}" if peer is not None else ""
                    raise PeerTimeoutError(
                        f"rank {self.topo.rank}: {what}{who} did not complete within {self.monitor.timeout_s:g} s "
                        "and no rank reported an error; a peer may be hung or the link down (raise timeout_s "
                        "if links are slow)")
        return time.monotonic() - start + self.monitor.wait(work, what, peer)

    def _post_recv_act(self, state: StepState, a: Action) -> None:
        c, peer = a.chunk, self._rank_of(a.chunk - 1)
        if c not in self.recv_flags and c not in state.flag_recv:
            buf = torch.empty(len(self.recv_meta[c]), dtype=torch.uint8, device=self.device)
            import torch.distributed as dist

            state.flag_recv[c] = (buf, [Pollable(dist.irecv(buf, peer, tag=flags_tag(c - 1)), watch=False)])
        key = (Op.RECV_ACT, c, a.microbatch)
        t0 = time.perf_counter()
        state.recv[key] = post_recv(self.recv_meta[c], peer, message_tag(Op.RECV_ACT, c - 1, a.microbatch),
                                    self.device, watch=key in self._watched)
        self._mark(state.stats, self._what("post_act", c), a.microbatch, t0)

    def _post_recv_grad(self, state: StepState, a: Action) -> None:
        c = a.chunk
        if c not in self.send_flags:   # the first step: known once the first activation is sent
            state.unflagged.setdefault(c, []).append(a)
            return
        key = (Op.RECV_GRAD, c, a.microbatch)
        t0 = time.perf_counter()
        state.recv[key] = post_recv(self.send_meta[c], self._rank_of(c + 1), message_tag(Op.RECV_GRAD, c, a.microbatch),
                                    self.device, only=self.send_flags[c], watch=key in self._watched)
        self._mark(state.stats, self._what("post_grad", c), a.microbatch, t0)

    def _send_act(self, state: StepState, a: Action) -> None:
        c, j = a.chunk, a.microbatch
        output = state.flights[(c, j)].output
        peer = self._rank_of(c + 1)
        if c not in self.send_flags:
            self.send_flags[c] = [needs_grad(o) for o in output]
            flags = torch.tensor(self.send_flags[c], dtype=torch.uint8, device=self.device)
            state.sends.append(post_send([flags], peer, flags_tag(c)))
            for waiting in state.unflagged.pop(c, ()):
                self._post_recv_grad(state, waiting)
        t0 = time.perf_counter()
        state.act_sends[(c, j)] = post_send(list(output), peer, message_tag(Op.SEND_ACT, c, j))
        self._mark(state.stats, self._what("send_act", c), j, t0)

    def _send_grad(self, state: StepState, a: Action) -> None:
        c, j = a.chunk, a.microbatch
        if (c, j) in state.sent_first:   # already sent by its B, before the weight gradients
            return
        in_grads = state.to_send.pop((c, j))
        payload = [(g if g is not None else torch.zeros(meta.shape, dtype=meta.dtype, device=self.device))
                   if flag else None
                   for g, flag, meta in zip(in_grads, self.recv_flags.get(c, []), self.recv_meta[c])]
        t0 = time.perf_counter()
        state.sends.append(post_send(payload, self._rank_of(c - 1), message_tag(Op.SEND_GRAD, c - 1, j)))
        self._mark(state.stats, self._what("send_grad", c), j, t0)
