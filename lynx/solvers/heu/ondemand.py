"""HEU's on-demand term per backward part: what a running backward adds above what it holds.

The books (:mod:`lynx.solvers.heu.books`) add, to each event's total, the largest of a set of
per-class values ``T[c][key]``. Without events (one chunk, no deferred ``W``) a key is a group
and its value the bytes of the group's items regenerated on demand. With events
(:mod:`lynx.solvers.heu.chunked`) a key is a group and a backward part — ``3·group + part``,
the part one of :data:`~lynx.solvers.heu.events.WHOLE`, ``INPUT``, ``WEIGHT`` — and, for a
zero-bubble chunk whose ``I`` reads something, its value follows
:func:`lynx.solvers.memory_weights.split_backward_bound_bytes` — the replay's
:func:`~lynx.solvers.memory_weights.split_backward_bytes` group by group, never less, as the
whole backward's keys bound :func:`~lynx.solvers.memory_microbatch.microbatch_peak_bytes` — relative
to what the running pair holds (kept and prefetched values, counted by the events already):

* ``I`` at group g: the values ``I`` regenerates there, less what it no longer holds — the
  held values only ``W`` reads (never live in ``I``), and the held values ``I`` read in the
  groups it has run (freed) — plus what the on-demand values of those groups handed over;
* ``W`` at group g: the values ``W`` regenerates there, less the held values, and the values
  handed over for sure (``I`` reads them), ``W`` read in the groups it has run (freed).

The event's term is the largest value, at least 0 (a part never holds less than its inputs
for the books). Every value is a sum over items of one figure when the item is held and
another when it is on demand: :func:`split_terms` returns, per item, the difference
(``tdelta``: what each key gains while the item is on demand; never negative) and, per key,
the sum with every item held (``tbase``). Where a part may regenerate a value but does not
(:func:`~lynx.solvers.memory_weights.regenerating_parts` is a superset) the terms count more
than the replay, never less. Elsewhere — the whole backward ``B``, the ``W`` of a chunk whose
``I`` reads nothing (its whole backward) — a key is read by its part only and holds the plain
per-group sum; the representative model (:mod:`lynx.solvers.heu.layers`), whose items stand
for a value in every layer, keeps one key per group, read as a whole backward
(:func:`group_terms`).

Example::

    >>> group_terms([0, 0, 1], [4, 2, 8])
    ([((0, 4),), ((0, 2),), ((3, 8),)], {})
"""

from __future__ import annotations

from collections.abc import Iterable

from lynx.solvers.heu.events import INPUT, WEIGHT, WHOLE
from lynx.solvers.memory_microbatch import saved_parts
from lynx.solvers.memory_weights import regenerating_parts, starts_input_regeneration, weight_read_bytes
from lynx.solvers.problem import ProblemNode, StageProblem, consumers_of, group_key, group_ranks

__all__ = ["Terms", "group_terms", "split_terms", "part_of_key"]

_BOTH = (True, True)

# per item: ((key, bytes), ...) gained while on demand; per key: its value with every item held
Terms = tuple[list[tuple[tuple[int, int], ...]], dict[int, int]]


def part_of_key(key: int) -> int:
    return key % 3


def group_terms(groups: list[int], tbytes: list[int]) -> Terms:
    """Each item's on-demand bytes under its group's whole-backward key (``3·group``): the
    representative model's count, whose items stand for a value in every layer, and whose
    events count every part as a whole backward (``Events.partless``); every key 0 with
    every item held."""
    return [((3 * g, b),) for g, b in zip(groups, tbytes)], {}


def split_terms(problem: StageProblem, nodes: list[tuple[str, ...]], groups: list[int], chunks: list[int],
                used: Iterable[int]) -> Terms:
    """The full stage model's terms (items: ``nodes``, their ``groups`` and chunk indices), per
    the module docstring: group by group for the ``I`` and ``W`` of chunks whose ``I`` reads
    something, per group elsewhere. A value a part regenerates only to re-run a consumer counts
    on the item whose node starts that regeneration (:func:`_charged`). Cached per node tuple
    (the answer is shared: callers must not change it)."""
    used = set(used)
    key = (id(problem.nodes), tuple(groups), tuple(chunks), frozenset(used))
    found = _TERMS.get(key)
    if found is not None and found[0] is problem.nodes:
        return found[1]
    terms = _split_terms(problem, nodes, groups, chunks, used)
    if len(_TERMS) > 64:
        _TERMS.clear()
    _TERMS[key] = (problem.nodes, terms)
    return terms


# split_terms per node tuple, item grouping and parts (the planner re-solves a stage many times)
_TERMS: dict[tuple, tuple[tuple, Terms]] = {}


def _split_terms(problem: StageProblem, nodes: list[tuple[str, ...]], groups: list[int], chunks: list[int],
                 used: set[int]) -> Terms:
    by_name = {n.name: n for n in problem.nodes}
    regenerating = regenerating_parts(problem)
    splits = {k for k, ns in zip(chunks, nodes) if any(regenerating[x][0] for x in ns)}
    owner = {x: i for i, ns in enumerate(nodes) for x in ns}
    in_chunk: dict[int, list[int]] = {}
    for g, k in zip(groups, chunks):
        if g not in in_chunk.setdefault(k, []):
            in_chunk[k].append(g)
    # per item: bytes each part regenerates when the item is on demand, and what I then hands over
    regen_i, regen_w, cross_i = [0] * len(nodes), [0] * len(nodes), [0] * len(nodes)
    for name, items in _charged(problem, owner, 0, regenerating).items():
        for i in items:
            regen_i[i] += by_name[name].saved_bytes
            cross_i[i] += weight_read_bytes(by_name[name])
    for name, items in _charged(problem, owner, 1, regenerating).items():
        for i in items:
            regen_w[i] += by_name[name].saved_bytes
    delta: list[dict[int, int]] = []
    base: dict[int, int] = {}

    def add(into: dict[int, int], key: int, b: int) -> None:
        if b:
            into[key] = into.get(key, 0) + b

    for i, (ns, g, k) in enumerate(zip(nodes, groups, chunks)):
        mine: dict[int, int] = {}
        members = [by_name[x] for x in ns]
        held = sum(n.saved_bytes for n in members)
        if WHOLE in used:
            add(mine, 3 * g + WHOLE, held)
        if k not in splits:   # I regenerates nothing, W is the whole backward
            if WEIGHT in used:
                add(mine, 3 * g + WEIGHT, held)
            delta.append(mine)
            continue
        read_i = sum(_read(n, 0) for n in members)
        read_w = sum(weight_read_bytes(n) for n in members)
        # what it hands over for sure when on demand (I reads it): W frees it after its group
        surely = sum(weight_read_bytes(n) for n in members if starts_input_regeneration(n))
        w_only = held - read_i
        for h in in_chunk[k]:   # groups run in decreasing rank: h < g runs after g
            if INPUT in used:
                key = 3 * h + INPUT
                add(base, key, -w_only - (read_i if h < g else 0))
                add(mine, key, w_only + (regen_i[i] if h == g else read_i + cross_i[i] if h < g else 0))
            if WEIGHT in used:
                key = 3 * h + WEIGHT
                if h < g:
                    add(base, key, -read_w)
                    add(mine, key, read_w - surely)
                elif h == g:
                    add(mine, key, regen_w[i])
        delta.append(mine)
    return [tuple(sorted(d.items())) for d in delta], base


def _charged(problem: StageProblem, owner: dict[str, int], part: int,
             regenerating: dict[str, tuple[bool, bool]]) -> dict[str, list[int]]:
    """Per node with bytes that the part (0: ``I``, 1: ``W``) may regenerate, the items it is
    charged to: its own where it starts a regeneration (``I``: it reads the value; ``W``: it
    reads it and ``I`` does not), else those of the nearest starters among its consumers
    (through consumers the part may regenerate, in its group: a regeneration runs group by
    group) — or its own where the way leaves its group or passes a node of no item. Dropped on
    demand, a node the part regenerates reaches a dropped starter on such a way."""
    consumers = consumers_of(problem)
    by_name = {n.name: n for n in problem.nodes}
    ranks = group_ranks(problem)

    def may(n: ProblemNode) -> bool:
        return regenerating[n.name][part]

    def starts(n: ProblemNode) -> bool:
        reads, rest = n.output_reads or _BOTH, n.rest_reads or _BOTH
        i_reads = reads[0] or rest[0]
        return i_reads if part == 0 else (reads[1] or rest[1]) and not i_reads

    # per node: the items of the nearest starters among its consumers, through consumers the
    # part may regenerate in its group (None: a way leaves the group or meets a node of no item)
    nearest: dict[str, frozenset[int] | None] = {}
    for n in reversed(problem.nodes):   # consumers first
        group = ranks[group_key(n)]
        found: set[int] = set()
        leaves = False
        for name in consumers[n.name]:
            c = by_name[name]
            if c.chunk != n.chunk or not may(c):
                continue
            theirs = frozenset({owner[name]}) if starts(c) and name in owner else None if starts(c) else nearest[name]
            if ranks[group_key(c)] != group or theirs is None:
                leaves = True
                break
            found |= theirs
        nearest[n.name] = None if leaves else frozenset(found)
    out: dict[str, list[int]] = {}
    for n in problem.nodes:
        if not n.saved_bytes or not may(n) or n.name not in owner:
            continue
        mine = None if starts(n) else nearest[n.name]
        out[n.name] = sorted(mine) if mine else [owner[n.name]]
    return out


def _read(n: ProblemNode, part: int) -> int:
    """Bytes of what ``n`` saves that the part (0: ``I``, 1: ``W``) reads (unknown: all)."""
    out_bytes, rest_bytes = saved_parts(n)
    out_read, rest_read = (n.output_reads or _BOTH)[part], (n.rest_reads or _BOTH)[part]
    return (out_bytes if out_read else 0) + (rest_bytes if rest_read else 0)
