"""The host copies of the timeline's replay (offload): prefetches issued, and waited for.

:class:`ReplayCopies` is the base of the replay in :mod:`lynx.planner.timeline`: the drawing
segments it records, the prefetches a plan names in a window (issued when the window opens),
those a backward streams as its blocks start, and the wait until what a block reads is back on
the device (exposed copy time) — or what a tensor-parallel window's recomputation reads (only
a window that reads a streamed value waits, as the runtime waits before its first reader). The
lanes' bookkeeping itself: :class:`~lynx.planner.copy_lanes.CopyReplay`.
"""

from __future__ import annotations

from typing import Optional

from lynx.planner.copy_lanes import CopyReplay
from lynx.planner.timeline_types import Segment, TimedAction
from lynx.planner.windows import WindowId

__all__ = ["EPS", "ReplayCopies"]

EPS = 1e-12   # seconds: the replay's tolerance (closer times are the same instant)


class ReplayCopies:
    """The replay's drawing segments and host copies (its subclass sets these attributes)."""

    record: bool                   # False: no drawing segments (planning loops)
    segments: list[Segment]
    copies: Optional[CopyReplay]   # the copy lanes; None without a host link or offloaded values
    busy: list[float]              # per device: seconds busy
    exposed_copy: list[float]      # per device: seconds waiting for a prefetch

    def segment(self, s: int, kind: str, start: float, end: float, label: str) -> None:
        if self.record:
            self.segments.append(Segment(s, kind, start, end, label))


    def prefetch_in_window(self, s: int, wid: WindowId, t: float) -> float:
        """Issue the prefetches the plan names in window ``wid`` at ``t`` (compute seconds on a
        synchronous link)."""
        assert self.copies is not None and self.copies.loads is not None
        spent = 0.0
        for chunk, mb, nbytes in self.copies.loads.window.get(wid, ()):
            start, end, compute = self.copies.issue(s, chunk, mb, nbytes, t + spent, None)
            spent += compute
            if not compute:
                self.segment(s, "h2d", start, end, f"prefetch mb{mb}")
        return spent

    def issue_streamed(self, s: int, a: TimedAction, block: Optional[int], t: float) -> float:
        """Issue the prefetches ``a``'s backward issues as block ``block`` starts (None: as the
        backward starts); returns when the device is free again (later only on a synchronous link)."""
        assert self.copies is not None
        for issue, reader, nbytes in self.copies.loads.streamed.get((a.chunk, a.microbatch), ()):
            if issue != block:
                continue
            start, end, compute = self.copies.issue(s, a.chunk, a.microbatch, nbytes, t, reader)
            if compute:
                self.segment(s, "h2d", t, t + compute, f"prefetch mb{a.microbatch}")
                self.busy[s] += compute
                t += compute
            else:
                self.segment(s, "h2d", start, end, f"prefetch mb{a.microbatch}")
        return t

    def copy_wait(self, s: int, a: TimedAction, block: Optional[int], t: float) -> float:
        """Wait until what block ``block`` (None: the backward's start) reads is back on the device."""
        assert self.copies is not None
        arrival = self.copies.arrival(a.chunk, a.microbatch, block)
        if arrival > t + EPS:
            self.segment(s, "wait", t, arrival, f"h2d {a.kind}{a.microbatch}")
            self.exposed_copy[s] += arrival - t
            return arrival
        return t

    def tp_window_wait(self, s: int, a: TimedAction, wid: WindowId, t: float, allreduce: float) -> float:
        """Seconds TP window ``wid``'s recomputation starting at ``t`` waits for the streamed
        prefetches it reads (``CopyLoads.window_reads``: the runtime waits before a value's first
        reader, so a window that reads none waits for none); a wait past the all-reduce is
        exposed copy time."""
        if self.copies is None or a.kind not in ("B", "I"):
            return 0.0
        readers = self.copies.loads.window_reads.get(wid)
        if not readers:
            return 0.0
        late = max(0.0, max(self.copies.arrival(a.chunk, a.microbatch, r) for r in readers) - t)
        if late > allreduce:
            self.exposed_copy[s] += late - allreduce
            self.segment(s, "wait", t + allreduce, t + late, f"h2d {a.kind}{a.microbatch}")
        return late
