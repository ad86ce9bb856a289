"""The pipeline timeline: schedule × cost model → timed actions per stage and the idle windows.

:func:`run_timeline` replays each device's action list (:func:`~lynx.planner.schedule.rank_actions`,
the list the runtime executes: ``1f1b``, ``gpipe``, ``interleaved1f1b``, ``zbh1``) with
per-block costs and p2p times — a forward waits for its activation, a backward (or a zero-bubble
input-gradient ``I``) for its gradient, a deferred weight-gradient ``W`` for nothing — optionally
with recomputation placed in windows or on demand, and records every interval a device waits:
``recv_grad`` before a backward (a ``B`` that sends its input gradients before its weight
part — ``PipelineCosts.grads_first``, as the runtime does — hands them over that much earlier),
``recv_act`` before a forward (a device's messages to one peer go one after another, in order,
each ``boundary_s`` long, plus what a token-bucket link's bucket had not refilled:
``PipelineCosts.link_burst_s``) (it serves the next backward whose
forward is done) — each named by the ``R`` action the list puts before the wait —, the
``tp_allreduce`` of each layer's backward (serving layers not yet backpropagated) and the
``dp_collective`` tail after a device's last backward. A ``W`` runs where the list puts it, so
it takes from the idle time after it the seconds it costs: what is left is what recomputation
can fill (``docs/planner.md``). Each device's step ends with its optimizer step
(``PipelineCosts.optimizer_s``), after its last gradient and data-parallel exchange. Every
action of the list the runtime executes — a compute action, a send, a receive posted — also
costs the device ``PipelineCosts.action_s`` of the runtime's own host work (``runtime``
segments): a compute action's right before its graphs, the sends and receives that follow a
compute action as soon as it ends (before the next wait, as the runtime posts them), so the
step is that of the program that runs. Windows are
named by their place in the schedule, not their time, so the same ids exist in every replay
and a plan made on one replay can be scored on another.

What the replay reads off the action lists before it runs (each device's compute actions with
their windows and posts, the microbatches in flight): :mod:`lynx.planner.timed_actions`; its
backward actions (``B``, ``I``, ``W`` and the TP windows between blocks):
:mod:`lynx.planner.replay_backward`; its host copies (prefetches issued and waited for):
:mod:`lynx.planner.replay_copies`; its inputs
and result: :mod:`lynx.planner.timeline_types`.

Example::

    >>> from lynx.planner.timeline import PipelineCosts, run_timeline
    >>> pipe = PipelineCosts.uniform(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0)
    >>> t = run_timeline(pipe)
    >>> t.step_time_s == (8 + 4 - 1) * 3.0
    True
    >>> [t.in_flight[s] for s in range(4)]
    [4, 3, 2, 1]
"""

from __future__ import annotations

from typing import Optional

from lynx.errors import LynxConfigError, LynxPlanError
from lynx.planner.copy_lanes import CopyReplay
from lynx.planner.core_sharing import share_replay
from lynx.planner.link_host import link_host_charges
from lynx.planner.replay_backward import ReplayBackward
from lynx.planner.replay_copies import EPS
from lynx.planner.schedule import rank_actions
from lynx.planner.timed_actions import chunk_of_block, eligible_layers, in_flight, timed_actions, trailing_posts
from lynx.planner.timeline_types import Loads, PipelineCosts, Segment, TimedAction, Timeline, Window
from lynx.planner.windows import WindowId

__all__ = ["PipelineCosts", "Loads", "TimedAction", "Window", "Segment", "Timeline", "run_timeline"]

_EPS = EPS


def run_timeline(pipe: PipelineCosts, loads: Optional[Loads] = None, *, record: bool = True) -> Timeline:
    """Replay one training step; ``loads`` places recomputation (see :class:`Loads`);
    ``record=False`` skips the drawing segments (faster, for planning loops)."""
    replay = _Replay(pipe, loads or Loads(), record)
    replay.run_actions()
    if pipe.link_host_s_per_byte > 0 and pipe.cores is None:   # again, the link's host work charged
        charges = link_host_charges(replay)
        if charges:
            replay = _Replay(pipe, loads or Loads(), record, link_host=charges)
            replay.run_actions()
    device_end = replay.data_parallel_and_optimizer()
    if pipe.cores is not None:   # ranks sharing a CPU's cores: the step re-timed (lynx.planner.core_sharing)
        device_end = share_replay(replay, device_end)
    unknown = sorted(str(w) for w in set(replay.loads.window) - replay.used)
    if unknown:
        raise LynxPlanError(f"plan places recomputation in windows this schedule does not have: {unknown[:5]}")
    replay.windows.sort(key=lambda w: (w.device, w.start, w.id))
    copies = replay.copies
    return Timeline(pipeline=pipe, actions=replay.actions, windows=replay.windows, segments=replay.segments,
                    step_time_s=max(device_end), device_end_s=device_end, busy_s=replay.busy,
                    in_flight=in_flight(replay.actions, pipe.virtual), exposed_recompute_s=replay.exposed,
                    hidden_recompute_s=replay.hidden, exposed_copy_s=replay.exposed_copy,
                    pending_bytes=replay.pending,
                    copy_bytes=[(copies.bytes_out.get(s, 0), copies.bytes_in.get(s, 0)) if copies else (0, 0)
                                for s in range(pipe.pp)])


class _Replay(ReplayBackward):
    """The state of one replay: each device runs its actions in order as soon as their input
    (activation or gradient) has arrived; every wait before an action is a window."""

    def __init__(self, pipe: PipelineCosts, loads: Loads, record: bool,
                 link_host: Optional[dict[tuple[int, str, int, int], float]] = None) -> None:
        self.pipe, self.loads, self.record = pipe, loads, record
        self.link_host = link_host or {}   # per compute action, the link's host seconds (planner/link_host.py)
        self.arrive: dict[tuple[str, int, int], float] = {}   # (kind, chunk, mb) of a sender -> its message's arrival
        self.link_free: dict[tuple[int, int], float] = {}     # (from, to) device -> when its last message is through
        self.messages: list[tuple[int, int, float, float, int]] = []   # (from, to, start, end, boundary)
        lists = rank_actions(pipe.schedule, pipe.pp, pipe.microbatches, pipe.virtual)
        self.actions = [timed_actions(s, acts) for s, acts in enumerate(lists)]
        self.trailing_posts = [trailing_posts(acts) for acts in lists]   # after the last compute action
        self.n_chunks = len(pipe.chunks)
        self.chunk_of = {c.index: c for c in pipe.chunks}
        # the action after which a chunk's weight gradients are final: its last B, or W
        self.last_bwd_mb = {c.index: max(a.microbatch for a in self.actions[c.device]
                                         if a.kind in ("B", "W") and a.chunk == c.index) for c in pipe.chunks}
        self.used: set[WindowId] = set()
        self.done: dict[tuple[str, int, int], float] = {}
        self.free = [0.0] * pipe.pp
        self.busy, self.exposed, self.hidden = [0.0] * pipe.pp, [0.0] * pipe.pp, [0.0] * pipe.pp
        self.copies = CopyReplay(pipe.host, loads.copies) if pipe.host is not None and loads.copies else None
        self.exposed_copy = [0.0] * pipe.pp
        self.pending: list[dict[int, int]] = [{} for _ in range(pipe.pp)]
        self.windows: list[Window] = []
        self.segments: list[Segment] = []
        self.block_done: dict[tuple[int, int], float] = {}   # (device, block) -> time its final gradient exists
        self._eligible: dict[tuple[int, int, Optional[int]], Optional[tuple[int, ...]]] = {}
        # per device: position of each forward, and of the next backward at or after each position
        self.fwd_pos = [{(a.chunk, a.microbatch): i for i, a in enumerate(acts) if a.kind == "F"}
                        for acts in self.actions]
        self.next_bwd: list[list[Optional[int]]] = []
        for acts in self.actions:
            nxt: list[Optional[int]] = [None] * (len(acts) + 1)
            for i in range(len(acts) - 1, -1, -1):
                nxt[i] = i if acts[i].kind in ("B", "I") else nxt[i + 1]
            self.next_bwd.append(nxt)

    def tag(self, a: TimedAction) -> str:
        """How a bar names its action: ``F3``, ``I3``, ``W3``; ``F3c2`` with several chunks per device."""
        return f"{a.kind}{a.microbatch}" + (f"c{a.chunk}" if self.pipe.virtual > 1 else "")

    def window_load(self, wid: WindowId) -> float:
        self.used.add(wid)
        return self.loads.window.get(wid, 0.0)

    def arrival(self, a: TimedAction, done: Optional[dict[tuple[str, int, int], float]] = None) -> Optional[float]:
        """When the action's input is on its device (None: not produced yet), from when the
        actions it waits for ended (``done``: this replay's)."""
        pipe = self.pipe
        done = self.done if done is None else done
        own = done is self.done   # this replay's messages queue on their link (see send)
        if a.kind == "F":
            if a.chunk == 0:
                return 0.0
            if own:
                return self.arrive.get(("F", a.chunk - 1, a.microbatch))
            t = done.get(("F", a.chunk - 1, a.microbatch))
            return None if t is None else t + pipe.boundary_s[a.chunk - 1]
        if a.kind == "W":   # after its own I, earlier on the same device
            return done.get(("I", a.chunk, a.microbatch))
        if a.chunk == self.n_chunks - 1:
            return done.get(("F", a.chunk, a.microbatch))
        if own:
            return self.arrive.get((a.kind, a.chunk + 1, a.microbatch))
        # a B that sent its input gradients before its weight part (see backward)
        t = done.get((a.kind + "i", a.chunk + 1, a.microbatch), done.get((a.kind, a.chunk + 1, a.microbatch)))
        return None if t is None else t + pipe.boundary_s[a.chunk]

    def served_by_recv_act(self, s: int, index: int) -> Optional[tuple[int, int]]:
        """The next backward on device s after action `index` whose forward already ran."""
        b = self.next_bwd[s][index]
        if b is None:
            return None
        key = (self.actions[s][b].chunk, self.actions[s][b].microbatch)
        return key if self.fwd_pos[s].get(key, len(self.actions[s])) < index else None

    def eligible(self, s: int, upto_chunk: int, below_block: Optional[int] = None) -> Optional[tuple[int, ...]]:
        if self.pipe.virtual == 1 and below_block is None:
            return None
        key = (s, upto_chunk, below_block)
        if key not in self._eligible:
            self._eligible[key] = eligible_layers(self.pipe, s, upto_chunk, below_block)
        return self._eligible[key]

    def account(self, s: int, start: float, load: float, capacity: float, label: str) -> None:
        _account(self.segments if self.record else None, self.busy, self.exposed, self.hidden,
                 s, start, load, capacity, label)

    def run_actions(self) -> None:
        pointer = [0] * self.pipe.pp
        remaining = sum(len(a) for a in self.actions)
        while remaining:
            progressed = False
            for s in range(self.pipe.pp):
                while pointer[s] < len(self.actions[s]):
                    a = self.actions[s][pointer[s]]
                    arrival = self.arrival(a)
                    if arrival is None:
                        break
                    self.wait_before(s, pointer[s], a, arrival)
                    end = (self.forward(s, a) if a.kind == "F" else self.weight(s, a) if a.kind == "W"
                           else self.backward(s, a))
                    self.finish(s, a, end)
                    pointer[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise LynxConfigError(f"schedule {self.pipe.schedule!r} deadlocks for pp={self.pipe.pp}, "
                                      f"m={self.pipe.microbatches}")

    def host(self, s: int, a: TimedAction, t: float) -> float:
        """The link's host work charged to compute action ``a`` (:mod:`lynx.planner.link_host`), from ``t``."""
        cost = self.link_host.get((s, a.kind, a.chunk, a.microbatch), 0.0)
        if cost > 0:
            self.segment(s, "runtime", t, t + cost, f"{self.tag(a)} link host")
            self.busy[s] += cost
        return t + cost

    def runtime(self, s: int, start: float, actions: int, label: str) -> float:
        """The runtime's own host work for ``actions`` actions of the list, from ``start``."""
        cost = actions * self.pipe.action_s
        if cost > 0:
            self.segment(s, "runtime", start, start + cost, label)
            self.busy[s] += cost
        return start + cost

    def wait_before(self, s: int, index: int, a: TimedAction, arrival: float) -> None:
        """The sends and receives posted since the last compute action, then the wait for the
        action's input: a window, filled with the recomputation placed in it."""
        a.ready, a.arrival = self.runtime(s, self.free[s], a.posts, f"{a.kind}{a.microbatch} posts"), arrival
        wid = a.window
        copy_s = 0.0
        if self.copies is not None:   # prefetches named here; before a first stage's forward, at its start
            slot = wid if wid is not None or a.kind != "F" else WindowId.recv(s, "recv_act", a.microbatch)
            copy_s = self.prefetch_in_window(s, slot, a.ready) if slot is not None else 0.0
        if copy_s > 0:   # a synchronous link: the copies run on the device, here, like recomputation
            self.busy[s] += copy_s
            self.segment(s, "h2d", a.ready, a.ready + copy_s, f"prefetch {wid}")
            self.free[s] = a.ready = a.ready + copy_s
        if wid is None:   # no receive to wait for: the device starts when it is free
            a.start = max(arrival, a.ready)
            if a.start > a.ready + _EPS:
                self.segment(s, "wait", a.ready, a.start, f"{a.kind}{a.microbatch}")
            return
        kind = wid.kind
        serves = (a.chunk, a.microbatch) if a.kind != "F" else self.served_by_recv_act(s, index)
        load = self.window_load(wid) if serves is not None else 0.0
        capacity = max(0.0, arrival - a.ready)
        a.load = load
        # with shared cores every window is kept: one closed here may open when re-timed
        if serves is not None and (capacity > _EPS or load > 0 or wid in self.loads.window
                                   or self.pipe.cores is not None):
            self.windows.append(Window(wid, s, kind, serves[1], a.ready, capacity, self.eligible(s, serves[0]), load))
        a.start = max(arrival, a.ready + load)
        self.account(s, a.ready, load, capacity, str(wid))
        if a.start > a.ready + load + _EPS:
            self.segment(s, "wait", a.ready + load, a.start, str(wid))

    def forward(self, s: int, a: TimedAction) -> float:
        t = self.host(s, a, self.runtime(s, a.start, 1, f"{a.kind}{a.microbatch} runtime"))
        for b in self.chunk_of[a.chunk].blocks:
            cost = self.pipe.costs[b]
            self.segment(s, "forward", t, t + cost.forward_s, f"{self.tag(a)} {cost.name}")
            t += cost.forward_s
            self.busy[s] += cost.forward_s
            if self.copies is not None:   # its offloaded values go to the host
                start, end, compute = self.copies.offload(s, a.chunk, a.microbatch, b, t)
                if end > start:
                    self.segment(s, "d2h", start, end, f"offload mb{a.microbatch} {cost.name}")
                t += compute
                self.busy[s] += compute
            if cost.tp_forward_s > 0:
                self.segment(s, "tp", t, t + cost.tp_forward_s, f"tp F{a.microbatch}")
                t += cost.tp_forward_s
        return t

    def finish(self, s: int, a: TimedAction, end: float) -> None:
        a.end = self.free[s] = self.done[(a.kind, a.chunk, a.microbatch)] = end
        if a.kind == "F" and a.chunk < self.n_chunks - 1:
            self.send(a, a.chunk, end, f"act {a.microbatch}")
        if a.kind in ("B", "I") and a.chunk > 0:
            sent = self.done.get(("Bi", a.chunk, a.microbatch), end) if a.kind == "B" else end
            self.send(a, a.chunk - 1, sent, f"grad {a.microbatch}")

    def send(self, a: TimedAction, boundary: int, sent: float, label: str) -> None:
        """``a``'s message over ``boundary`` posted at ``sent``: it leaves once the messages the
        device sent the same way before it are through (one connection per pair, in order: a
        link's direction carries one message at a time) and arrives ``boundary_s`` later — on a
        link with a token bucket (``PipelineCosts.link_burst_s``) up to that much later again, when
        it leaves less than that long after the message before it arrived (the bucket not yet
        full again)."""
        src = self.chunk_of[a.chunk].device
        dst = self.chunk_of[boundary + 1 if a.kind == "F" else boundary].device
        seconds = self.pipe.boundary_s[boundary]
        start = max(sent, self.link_free.get((src, dst), 0.0)) if src != dst else sent
        burst = self.pipe.link_burst_s
        if burst > 0 and seconds > 0 and (src, dst) in self.link_free:
            seconds += burst - min(burst, start - self.link_free[(src, dst)])
        end = self.arrive[(a.kind, a.chunk, a.microbatch)] = start + seconds
        if seconds > 0 and src != dst:
            self.link_free[(src, dst)] = end
            self.messages.append((src, dst, start, end, boundary))
            self.segment(src, "send", start, end, label)

    def data_parallel_and_optimizer(self) -> list[float]:
        """Per device: gradient collectives (one bucket per block, in gradient order), then the
        optimizer step once every gradient is exchanged. Returns each device's end of step."""
        pipe = self.pipe
        for s in range(pipe.pp):   # the sends the list posts after the last compute action
            self.free[s] = self.runtime(s, self.free[s], self.trailing_posts[s], "posts")
        device_end = list(self.free)
        for s in range(pipe.pp):
            link = 0.0
            for (dev, b), ready in sorted(self.block_done.items(), key=lambda kv: kv[1]):
                if dev != s or pipe.costs[b].dp_s <= 0:
                    continue
                start = max(ready, link)
                link = start + pipe.costs[b].dp_s
                self.segment(s, "dp", start, link, f"dp {pipe.costs[b].name}")
                idle_from = max(start, self.free[s])
                if link > idle_from + _EPS:
                    self.windows.append(Window(WindowId.dp(s, b), s, "dp_collective",
                                               self.last_bwd_mb[chunk_of_block(pipe, b)],
                                               idle_from, link - idle_from, (), 0.0))
                device_end[s] = max(device_end[s], link)
            step = pipe.optimizer_s[s] if s < len(pipe.optimizer_s) else 0.0
            if step > 0:
                self.segment(s, "optimizer", device_end[s], device_end[s] + step, "optimizer step")
                device_end[s] += step
                self.busy[s] += step
        return device_end


def _account(segments: Optional[list[Segment]], busy: list[float], exposed: list[float], hidden: list[float],
             s: int, start: float, load: float, capacity: float, label: str) -> None:
    """Recomputation ``load`` run from ``start`` in an idle interval of ``capacity`` seconds."""
    if load <= 0:
        return
    if segments is not None:
        segments.append(Segment(s, "recompute", start, start + load, label))
    busy[s] += load
    hidden[s] += min(load, capacity)
    exposed[s] += max(0.0, load - capacity)
