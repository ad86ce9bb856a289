"""HEU's memory events: the device's replay (:mod:`lynx.solvers.memory_replay`) as linear forms.

Where a device runs several chunks, or defers its weight gradients (zero bubble), the replay's
peak is not ``in_flight · kept + P + T``: each (chunk, microbatch) pair holds its own chunk's
kept bytes, a window's prefetches wait in their pair across other pairs' backwards, and a pair
whose ``I`` ran holds what it handed over until its ``W``. The peak is reached at a backward
action (``B``, ``I`` or ``W``: each holds at least what its pair held before it), and at each
such action ``e`` the total is, in the plan's decisions, linear but for the running pair's
on-demand regeneration:

``total_e = Σ_k kept_k · n_e[k] + Σ_{c,k,w} P_{c,k,w} · a_e[c,k,w] + Σ_{c,k} H_{c,k} · h_e[c,k]
+ T_{c_e,k_e}``

with ``kept_k`` a microbatch's kept bytes of chunk k, ``P_{c,k,w}`` the bytes of chunk k
prefetched in window position w of microbatch class c, ``H_{c,k}`` what chunk k's on-demand
items of class c hand from ``I`` to ``W``, and ``T`` the largest on-demand group of the running
pair's chunk that the running part regenerates (the books' per-microbatch term): a whole
backward ``B`` regenerates every on-demand value of a group, an ``I`` those it (or a value it
re-runs) reads, a ``W`` those it reads and was not handed
(:func:`~lynx.solvers.memory_weights.regenerating_parts`), so each event names its part.
The counts — pairs holding kept bytes per chunk, pairs of class c whose window w has run since
their forward (all of them for the running pair: its backward holds all it prefetched), pairs
waiting for their ``W`` — come from walking the action list once, as the replay does;
:func:`replay_events` keeps the events no other dominates.
:class:`lynx.solvers.heu.books.Books` keeps ``total_e`` per event and answers "the peak if …" from them.

Example::

    >>> import dataclasses
    >>> from lynx.planner.schedule import rank_actions
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2)
    >>> p = dataclasses.replace(p, actions=tuple(rank_actions("zbh1", pp=2, microbatches=4)[0]))
    >>> ev = replay_events(p)
    >>> max(sum(e.kept) for e in ev.events)   # at most two microbatches hold their kept bytes
    2
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lynx.planner.schedule import Op
from lynx.solvers.problem import StageProblem, microbatch_classes

__all__ = ["Event", "Events", "replay_events", "WHOLE", "INPUT", "WEIGHT"]

# the part of a backward an event runs: its T term counts what that part regenerates
WHOLE, INPUT, WEIGHT = 0, 1, 2
_PART = {Op.BACKWARD: WHOLE, Op.BACKWARD_INPUT: INPUT, Op.BACKWARD_WEIGHT: WEIGHT}


@dataclass(frozen=True)
class Event:
    """One backward action's counts (see the module docstring)."""

    kept: tuple[int, ...]                          # per chunk index: pairs holding their kept bytes
    placed: tuple[tuple[tuple[int, int, int], int], ...]   # ((class, chunk index, window position), pairs)
    handed: tuple[tuple[tuple[int, int], int], ...]        # ((class, chunk index), pairs)
    own: tuple[int, int, int]                      # the running pair's (class, chunk index) and part: its T term

    def dominated_by(self, other: Event) -> bool:
        if self.own != other.own or any(a > b for a, b in zip(self.kept, other.kept)):
            return False
        theirs, hands = dict(other.placed), dict(other.handed)
        return (all(v <= theirs.get(key, 0) for key, v in self.placed)
                and all(v <= hands.get(key, 0) for key, v in self.handed))


@dataclass(frozen=True)
class Events:
    """A device's non-dominated backward events, and the chunk index of each chunk id."""

    chunks: tuple[int, ...]      # chunk ids in index order
    events: tuple[Event, ...]

    def merged(self, position: list[list[int]]) -> Events:
        """The events on merged window positions (``position[c][w]``: the merged position of
        class c's window w; a merged window counts the most of its windows' pairs)."""
        out = []
        for e in self.events:
            placed: dict[tuple[int, int, int], int] = {}
            for (c, k, w), v in e.placed:
                key = (c, k, position[c][w])
                placed[key] = max(placed.get(key, 0), v)
            out.append(Event(e.kept, tuple(sorted(placed.items())), e.handed, e.own))
        return Events(self.chunks, _undominated(out))

    def partless(self) -> Events:
        """The events with every part counted as a whole backward (for books whose on-demand
        term does not tell the parts apart: fewer events, none counting less)."""
        out = [Event(e.kept, e.placed, e.handed, (e.own[0], e.own[1], WHOLE)) for e in self.events]
        return Events(self.chunks, _undominated(out))


def replay_events(problem: StageProblem) -> Events:
    """Walk ``problem.actions`` as :func:`~lynx.solvers.memory_replay.replay_peak_bytes` does and
    record, at each backward action, which pairs hold what (see the module docstring)."""
    chunks = tuple(sorted({n.chunk for n in problem.nodes}) or [0])
    index = {c: k for k, c in enumerate(chunks)}
    classes = microbatch_classes(problem)
    class_of: dict[int, int] = {}
    position: dict = {}   # window id -> (its microbatch, its position in the microbatch's class)
    for ci, mc in enumerate(classes):
        for j in mc.members:
            class_of[j] = ci
        for w, ids in enumerate(mc.window_ids):
            for j, wid in zip(mc.members, ids):
                position[wid] = (j, w)
    windows = [len(mc.capacities) for mc in classes]
    only = 0 if len(chunks) == 1 else None   # one chunk: whatever the list numbers it
    arrived: dict[tuple[int, int], set[int]] = {}   # pair (chunk index, microbatch) -> window positions run
    forwarded: set[tuple[int, int]] = set()         # forward ran, backward (or I) not yet
    waiting: set[tuple[int, int]] = set()           # I ran, W not yet
    events: list[Event] = []
    for a in problem.actions:
        if a.op is Op.RECOMPUTE:
            at = position.get(a.window)
            if at is not None:
                j, w = at
                for kk in range(len(chunks)):
                    if (kk, j) in forwarded:
                        arrived[(kk, j)].add(w)
            continue
        if a.op not in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            continue
        found = only if only is not None else index.get(a.chunk)
        if found is None or a.microbatch not in class_of:
            continue
        k = found
        pair = (k, a.microbatch)
        if a.op is Op.FORWARD:
            arrived[pair] = set()
            forwarded.add(pair)
            continue
        kept = [0] * len(chunks)
        placed: dict[tuple[int, int, int], int] = {}
        handed: dict[tuple[int, int], int] = {}
        for other in set(arrived) - {pair}:
            ok, oj = other
            oc = class_of[oj]
            kept[ok] += 1
            seen: Iterable[int]
            if other in waiting:   # after its I a pair holds all it prefetched, and what I handed over
                seen = range(windows[oc])
                handed[(oc, ok)] = handed.get((oc, ok), 0) + 1
            else:
                seen = arrived[other]
            for w in seen:
                placed[(oc, ok, w)] = placed.get((oc, ok, w), 0) + 1
        c = class_of[a.microbatch]
        kept[k] += 1
        for w in range(windows[c]):
            placed[(c, k, w)] = placed.get((c, k, w), 0) + 1
        if a.op is Op.BACKWARD_WEIGHT:
            handed[(c, k)] = handed.get((c, k), 0) + 1
        events.append(Event(tuple(kept), tuple(sorted(placed.items())), tuple(sorted(handed.items())),
                            (c, k, _PART[a.op])))
        if a.op is Op.BACKWARD_INPUT:
            forwarded.discard(pair)
            waiting.add(pair)
        else:
            forwarded.discard(pair)
            waiting.discard(pair)
            arrived.pop(pair, None)
    return Events(chunks, _undominated(events))


def _undominated(events: list[Event]) -> tuple[Event, ...]:
    """The distinct events no other one dominates, in first-seen order."""
    unique = list(dict.fromkeys(events))
    return tuple(e for i, e in enumerate(unique)
                 if not any(j != i and e.dominated_by(f) and not (f.dominated_by(e) and j > i)
                            for j, f in enumerate(unique)))
