"""Zero bubble: what a microbatch holds for its deferred weight-gradient part ``W``.

A zero-bubble chunk's backward is two generated graphs (:mod:`lynx.rewrite.emit`): the
input-gradient part ``I`` regenerates each dropped value it reads (and the dropped inputs of
what it re-runs) just before its first reader; the weight-gradient part ``W`` runs later, from
the microbatch's slots and the values ``I`` regenerated that ``W``'s own backward nodes read —
``I`` hands those over (*cross values*), and the stage holds them, with everything the
microbatch kept, until ``W`` has run (the runtime's meter: ``StageModule.backward_weight``).
``W`` regenerates whatever else it reads. Which part reads which saved value is the node's
``output_reads`` / ``rest_reads`` (:mod:`lynx.frontend.joint_weights`; unknown: both).

* :func:`weight_held_bytes`: from ``I``'s end to ``W``'s, per microbatch: what it held after
  its forward (:func:`~lynx.solvers.memory_microbatch.held_bytes`), what was prefetched for it, and the
  cross values;
* :func:`weight_peak_bytes`: while ``W`` runs: that, plus the largest group (layer) of the
  values ``W`` regenerates itself (each group's are read by that group's weight gradients).

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=2, in_flight=2)
    >>> keep_all = Assignment(recompute=frozenset())
    >>> weight_held_bytes(p, keep_all, frozenset()) == sum(n.saved_bytes for n in p.nodes)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lynx.solvers.memory_microbatch import held_bytes, microbatch_peak_bytes, saved_parts
from lynx.solvers.problem import (Assignment, ProblemNode, StageProblem, consumers_of, group_key, group_ranks,
                                  is_sent)

__all__ = ["weight_held_bytes", "weight_peak_bytes", "input_peak_bytes", "weight_read_bytes", "split_backward_bytes",
           "handed_bytes", "regenerating_parts", "starts_input_regeneration"]

_BOTH = (True, True)
# handed_bytes and regenerating_parts per node tuple (asked by the stage model, the bounds,
# HEU's layouts and terms, each time the planner solves the stage)
_CACHE: dict[tuple[str, int], tuple[tuple, Any]] = {}


def _per_nodes(kind: str, problem: StageProblem, build: Callable[[StageProblem], Any]) -> Any:
    """``build(problem)``, remembered per node tuple (callers must not change the answer)."""
    key = (kind, id(problem.nodes))
    found = _CACHE.get(key)
    if found is None or found[0] is not problem.nodes:
        if len(_CACHE) > 512:
            _CACHE.clear()
        found = _CACHE[key] = (problem.nodes, build(problem))
    return found[1]


def _regenerated(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                 ) -> tuple[set[str], set[str]]:
    """The dropped nodes ``I`` regenerates, and those ``W`` regenerates (each re-run also brings
    back its dropped inputs, unless handed over)."""
    dropped = assignment.recompute
    consumers = consumers_of(problem)
    in_i: set[str] = set()
    in_w: set[str] = set()
    for n in reversed(problem.nodes):   # consumers before producers
        if n.name not in dropped or n.name in prefetched:
            continue
        out, rest = n.output_reads or _BOTH, n.rest_reads or _BOTH
        if out[0] or rest[0] or any(c in in_i for c in consumers[n.name]):
            in_i.add(n.name)
        handed = n.name in in_i and out[1]
        if ((out[1] or rest[1]) and n.name not in in_i) or (not handed and any(c in in_w for c in consumers[n.name])):
            in_w.add(n.name)
    return in_i, in_w


def weight_read_bytes(node: ProblemNode) -> int:
    """Bytes of what ``node`` saves that the weight-gradient part reads (unknown: all)."""
    out_bytes, rest_bytes = saved_parts(node)
    out_read, rest_read = (node.output_reads or _BOTH)[1], (node.rest_reads or _BOTH)[1]
    return (out_bytes if out_read else 0) + (rest_bytes if rest_read else 0)


def handed_bytes(problem: StageProblem) -> dict[str, int]:
    """Per node, what ``I`` may hand ``W`` when the node is dropped, charged to the node whose
    being dropped makes ``I`` regenerate it: a node ``I`` reads (it *starts* a regeneration:
    :func:`starts_input_regeneration`) is charged what ``W`` reads of it, and what ``W`` reads
    of each dropped node ``I`` regenerates only to re-run it — its nearest consumers that start
    one, through consumers that do not (in its chunk). A node ``I`` regenerates is dropped and
    reaches a dropped starter through dropped nodes, so summing over the dropped nodes counts
    every handed value (more where a starter is dropped but the path to it is not); a chunk
    whose ``I`` reads nothing (the first: its ``W`` is the whole backward) hands nothing over.
    Cached per node tuple: callers must not change the answer."""
    return _per_nodes("handed", problem, _handed_bytes)


def _handed_bytes(problem: StageProblem) -> dict[str, int]:
    consumers = consumers_of(problem)
    by_name = {n.name: n for n in problem.nodes}
    starts = {n.name: starts_input_regeneration(n) for n in problem.nodes}
    # per node that starts none: the nearest starters among its consumers (one pass, consumers first)
    nearest: dict[str, frozenset[str]] = {}
    for n in reversed(problem.nodes):
        if not starts[n.name]:
            found: set[str] = set()
            for c in consumers[n.name]:
                if by_name[c].chunk == n.chunk:
                    found |= {c} if starts[c] else nearest[c]
            nearest[n.name] = frozenset(found)
    out = {n.name: 0 for n in problem.nodes}
    for n in problem.nodes:
        wrb = weight_read_bytes(n)
        if wrb:
            for target in ((n.name,) if starts[n.name] else nearest[n.name]):
                out[target] += wrb
    return out


def starts_input_regeneration(n: ProblemNode) -> bool:
    """Whether ``I`` reads a value ``n`` saves (unknown: yes): dropped, ``n`` is regenerated by
    ``I`` with its dropped inputs (and the node has bytes to read)."""
    return n.saved_bytes > 0 and _reads_input(n)


def regenerating_parts(problem: StageProblem) -> dict[str, tuple[bool, bool]]:
    """Per node, whether ``I`` and whether ``W`` may regenerate it when it is dropped on demand,
    whatever else is dropped: a superset of what :func:`split_backward_bytes` finds for any
    assignment. A part regenerates a node it reads, or one whose re-run needs it for a consumer
    the part regenerates (within the node's chunk: each chunk's graphs are their own), but
    ``W`` never a node ``I`` reads whose output ``W`` reads (``I`` regenerated and handed it);
    in a chunk whose ``I`` reads nothing, ``W`` is the whole backward and ``I`` regenerates
    nothing. Cached per node tuple: callers must not change the answer."""
    return _per_nodes("parts", problem, _regenerating_parts)


def _regenerating_parts(problem: StageProblem) -> dict[str, tuple[bool, bool]]:
    reads_i = {n.chunk for n in problem.nodes if _reads_input(n)}
    consumers = consumers_of(problem)
    chunk_of = {n.name: n.chunk for n in problem.nodes}
    out: dict[str, tuple[bool, bool]] = {}
    for n in reversed(problem.nodes):   # consumers before producers
        if n.chunk not in reads_i:
            out[n.name] = (False, True)
            continue
        reads, rest = n.output_reads or _BOTH, n.rest_reads or _BOTH
        mine = [out[c] for c in consumers[n.name] if chunk_of[c] == n.chunk]
        by_consumer = any(c[1] for c in mine)
        if reads[0] or rest[0]:   # I regenerates it whenever it is on demand (hands it, if W reads it)
            out[n.name] = (True, not reads[1] and by_consumer)
        else:
            out[n.name] = (any(c[0] for c in mine), reads[1] or rest[1] or by_consumer)
    return out


def _reads_input(n: ProblemNode) -> bool:
    return (n.output_reads or _BOTH)[0] or (n.rest_reads or _BOTH)[0]


def weight_held_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]) -> int:
    """Bytes one microbatch holds from its ``I``'s end to its ``W``'s (``prefetched``: the nodes
    recomputed in windows for it)."""
    return split_backward_bytes(problem, assignment, prefetched)[1]


def weight_peak_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]) -> int:
    """The most one microbatch holds while its ``W`` runs."""
    return split_backward_bytes(problem, assignment, prefetched)[2]


def input_peak_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]) -> int:
    """The most one microbatch holds while its ``I`` runs."""
    return split_backward_bytes(problem, assignment, prefetched)[0]


def split_backward_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                         ) -> tuple[int, int, int]:
    """(most held during ``I``, held from ``I``'s end to ``W``'s, most held during ``W``).

    Each graph runs its groups (layers, edge blocks) in backward order, regenerating a group's
    values just before it and dropping what the group read last (a value, after its own group;
    what nobody in the graph reads, at once), as the generated code does; the meter counts the
    microbatch's kept values until ``W`` ends and, above them, how far the graph's live values
    rise over its inputs."""
    dropped = assignment.dropped
    if not any(_reads_input(n) for n in problem.nodes):
        # the chunk sends no input gradient (the first): I is empty and W the whole backward
        held = held_bytes(problem, assignment) + sum(n.saved_bytes for n in problem.nodes if n.name in prefetched)
        return held, held, microbatch_peak_bytes(problem, assignment, prefetched)
    ranks = group_ranks(problem)
    in_i, in_w = _regenerated(problem, assignment, prefetched)
    by_group: dict[int, list[ProblemNode]] = {}
    for n in problem.nodes:
        by_group.setdefault(ranks[group_key(n)], []).append(n)
    order = sorted(by_group, reverse=True)

    def inputs(n: ProblemNode) -> tuple[int, int]:   # (output, rest) bytes the microbatch holds of n
        out_bytes, rest_bytes = saved_parts(n)
        if n.name not in dropped or n.name in prefetched:
            return out_bytes, rest_bytes
        return (out_bytes, 0) if is_sent(n) else (0, 0)

    def read(n: ProblemNode, part: int) -> int:   # held bytes of n the part (0: I, 1: W) reads
        out_bytes, rest_bytes = inputs(n)
        out_read, rest_read = (n.output_reads or _BOTH)[part], (n.rest_reads or _BOTH)[part]
        return (out_bytes if out_read else 0) + (rest_bytes if rest_read else 0)

    held = sum(sum(inputs(n)) for n in problem.nodes)
    cross = sum(weight_read_bytes(n) for n in problem.nodes if n.name in in_i)
    live = sum(read(n, 0) for n in problem.nodes)   # the rest is read by W only: dropped by I at once
    peak = held
    for g in order:
        peak = max(peak, live + sum(n.saved_bytes for n in by_group[g] if n.name in in_i))
        live += sum(weight_read_bytes(n) - read(n, 0) if n.name in in_i else -read(n, 0) for n in by_group[g])
    during_i = peak
    initial = live = sum(read(n, 1) for n in problem.nodes) + cross
    peak = initial
    for g in order:
        peak = max(peak, live + sum(n.saved_bytes for n in by_group[g] if n.name in in_w))
        live -= sum(read(n, 1) + (weight_read_bytes(n) if n.name in in_i else 0) for n in by_group[g])
    return during_i, held + cross, held + cross + peak - initial
