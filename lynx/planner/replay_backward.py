"""The backward of the timeline's replay: a ``B`` (whole, or split to send its input gradients
first), a zero-bubble input-gradient ``I`` and its deferred weight-gradient ``W``.

:class:`ReplayBackward` is a base of the replay in :mod:`lynx.planner.timeline`: per block in
reverse, the on-demand recomputation, the backward (its input-gradient part for ``I``), the
``tp_allreduce`` windows between blocks, and the weight parts (``W``'s own on-demand re-runs
first: ``Loads.on_demand_weight``). The replay supplies its state and the bookkeeping
(``host``, ``runtime``, ``account``, ``window_load``, ``eligible``); the host copies come from
:class:`~lynx.planner.replay_copies.ReplayCopies`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from lynx.planner.partition import BlockCost
from lynx.planner.replay_copies import ReplayCopies
from lynx.planner.timeline_types import Loads, PipelineCosts, TimedAction, Window
from lynx.planner.windows import WindowId

__all__ = ["ReplayBackward"]


class ReplayBackward(ReplayCopies):
    """The replay's backward actions (its subclass sets these attributes and the bookkeeping
    methods named in the module's docstring)."""

    pipe: PipelineCosts
    loads: Loads
    chunk_of: dict
    last_bwd_mb: dict[int, int]
    block_done: dict[tuple[int, int], float]
    done: dict[tuple[str, int, int], float]
    exposed: list[float]
    pending: list[dict[int, int]]
    windows: list[Window]

    # the replay's bookkeeping (lynx.planner.timeline._Replay)
    def tag(self, a: TimedAction) -> str:
        raise NotImplementedError

    def host(self, s: int, a: TimedAction, t: float) -> float:
        raise NotImplementedError

    def runtime(self, s: int, start: float, actions: int, label: str) -> float:
        raise NotImplementedError

    def window_load(self, wid: WindowId) -> float:
        raise NotImplementedError

    def eligible(self, s: int, upto_chunk: int, below_block: Optional[int] = None) -> Optional[tuple[int, ...]]:
        raise NotImplementedError

    def account(self, s: int, start: float, load: float, capacity: float, label: str) -> None:
        raise NotImplementedError

    def weight_s(self, chunk: int, cost: BlockCost) -> float:
        """A block's weight-gradient part; the first chunk's is its whole backward (nothing
        before it waits for an input gradient)."""
        return cost.backward_s if chunk == 0 else cost.backward_weight_s

    def weight(self, s: int, a: TimedAction) -> float:
        """A deferred weight-gradient ``W``: each block's weight part of its backward."""
        t = self.host(s, a, self.runtime(s, a.start, 1, f"{a.kind}{a.microbatch} runtime"))
        return self.weight_parts(s, a, reversed(self.chunk_of[a.chunk].blocks), t)

    def weight_parts(self, s: int, a: TimedAction, blocks: Iterable[int], t: float) -> float:
        """Each of ``blocks``' weight part in turn from ``t`` (a ``W``, or a split ``B``'s tail)."""
        for b in blocks:
            cost = self.pipe.costs[b]
            od = self.loads.on_demand_weight.get((a.chunk, a.microbatch, b), 0.0) if a.kind == "W" else 0.0
            if od > 0:   # what W re-runs on demand before the block's weight part (I's own re-runs: not handed)
                self.segment(s, "recompute", t, t + od, f"on demand {cost.name} (W)")
                t += od
                self.busy[s] += od
                self.exposed[s] += od
            w = self.weight_s(a.chunk, cost)
            self.segment(s, "weight", t, t + w, f"{self.tag(a)} {cost.name}")
            t += w
            self.busy[s] += w
            if a.microbatch == self.last_bwd_mb[a.chunk]:
                self.block_done[(s, b)] = t
        return t

    def backward(self, s: int, a: TimedAction) -> float:
        """Per block in reverse: on-demand recomputation, the backward (its input-gradient part
        for ``I``), its tp all-reduces (a window)."""
        t = self.host(s, a, self.runtime(s, a.start, 1, f"{a.kind}{a.microbatch} runtime"))
        copies = self.copies
        blocks = list(reversed(self.chunk_of[a.chunk].blocks))
        if self.grads_first(a, blocks):
            return self.backward_grads_first(s, a, blocks, t)
        if copies is not None and a.kind in ("B", "I"):
            t = self.copy_wait(s, a, None, self.issue_streamed(s, a, None, t))
        for b in blocks:
            cost = self.pipe.costs[b]
            compute = cost.backward_s - (self.weight_s(a.chunk, cost) if a.kind == "I" else 0.0)
            if copies is not None and a.kind in ("B", "I"):
                t = self.issue_streamed(s, a, b, t)
                t = self.copy_wait(s, a, b, t)
                held = copies.pending(s, t)
                if held > self.pending[s].get(b, 0):
                    self.pending[s][b] = held
            od = self.loads.on_demand.get((a.chunk, a.microbatch, b), 0.0)
            if od > 0:
                self.segment(s, "recompute", t, t + od, f"on demand {cost.name}")
                t += od
                self.busy[s] += od
                self.exposed[s] += od
            self.segment(s, "backward", t, t + compute, f"{self.tag(a)} {cost.name}")
            t += compute
            self.busy[s] += compute
            if cost.tp_backward_s > 0 and cost.layer is not None:
                tid = WindowId.tp(s, cost.layer, a.microbatch)
                tload = self.window_load(tid)
                self.windows.append(Window(tid, s, "tp_allreduce", a.microbatch, t, cost.tp_backward_s,
                                           self.eligible(s, a.chunk, below_block=b), tload))
                # its recomputation may read what the backward prefetched at this block's start
                # for the block below (lynx.solvers.offload.streamed_before): it waits for that
                late = self.tp_window_wait(s, a, tid, t, cost.tp_backward_s)
                self.account(s, t + late, tload, max(0.0, cost.tp_backward_s - late), str(tid))
                if cost.tp_backward_s > tload + late:
                    self.segment(s, "tp", t + late + tload, t + cost.tp_backward_s, str(tid))
                t += max(cost.tp_backward_s, tload + late)
            if a.kind == "B" and a.microbatch == self.last_bwd_mb[a.chunk]:
                self.block_done[(s, b)] = t
        if copies is not None and a.kind in ("B", "I"):
            copies.release(s)
        return t

    def grads_first(self, a: TimedAction, blocks: list[int]) -> bool:
        """Whether the runtime splits ``a``, a ``B``: its input gradients sent before its weight
        part (``PipelineCosts.grads_first``; a B that recomputes on demand or brings values back
        from the host runs whole: the runtime's ``offload_groups`` check)."""
        return (self.pipe.grads_first and a.kind == "B" and a.chunk > 0
                and not any(self.pipe.costs[b].tp_backward_s > 0 for b in blocks)
                and not any(self.loads.on_demand.get((a.chunk, a.microbatch, b), 0.0) > 0 for b in blocks)
                and not (self.copies is not None and self.copies.loads is not None
                         and any(self.copies.loads.offload.get((a.chunk, a.microbatch, b), 0) for b in blocks)))

    def backward_grads_first(self, s: int, a: TimedAction, blocks: list[int], t: float) -> float:
        """A ``B`` split as the runtime runs it: every block's input-gradient part, the input
        gradients sent (``done[("Bi", ...)]``: what the previous chunk's backward waits for), then
        every block's weight part. Other microbatches' copies still pending count, as in a whole B."""
        copies = self.copies
        for b in blocks:
            cost = self.pipe.costs[b]
            if copies is not None:
                held = copies.pending(s, t)
                if held > self.pending[s].get(b, 0):
                    self.pending[s][b] = held
            compute = cost.backward_s - self.weight_s(a.chunk, cost)
            self.segment(s, "backward", t, t + compute, f"{self.tag(a)} {cost.name}")
            t += compute
            self.busy[s] += compute
        self.done[("Bi", a.chunk, a.microbatch)] = t
        t = self.weight_parts(s, a, blocks, t)
        if copies is not None:
            copies.release(s)
        return t
