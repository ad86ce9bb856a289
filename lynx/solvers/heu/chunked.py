"""HEU's books per (chunk, microbatch): the replay's events kept as running totals.

On a device the solvers' linear count does not cover (several chunks, or deferred weight
gradients: :func:`lynx.solvers.memory_replay.replayed_beyond_bound`) a
:class:`~lynx.solvers.heu.books.Layout` carries a :class:`Chunked`: the device's backward
events (:mod:`lynx.solvers.heu.events`) and, per item, what each event's total gains when the
item is kept (its chunk's bytes times the pairs holding that chunk's kept bytes), prefetched in
window w of class c (times the pairs of class c whose window w has run), or recomputed on
demand in class c (what its ``I`` hands to ``W``, times the pairs waiting for their ``W``).
:class:`~lynx.solvers.heu.books.Books` then keeps one total per event (``Books.ev``) and its
peak is ``max_e (ev[e] + T_e)``, ``T_e`` the largest on-demand group of the event's class and
chunk that the event's part regenerates: HEU plans against the real budget with the replay's
accounting, not the device-wide ``in_flight · kept + P + T``.

The books' on-demand totals ``T`` are kept per *key*: on such a device a group and a backward
part (``3·group + part``: the whole backward, ``I``, ``W``), each event reading its part's
keys, their values following the replay group by group (:mod:`lynx.solvers.heu.ondemand`):
an ``I`` does not count what only its ``W`` regenerates, and regenerates a group's values
after it freed what the groups before read. An item hands over only where its ``I`` may
regenerate it (:func:`~lynx.solvers.memory_weights.handed_bytes`).

The functions here are the books' chunk-aware operations; :mod:`lynx.solvers.heu.books`
calls them where ``lay.chunked`` is set.

Example::

    >>> import dataclasses
    >>> from lynx.planner.schedule import rank_actions
    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.memory import peak_activation_bytes
    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.books import Books, Layout
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2)
    >>> p = dataclasses.replace(p, actions=tuple(rank_actions("zbh1", pp=2, microbatches=4)[0]))
    >>> model = model_from_problem(p)
    >>> lay = full_layout(Layout(model), p)
    >>> Books(lay, [False] * lay.n).peak() == peak_activation_bytes(p, Assignment(frozenset()))
    True
"""

from __future__ import annotations

from operator import add as _add, sub as _sub
from typing import TYPE_CHECKING

from lynx.solvers.heu.events import INPUT, WEIGHT, WHOLE, Events, replay_events
from lynx.solvers.heu.ondemand import Terms, group_terms, part_of_key, split_terms
from lynx.solvers.memory_weights import regenerating_parts
from lynx.solvers.problem import StageProblem

if TYPE_CHECKING:
    from lynx.solvers.heu.books import Books, Layout

__all__ = ["Chunked", "full_layout", "reduced_layout", "peak", "peak_after", "retop", "add", "place_delta",
           "keep_delta", "drop_delta"]

Parts = tuple[tuple[int, int], ...]   # ((chunk index, bytes), ...)
Slot = tuple[int, int]                # (chunk index, part: events.WHOLE, INPUT or WEIGHT)


class Chunked:
    """The events and the per-item event gains of one layout (see the module docstring)."""

    def __init__(self, events: Events, kept: list[Parts], handed: list[Parts], key_slots: dict[int, set[Slot]],
                 item_parts: list[frozenset[int]]):
        self.source = events
        self.events = events.events
        self.n_events = len(self.events)
        self.own = [e.own for e in self.events]
        self._placed = [dict(e.placed) for e in self.events]
        self._handed = [dict(e.handed) for e in self.events]
        self.kept_parts, self.handed_parts = kept, handed
        self.item_parts = item_parts   # per item: the parts that may regenerate it on demand
        self.key_slots = key_slots
        # per (chunk index, part): the T keys its events take their largest on-demand group from
        self.slot_keys: dict[Slot, list[int]] = {}
        for key, slots in key_slots.items():
            for slot in slots:
                self.slot_keys.setdefault(slot, []).append(key)
        for _c, k, part in self.own:
            self.slot_keys.setdefault((k, part), [])
        self.events_of: dict[tuple[int, Slot], list[int]] = {}   # per (class, (chunk index, part)): its events
        for e, (c, k, part) in enumerate(self.own):
            self.events_of.setdefault((c, (k, part)), []).append(e)
        self.classes = sorted({c for c, _k, _p in self.own})
        self.slots_of_class = {c: sorted({(k, part) for cc, k, part in self.own if cc == c}) for c in self.classes}
        self._net: dict[tuple[int, int, int], list[int]] = {}
        self.units: dict[tuple, list[int]] = {}
        self.keep_gain = [[sum(e.kept[k] * b for k, b in parts) for e in self.events] for parts in kept]
        self._place: dict[tuple[int, int, int], list[int]] = {}
        self._coefs: dict[tuple[int, int, int], list[int]] = {}
        self._hand: dict[tuple[int, int], list[int]] = {}

    def place_gain(self, c: int, w: int, i: int) -> list[int]:
        """Per event: what prefetching item i in class c's window w adds."""
        key = (c, w, i)
        found = self._place.get(key)
        if found is None:
            found = None
            for k, b in self.kept_parts[i]:
                coef = self._coef(c, k, w)
                part = [b * x for x in coef]
                found = part if found is None else [x + y for x, y in zip(found, part)]
            found = self._place[key] = found or [0] * self.n_events
        return found

    def _coef(self, c: int, k: int, w: int) -> list[int]:
        """Per event: the pairs of class c holding chunk k's prefetches of window w."""
        key = (c, k, w)
        found = self._coefs.get(key)
        if found is None:
            found = self._coefs[key] = [pl.get(key, 0) for pl in self._placed]
        return found

    def net_place(self, c: int, w: int, i: int) -> list[int]:
        """Per event: what moving item i from on demand to class c's window w adds (its
        prefetch, less what it no longer hands over)."""
        key = (c, w, i)
        found = self._net.get(key)
        if found is None:
            found = self.place_gain(c, w, i)
            if self.handed_parts[i]:
                found = [p - h for p, h in zip(found, self.hand_gain(c, i))]
            self._net[key] = found
        return found

    def hand_gain(self, c: int, i: int) -> list[int]:
        """Per event: what item i on demand in class c hands over (zero bubble), times its holders."""
        key = (c, i)
        found = self._hand.get(key)
        if found is None:
            parts = self.handed_parts[i]
            found = self._hand[key] = [sum(hd.get((c, k), 0) * b for k, b in parts) for hd in self._handed]
        return found


def full_layout(lay: Layout, problem: StageProblem) -> Layout:
    """``lay`` (of ``problem``'s full stage model) with the device's events attached."""
    events = replay_events(problem)
    index = {c: k for k, c in enumerate(events.chunks)}
    only = 0 if len(events.chunks) == 1 else None
    used = {p for _c, _k, p in (e.own for e in events.events)}
    regenerating = regenerating_parts(problem) if used - {WHOLE} else None
    items = lay.model.items
    kept: list[Parts] = []
    handed: list[Parts] = []
    chunks: list[int] = []
    parts: list[frozenset[int]] = []
    for it in items:
        k = only if only is not None else index[it.chunk]
        chunks.append(k)
        kept.append(((k, it.mult * it.saved_bytes),))
        handed.append(((k, it.mult * it.weight_bytes),) if it.weight_bytes else ())
        mine = {WHOLE}
        if regenerating is not None:
            flags = [regenerating[name] for name in it.nodes]
            mine |= {INPUT} if any(f[0] for f in flags) else set()
            mine |= {WEIGHT} if any(f[1] for f in flags) else set()
        parts.append(frozenset(mine))
    terms = split_terms(problem, [it.nodes for it in items], lay.group, chunks, used)
    return _attach(lay, events, kept, handed, [(k,) for k in chunks], parts, terms)


def reduced_layout(red: Layout, full: Layout, to_red: list[int]) -> Layout:
    """The representative's layout with the full layout's events: a reduced item counts its
    family members' bytes in their chunks (and regenerates in any part a member does: its
    on-demand terms per group, :func:`~lynx.solvers.heu.ondemand.group_terms`), and a merged
    window the most pairs of its windows."""
    ch = full.chunked
    assert ch is not None
    kept: list[dict[int, int]] = [{} for _ in range(red.n)]
    handed: list[dict[int, int]] = [{} for _ in range(red.n)]
    chunks: list[set[int]] = [set() for _ in range(red.n)]
    parts: list[set[int]] = [set() for _ in range(red.n)]
    for i, r in enumerate(to_red):
        for k, b in ch.kept_parts[i]:
            kept[r][k] = kept[r].get(k, 0) + b
            chunks[r].add(k)
        for k, b in ch.handed_parts[i]:
            handed[r][k] = handed[r].get(k, 0) + b
        parts[r] |= ch.item_parts[i]
    # (reduced_classes: the any-layer windows merged first, then the layer-restricted ones)
    position = []
    for cls in full.classes:
        has_any = any(e is None for e in cls.eligible)
        position.append([0 if e is None else int(has_any) for e in cls.eligible])
    # (one on-demand key per group for every part: the events need not tell the parts apart)
    events = ch.source.merged(position).partless()
    return _attach(red, events, [tuple(sorted(d.items())) for d in kept], [tuple(sorted(d.items())) for d in handed],
                   [tuple(sorted(ks)) for ks in chunks], [frozenset(p) for p in parts],
                   group_terms(red.group, red.tbytes))


def _attach(lay: Layout, events: Events, kept: list[Parts], handed: list[Parts], chunks: list[tuple[int, ...]],
            parts: list[frozenset[int]], terms: Terms) -> Layout:
    """``lay`` with the events, the per-item gains and the on-demand terms attached: each T key
    read by its part's events in every chunk an item with that key runs in."""
    tdelta, tbase = terms
    key_slots: dict[int, set[Slot]] = {}
    for i, pairs in enumerate(tdelta):
        for key, _b in pairs:
            key_slots.setdefault(key, set()).update((k, part_of_key(key)) for k in chunks[i])
    return lay.with_chunked(Chunked(events, kept, handed, key_slots, parts), tdelta, tbase)


def _of(books: Books) -> Chunked:
    ch = books.lay.chunked
    assert ch is not None
    return ch


def _ev(books: Books) -> list[int]:
    assert books.ev is not None
    return books.ev


def add(ev: list[int], gain: list[int], sign: int = 1) -> None:
    """``ev += sign · gain`` in place."""
    ev[:] = map(_add if sign > 0 else _sub, ev, gain)


def _chunk_top(books: Books, c: int, slot: Slot, drop: dict[int, int] | None) -> tuple[int, int | None, int]:
    """Class c's largest on-demand group of a chunk that a part regenerates (``slot``; after
    lowering keys by ``drop``), its key, and the largest of the others."""
    tc = books.T[c]
    top, arg, second = 0, None, 0
    for g in _of(books).slot_keys[slot]:
        v = tc.get(g, 0)
        if drop is not None:
            v -= drop.get(g, 0)
        if v > top:
            top, arg, second = v, g, top
        elif v > second:
            second = v
    return top, arg, second


def _lowered(books: Books, c: int, slot: Slot, top: tuple[int, int | None, int], drop: dict[int, int]) -> int | None:
    """Class c's largest on-demand group of ``slot`` after lowering keys by ``drop`` (None: the
    largest stays)."""
    t, arg, second = top
    if arg is None:
        return None
    d = drop.get(arg)
    if not d:
        return None
    if len(drop) == 1 or t - d >= second:   # (drops only lower: the largest, or the next)
        return max(t - d, second)
    return _chunk_top(books, c, slot, drop)[0]


def _class_tops(books: Books, c: int) -> dict[Slot, tuple[int, int | None, int]]:
    """Class c's ``_chunk_top`` per slot (cached on the books until class c's T changes)."""
    tops = books._ctop.get(c)
    if tops is None:
        tops = books._ctop[c] = {slot: _chunk_top(books, c, slot, None) for slot in _of(books).slots_of_class[c]}
    return tops


def _base(books: Books) -> list[int]:
    """Per event: its class's largest on-demand group of its chunk and part (cached on the books
    until T changes: ``books._ctop``, per class and, at -1, this list)."""
    ch = _of(books)
    found = books._ctop.get(-1)
    if found is not None:
        return found
    ts = [0] * ch.n_events
    for c in ch.classes:
        for slot, top in _class_tops(books, c).items():
            t = top[0]
            for e in ch.events_of[(c, slot)]:
                ts[e] = t
    books._ctop[-1] = ts
    return ts


def retop(books: Books, c: int) -> None:
    """Class c's on-demand groups changed: refresh its cached tops (and the per-event list)."""
    cache = books._ctop
    ts = cache.get(-1)
    if ts is None:
        cache.pop(c, None)
        return
    ch = _of(books)
    slots = ch.slots_of_class.get(c)
    if slots is None:
        return
    tops = cache[c] = {slot: _chunk_top(books, c, slot, None) for slot in slots}
    for slot, top in tops.items():
        t = top[0]
        for e in ch.events_of[(c, slot)]:
            ts[e] = t


def peak(books: Books) -> int:
    return max(map(_add, _ev(books), _base(books)), default=0)


def peak_after(books: Books, delta: list[int] | None, drops: dict[int, dict[int, int]] | None) -> int:
    """``max_e (ev[e] + delta[e] + T_e)`` with class c's on-demand keys lowered by ``drops[c]``."""
    ts = _base(books)
    if drops:
        ch = _of(books)
        lowered: dict[tuple[int, Slot], int] = {}
        for c, drop in drops.items():
            if c in ch.slots_of_class:
                for slot, top in _class_tops(books, c).items():
                    t = _lowered(books, c, slot, top, drop)
                    if t is not None:
                        lowered[(c, slot)] = t
        if lowered:
            ts = list(ts)
            for key, t in lowered.items():
                for e in ch.events_of[key]:
                    ts[e] = t
    if delta is None:
        return max(map(_add, _ev(books), ts), default=0)
    return max(map(_add, _ev(books), map(_add, delta, ts)), default=0)


def place_delta(books: Books, c: int, k: int, unit: list[int]) -> list[int]:
    """Per event: what prefetching ``unit`` (on demand now) in class c's window k adds (a list
    the caller must not change: remembered per layout)."""
    ch = _of(books)
    if len(unit) == 1:
        return ch.net_place(c, k, unit[0])
    key = (c, k, tuple(unit))
    found = ch.units.get(key)
    if found is None:
        found = list(ch.net_place(c, k, unit[0]))
        for i in unit[1:]:
            found[:] = map(_add, found, ch.net_place(c, k, i))
        if len(ch.units) > UNITS:
            ch.units.clear()
        ch.units[key] = found
    return found


# (class, window, unit) sums remembered per layout: the greedy asks about the same clusters
UNITS = 20000


def keep_delta(books: Books, unit: list[int]) -> list[int]:
    """Per event: what keeping ``unit`` (recomputed now, placed or not per class) adds."""
    ch = _of(books)
    out = [0] * ch.n_events
    for i in unit:
        add(out, ch.keep_gain[i])
        for c, where in enumerate(books.where):
            w = where[i]
            if w is not None:
                add(out, ch.net_place(c, w, i), -1)
            if ch.handed_parts[i]:
                add(out, ch.hand_gain(c, i), -1)
    return out


def drop_delta(books: Books, unit: list[int]) -> list[int]:
    """Per event: what dropping ``unit`` (kept now) to on demand in every class adds."""
    ch = _of(books)
    out = [0] * ch.n_events
    for i in unit:
        add(out, ch.keep_gain[i], -1)
        if ch.handed_parts[i]:
            for c in range(len(books.where)):
                add(out, ch.hand_gain(c, i))
    return out
