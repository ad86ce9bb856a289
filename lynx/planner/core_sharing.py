"""Ranks that share a CPU's cores: the replayed step re-timed with the cores shared among the busy ranks.

A CPU spec made for more ranks than cores (:func:`lynx.planner.hardware.share_cores`) prices
each rank's work at a static share of a core, ``cores / ranks``: what a rank gets while every
rank is busy. A pipeline's stages take turns — under 1F1B with ``m`` microbatches on ``p``
stages each stage idles about ``(p − 1) / (m + p − 1)`` of the step — and the kernel gives the
cores to the ranks that can run, so a rank runs faster while other stages' ranks wait.
:func:`share_replay` re-times a replayed timeline (:func:`lynx.planner.timeline.run_timeline`)
as processor sharing: at each instant every rank of a busy device runs at
``min(1, cores / busy ranks)`` of a core (:meth:`CoreSharing.speed`, relative to the static
share the costs were priced at). A device is busy through the work of its list — the runtime's
host work, window recomputation, each action's compute, on-demand recomputation and
tensor-parallel collectives (host work on a CPU, priced at the share as well), the optimizer
step — and idle while it waits for a receive or the data-parallel exchange (the pipeline's and
data-parallel links are not priced at the share either). Each device's work is that of the
static replay; only when it runs changes. A receive window's capacity becomes the work its
device could do before its input arrives, at the speed it would get among the devices busy
meanwhile. Offload copies keep the static replay's timing (a copy wait inside an action counts
as the action's work). No fitted factor: the cores, the ranks and the schedule decide.

Example (4 ranks, pp 2 × tp 2, on 2 cores; a lone busy stage's two ranks get a core each)::

    >>> import dataclasses
    >>> from lynx.planner.timeline import PipelineCosts, run_timeline
    >>> pipe = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0)
    >>> shared = dataclasses.replace(pipe, cores=CoreSharing(ranks=4, cores=2, per_device=2))
    >>> run_timeline(pipe).step_time_s, run_timeline(shared).step_time_s
    (15.0, 12.0)
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from lynx.errors import LynxConfigError
from lynx.planner.timeline_types import Segment, Window
from lynx.planner.windows import WindowId

__all__ = ["CoreSharing", "share_replay", "bar_work"]

_EPS = 1e-12
_BUSY, _WAIT, _DP = 0, 1, 2   # a phase of a device's program
_RECV = ("recv_act", "recv_grad")


@dataclass(frozen=True)
class CoreSharing:
    """``ranks`` processes on ``cores`` cores, ``per_device`` of them (a stage's tp × dp ranks)
    running each timeline device's list in step."""

    ranks: int
    cores: int
    per_device: int

    @staticmethod
    def from_hardware(hardware: Any, *, pp: int, tp: int, dp: int) -> Optional["CoreSharing"]:
        """The sharing a spec made by ``share_cores`` records (None: a core or device per rank,
        or one whose speed no count of busy devices changes, as with a single stage)."""
        share = getattr(hardware, "core_share", None)
        if share is None:
            return None
        sharing = CoreSharing(ranks=share.ranks, cores=share.cores, per_device=tp * dp)
        return sharing if any(abs(sharing.speed(n) - 1.0) > _EPS for n in range(1, pp + 1)) else None

    def speed(self, busy: int) -> float:
        """A busy device's speed while ``busy`` devices are busy, relative to the static share the
        spec priced (``cores / ranks`` of a core): each of its ranks gets ``min(1, cores / busy
        ranks)`` of a core. All ``ranks`` busy: 1."""
        return min(self.ranks / self.cores, self.ranks / (self.per_device * max(1, busy)))


def bar_work(bars: list[tuple[int, str, float, float]], device: int, kinds: tuple[str, ...],
             sharing: Optional[CoreSharing]) -> float:
    """The work (seconds at the spec's static share) in ``device``'s bars of ``kinds`` of a drawn
    timeline (:func:`lynx.viz.timeline_bars`, a plan's ``timeline``): their length, and with
    shared cores each second at the speed the devices busy then (with compute, recomputation,
    runtime work or communication bars: a data-parallel exchange counts too) allow."""
    mine = [(b, e) for d, k, b, e in bars if d == device and k in kinds and e > b]
    if sharing is None:
        return sum(e - b for b, e in mine)
    busy = [(d, b, e) for d, k, b, e in bars if k in ("compute", "recompute", "runtime", "comm") and e > b]
    total = 0.0
    for b, e in mine:
        cuts = sorted({b, e} | {x for _, b2, e2 in busy for x in (b2, e2) if b < x < e})
        for t0, t1 in zip(cuts, cuts[1:]):
            mid = (t0 + t1) / 2
            total += (t1 - t0) * sharing.speed(len({d for d, b2, e2 in busy if b2 <= mid < e2}))
    return total


def share_replay(replay: Any, static_end: list[float]) -> list[float]:
    """Re-time ``replay`` (a finished :class:`lynx.planner.timeline._Replay` whose pipeline has
    ``cores``; ``static_end``: its devices' ends of step) under processor sharing, in place:
    its actions' times, windows, segments and the busy, exposed and hidden seconds. Returns each
    device's end of step."""
    run = _Run(replay, static_end)
    run.simulate()
    return run.finish()


class _Run:
    """One processor-sharing replay. Each device's program is its static replay cut into phases
    (work to do, or a wait); the event loop advances every busy device at the shared speed."""

    def __init__(self, replay: Any, static_end: list[float]) -> None:
        self.r, self.pipe = replay, replay.pipe
        self.sharing: CoreSharing = replay.pipe.cores
        pp = self.pipe.pp
        self.programs = [self._program(s, static_end[s]) for s in range(pp)]
        self.xs: list[list[float]] = [[] for _ in range(pp)]   # per device: static times …
        self.ts: list[list[float]] = [[] for _ in range(pp)]   # … and when they happen here
        self.log: list[tuple[float, float, tuple[int, ...]]] = []   # (from, to, devices busy)
        self.done: dict[tuple[str, int, int], float] = {}
        self.pos, self.rem = [0] * pp, [0.0] * pp
        self.target: list[Optional[float]] = [None] * pp
        self.arrival: dict[tuple[int, int], float] = {}
        # per device and phase: when it began and ended here (action i's phases: 3i, 3i + 1, 3i + 2)
        self.entered: list[list[float]] = [[0.0] * len(p) for p in self.programs]
        self.left: list[list[float]] = [[0.0] * len(p) for p in self.programs]
        self.end = [0.0] * pp
        self.dp_segments: list[Segment] = []
        self.dp_spans: list[tuple[int, int, float, float]] = []   # (device, block, idle from, link done)

    def _program(self, s: int, end: float) -> list[tuple[int, float, float, float, int]]:
        """Device ``s``'s phases (kind, work, static start, static end, action index): per action
        its posts, prefetches and window recomputation, the wait for its input, its body; then the
        trailing posts, the data-parallel exchange and the optimizer step."""
        phases, prev = [], 0.0
        for i, a in enumerate(self.r.actions[s]):
            pre = a.ready + a.load
            phases += [(_BUSY, max(0.0, pre - prev), prev, pre, i), (_WAIT, 0.0, pre, a.start, i),
                       (_BUSY, a.end - a.start, a.start, a.end, i)]
            prev = a.end
        free = self.r.free[s]
        step = self.pipe.optimizer_s[s] if s < len(self.pipe.optimizer_s) else 0.0
        phases += [(_BUSY, max(0.0, free - prev), prev, free, -1), (_DP, 0.0, free, end - step, -1),
                   (_BUSY, step, end - step, end, -1)]
        return phases

    def simulate(self) -> None:
        pp, speed = self.pipe.pp, self.sharing.speed
        active = set(range(pp))
        t = 0.0
        for s in range(pp):
            self._enter(s, t)
        while active:
            moved = True
            while moved:   # leave every phase that is over at t (work done, input arrived)
                moved = False
                for s in sorted(active):
                    kind = self.programs[s][self.pos[s]][0]
                    if (self.rem[s] <= _EPS) if kind == _BUSY else self._waits_until(s, t) is not None:
                        self._leave(s, t)
                        self.pos[s] += 1
                        if self.pos[s] == len(self.programs[s]):
                            active.discard(s)
                            self.end[s] = t
                        else:
                            self._enter(s, t)
                        moved = True
            if not active:
                break
            busy = tuple(s for s in sorted(active) if self.programs[s][self.pos[s]][0] == _BUSY)
            timers = [x for s in active if s not in busy and (x := self.target[s]) is not None]
            if not busy and not timers:
                raise LynxConfigError(f"schedule {self.pipe.schedule!r} deadlocks for pp={pp}, "
                                      f"m={self.pipe.microbatches} (shared cores)")
            v = speed(len(busy)) if busy else 1.0
            dt = min((self.rem[s] / v for s in busy), default=float("inf"))
            dt = min([dt] + [x - t for x in timers])
            t1 = t + dt
            self.log.append((t, t1, busy))
            for s in busy:
                self.rem[s] = max(0.0, self.rem[s] - v * dt)
                _, work, x0, _, _ = self.programs[s][self.pos[s]]
                self._mark(s, x0 + work - self.rem[s], t1)
            t = t1

    def _waits_until(self, s: int, t: float) -> Optional[float]:
        """When device ``s``'s wait ends, if by ``t`` (None: later, or its input is not yet sent)."""
        kind, _, _, _, i = self.programs[s][self.pos[s]]
        if kind == _WAIT and self.target[s] is None:
            arrival = self.r.arrival(self.r.actions[s][i], self.done)
            if arrival is not None:
                self.target[s] = self.arrival[(s, i)] = arrival
        target = self.target[s]
        return target if target is not None and target <= t + _EPS else None

    def _enter(self, s: int, t: float) -> None:
        kind, work, x0, _, i = self.programs[s][self.pos[s]]
        self._mark(s, x0, t)
        self.rem[s], self.target[s] = work, None
        self.entered[s][self.pos[s]] = t
        if kind == _DP:
            self.target[s] = self._data_parallel(s, t)

    def _leave(self, s: int, t: float) -> None:
        kind, _, _, x1, i = self.programs[s][self.pos[s]]
        self._mark(s, x1, t)
        self.left[s][self.pos[s]] = t
        if i >= 0 and self.pos[s] % 3 == 2:   # an action's body
            a = self.r.actions[s][i]
            self.done[(a.kind, a.chunk, a.microbatch)] = t

    def _mark(self, s: int, x: float, t: float) -> None:
        self.xs[s].append(x)
        self.ts[s].append(t)

    def at(self, s: int, x: float, late: bool) -> float:
        """When static time ``x`` of device ``s`` happens here; where a static instant is an
        interval here (a wait the static replay did not have), its last moment (``late``) or first."""
        xs, ts = self.xs[s], self.ts[s]
        if late:
            i = bisect.bisect_right(xs, x) - 1
            if i < 0:
                return ts[0]
            if xs[i] == x or i == len(xs) - 1:
                return ts[i] + (x - xs[i])
            j = i + 1
        else:
            j = bisect.bisect_left(xs, x)
            if j == len(xs):
                return ts[-1] + (x - xs[-1])
            if xs[j] == x or j == 0:
                return ts[j]
            i = j - 1
        return ts[i] + (x - xs[i]) * (ts[j] - ts[i]) / (xs[j] - xs[i])

    def _data_parallel(self, s: int, free: float) -> float:
        """Device ``s``'s gradient buckets on the dp link (as the static replay orders them), from
        when each block's gradient is final here; returns when the exchange is done."""
        link, end = 0.0, free
        for (dev, b), ready in sorted(self.r.block_done.items(), key=lambda kv: kv[1]):
            cost = self.pipe.costs[b]
            if dev != s or cost.dp_s <= 0:
                continue
            start = max(self.at(s, ready, late=False), link)
            link = start + cost.dp_s
            self.dp_segments.append(Segment(s, "dp", start, link, f"dp {cost.name}"))
            idle_from = max(start, free)
            if link > idle_from + _EPS:
                self.dp_spans.append((s, b, idle_from, link))
            end = max(end, link)
        return end

    def capacity(self, s: int, start: float, end: float) -> float:
        """The work device ``s`` could do from ``start`` to ``end`` if busy throughout, at the speed
        it would share with the devices busy meanwhile."""
        if end <= start:
            return 0.0
        speed, total = self.sharing.speed, 0.0
        i = max(0, bisect.bisect_right(self.log, (start, float("inf"), ())) - 1)
        for t0, t1, busy in self.log[i:]:
            if t0 >= end:
                break
            overlap = min(t1, end) - max(t0, start)
            if overlap > 0:
                total += overlap * speed(len(busy) + (s not in busy))
        last = self.log[-1][1] if self.log else 0.0
        return total + max(0.0, end - max(start, last)) * speed(1)

    def finish(self) -> list[float]:
        r = self.r
        ready = {(s, i): self.at(s, a.ready, late=False)
                 for s, acts in enumerate(r.actions) for i, a in enumerate(acts)}
        self._windows(ready)
        if r.record:
            self._segments()
        for s, acts in enumerate(r.actions):
            wall = sum(t1 - t0 for t0, t1, busy in self.log if s in busy)
            work = sum(p[1] for p in self.programs[s] if p[0] == _BUSY)
            if work > 0:
                r.busy[s] *= wall / work   # the device's compute in wall seconds, at its speed then
            for i, a in enumerate(acts):
                a.ready, a.arrival = ready[(s, i)], self.arrival.get((s, i), 0.0)
                a.start, a.end = self.left[s][3 * i + 1], self.left[s][3 * i + 2]
        return self.end

    def _windows(self, ready: dict[tuple[int, int], float]) -> None:
        """Windows at their times here: a receive window's capacity the work its device could do
        before the input arrives; the recomputation placed in it hidden up to that."""
        r = self.r
        action_of = {(s, a.window): i for s, acts in enumerate(r.actions) for i, a in enumerate(acts)
                     if a.window is not None}
        windows = []
        for w in r.windows:
            s = w.device
            if w.kind in _RECV:
                i = action_of[(s, w.id)]
                start = ready[(s, i)]
                capacity = self.capacity(s, start, self.arrival.get((s, i), start))
                if w.load_s > 0:
                    r.hidden[s] += min(w.load_s, capacity) - min(w.load_s, w.capacity_s)
                    r.exposed[s] += max(0.0, w.load_s - capacity) - max(0.0, w.load_s - w.capacity_s)
                if capacity > _EPS or w.load_s > 0 or w.id in r.loads.window:
                    windows.append(dataclasses.replace(w, start=start, capacity_s=capacity))
            elif w.kind == "tp_allreduce":   # host work inside the backward: its capacity is work already
                windows.append(dataclasses.replace(w, start=self.at(s, w.start, late=True)))
        chunk_of = {b: c.index for c in self.pipe.chunks for b in c.blocks}
        for s, b, idle_from, link in self.dp_spans:
            windows.append(Window(WindowId.dp(s, b), s, "dp_collective", r.last_bwd_mb[chunk_of[b]], idle_from,
                                  self.capacity(s, idle_from, link), (), 0.0))
        r.windows = windows

    def _segments(self) -> None:
        """The drawing at the times here: busy segments mapped through each device's progress, the
        waits for inputs and the data-parallel exchange as they fall here."""
        r = self.r
        waits = {(s, a.ready + a.load) for s, acts in enumerate(r.actions) for a in acts}
        segments = []
        for g in r.segments:
            if g.kind == "dp" or (g.kind == "wait" and (g.device, g.start) in waits):
                continue
            if g.kind == "send":   # the pp link's time, from the action's end
                start = self.at(g.device, g.start, late=False)
                segments.append(dataclasses.replace(g, start=start, end=start + g.end - g.start))
            else:
                start = self.at(g.device, g.start, late=True)
                segments.append(dataclasses.replace(g, start=start, end=max(start, self.at(g.device, g.end, False))))
        for s, acts in enumerate(r.actions):
            for i, a in enumerate(acts):
                begin, start = self.entered[s][3 * i + 1], self.left[s][3 * i + 1]
                if start > begin + _EPS:
                    segments.append(Segment(s, "wait", begin, start, str(a.window) if a.window else
                                            f"{a.kind}{a.microbatch}"))
        r.segments = segments + self.dp_segments
