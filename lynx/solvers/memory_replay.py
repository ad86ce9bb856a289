"""Peak saved-activation bytes of a device, replayed over its schedule's action list.

A device runs the actions :func:`lynx.planner.schedule.rank_actions` lists for it, and the
runtime's saved-bytes meter (:class:`lynx.rewrite.saved.SavedBytesMeter`, one per chunk,
summed per rank) follows them. This replays the same list, per (chunk, microbatch):

* ``F``: the pair holds what its chunk keeps after a forward
  (:func:`~lynx.solvers.memory_microbatch.held_bytes` of the chunk's nodes: each chunk holds
  its own nodes' values, never the device's);
* ``R``: a window's recomputation adds, to each pair it serves whose forward ran, the saved
  bytes of the nodes recomputed there for it (the runtime recomputes at that ``R``);
* ``B``: the others' bytes plus the most the pair holds during its backward
  (:func:`~lynx.solvers.memory_microbatch.microbatch_peak_bytes` on the chunk's nodes, with
  what was prefetched for it); after ``B`` it holds nothing;
* zero bubble (:func:`~lynx.solvers.memory_weights.split_backward_bytes`): ``I`` is the others'
  bytes plus the most the pair holds while ``I`` runs; after it the pair holds what it kept and
  the values ``I`` regenerated for ``W``, released by its ``W``, whose own regeneration adds to
  the others' bytes while it runs.

The peak is the largest total at any of these points. With one chunk per device and backwards
in microbatch order this is the closed form of :func:`~lynx.solvers.memory.peak_activation_bytes`
(``others(j) · held + own(j)``); the replay also covers interleaved 1F1B's chunks and ZB-H1's
deferred ``W`` (``tests/solvers/test_memory_replay.py``).

Example::

    >>> from lynx.planner.schedule import rank_actions
    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> import dataclasses
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2)
    >>> p = dataclasses.replace(p, actions=tuple(rank_actions("1f1b", pp=2, microbatches=4)[0]))
    >>> keep_all = Assignment(recompute=frozenset())
    >>> replay_peak_bytes(p, keep_all) == 2 * sum(n.saved_bytes for n in p.nodes)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from lynx.planner.schedule import Op
from lynx.planner.windows import WindowId
from lynx.solvers.memory_microbatch import arrivals_by_microbatch, held_bytes, microbatch_peak_bytes
from lynx.solvers.memory_weights import split_backward_bytes
from lynx.solvers.problem import Assignment, StageProblem

# a zero-bubble backward's (most held during I, held until W, most held during W) per chunk problem
SplitModel = Callable[[StageProblem, Assignment, frozenset], tuple[int, int, int]]

__all__ = ["replay_peak_bytes", "chunk_problems", "replayed_beyond_bound", "bound_counts"]

_CHUNKS: dict[int, tuple[tuple, dict[int, tuple]]] = {}


def chunk_problems(problem: StageProblem) -> dict[int, StageProblem]:
    """The problem of each chunk the device runs: its nodes only (one chunk: ``problem`` itself).
    Each chunk's node tuple is built once per device tuple (solvers' caches key on it)."""
    key = id(problem.nodes)
    found = _CHUNKS.get(key)
    if found is None or found[0] is not problem.nodes:
        chunks = sorted({n.chunk for n in problem.nodes}) or [0]
        by_chunk = {c: tuple(n for n in problem.nodes if n.chunk == c) for c in chunks}
        if len(_CHUNKS) > 256:
            _CHUNKS.clear()
        found = _CHUNKS[key] = (problem.nodes, by_chunk)
    if len(found[1]) == 1:
        return {next(iter(found[1])): problem}
    return {c: dataclasses.replace(problem, nodes=nodes) for c, nodes in found[1].items()}


def replayed_beyond_bound(problem: StageProblem) -> bool:
    """Whether the device's replay holds what the solvers' linear bound does not count
    (``in_flight · kept + P + T``, one microbatch prefetching): several chunks per device, or
    weight gradients deferred (their microbatches keep prefetched and handed-over values)."""
    return any(a.op is Op.BACKWARD_WEIGHT for a in problem.actions) or len({n.chunk for n in problem.nodes}) > 1


def bound_counts(problem: StageProblem) -> tuple[dict[int, int], int, int]:
    """What a linear bound on the replay must count (``({}, 0, 0)`` for one chunk and no ``W``,
    where ``in_flight`` covers it): per chunk, the most of its microbatches in flight at a
    backward (each holds at most the chunk's kept bytes); the most *other* (chunk, microbatch)
    pairs that may hold prefetched values — their microbatch's backward began on a later chunk,
    or they wait for their ``W`` — each at most one microbatch's prefetched bytes; and the most
    pairs holding what their ``I`` handed over (those waiting for their ``W``, and the one whose
    ``I`` or ``W`` runs)."""
    if not replayed_beyond_bound(problem):
        return {}, 0, 0
    chunks = {n.chunk for n in problem.nodes}
    only = next(iter(chunks)) if len(chunks) == 1 else None   # one chunk: whatever the list numbers it
    live: dict[int, set[int]] = {}     # per chunk: microbatches forwarded, backward (W) not yet done
    started: set[int] = set()          # microbatches whose backward began on some chunk
    most_live: dict[int, int] = {}
    held_over = handing = 0
    waiting: set[tuple[int, int]] = set()
    for a in problem.actions:
        c, j = (a.chunk if only is None else only), a.microbatch
        if a.op is Op.FORWARD:
            live.setdefault(c, set()).add(j)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            for cc, js in live.items():
                most_live[cc] = max(most_live.get(cc, 0), len(js))
            held_over = max(held_over, sum(1 for cc, js in live.items() for jj in js
                                           if jj in started and (cc, jj) != (c, j)))
            # the pairs waiting for their W, and the one whose I or W runs: what each was handed
            handing = max(handing, len(waiting - {(c, j)}) + (a.op is not Op.BACKWARD))
            if a.op is Op.BACKWARD_INPUT:
                waiting.add((c, j))
            else:
                live[c].discard(j)
                waiting.discard((c, j))
            started.add(j)
    return most_live, held_over, handing


def replay_peak_bytes(problem: StageProblem, assignment: Assignment, pending: Sequence[int] | None = None,
                      trace: list | None = None, split_model: SplitModel = split_backward_bytes) -> int:
    """The device's peak saved bytes over ``problem.actions`` (see the module docstring);
    ``pending``: per group rank, other microbatches' offload copies (one chunk only); ``trace``:
    appended (action, the most it held during the action) for each compute action; ``split_model``:
    a zero-bubble backward's figures (the runtime's; HEU's books count
    :func:`~lynx.solvers.memory_weights.split_backward_bound_bytes`)."""

    subs = chunk_problems(problem)
    chunk_of = {n.name: n.chunk for n in problem.nodes}
    size = {n.name: n.saved_bytes for n in problem.nodes}
    held = {c: held_bytes(sub, assignment) for c, sub in subs.items()}
    arrivals = {c: arrivals_by_microbatch(sub, assignment) for c, sub in subs.items()}
    placed: dict[WindowId, list[tuple[int, int, int]]] = {}   # window -> (chunk, microbatch, bytes)
    for (name, mb), wid in assignment.window_of.items():
        if name in chunk_of:
            placed.setdefault(wid, []).append((chunk_of[name], mb, size[name]))
    own_cache: dict[tuple[int, frozenset], int] = {}

    def own(c: int, j: int) -> int:
        pf = arrivals[c].get(j, frozenset())
        key = (c, pf)
        if key not in own_cache:
            own_cache[key] = microbatch_peak_bytes(subs[c], assignment, frozenset(n for n, _ in pf), pending, dict(pf))
        return own_cache[key]

    split_cache: dict[tuple[int, frozenset], tuple[int, int, int]] = {}

    def split(c: int, j: int) -> tuple[int, int, int]:   # zero bubble: I's peak, held until W, W's peak
        pf = frozenset(n for n, _ in arrivals[c].get(j, frozenset()))
        if (c, pf) not in split_cache:
            split_cache[(c, pf)] = split_model(subs[c], assignment, pf)
        return split_cache[(c, pf)]

    live: dict[tuple[int, int], int] = {}
    forwarded: set[tuple[int, int]] = set()   # forward ran, backward (or I) not yet
    total = best = 0
    only = next(iter(subs)) if len(subs) == 1 else None   # one chunk: whatever the list numbers it
    for a in problem.actions:
        chunk = a.chunk if only is None or a.chunk < 0 else only
        op, pair = a.op, (chunk, a.microbatch)
        before = best
        best = total
        if op is Op.FORWARD:
            live[pair] = held.get(chunk, 0)
            forwarded.add(pair)
            total += live[pair]
        elif op is Op.RECOMPUTE:
            for c, j, nbytes in placed.get(a.window, ()):
                c = c if only is None else only
                if (c, j) in forwarded:
                    live[(c, j)] += nbytes
                    total += nbytes
        elif op is Op.BACKWARD:
            total -= live.pop(pair, 0)
            forwarded.discard(pair)
            best = max(best, total + own(*pair))
        elif op is Op.BACKWARD_INPUT:
            total -= live.pop(pair, 0)
            forwarded.discard(pair)
            during_i, live[pair], _ = split(*pair)
            best = max(best, total + during_i)
            total += live[pair]
        elif op is Op.BACKWARD_WEIGHT:
            total -= live.pop(pair, 0)
            best = max(best, total + split(*pair)[2])
        best = max(best, total)
        if trace is not None and a.is_compute:
            trace.append((a, best))
        best = max(best, before)
    return max(0, best)
