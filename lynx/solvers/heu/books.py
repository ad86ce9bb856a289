"""HEU's exact peak-memory and exposed-time bookkeeping over the items of a stage model.

:class:`Layout` holds a :class:`~lynx.solvers.stage_model.StageModel`'s per-item figures as plain
lists (bytes and seconds already multiplied by the item's ``mult``, inputs, consumers), so the
greedy loops index lists instead of reading dataclass attributes. :class:`Books` is one
partial plan on it: which items are recomputed, where each is placed per microbatch class,
and the running totals the memory model needs —
``peak = in_flight · kept + max_c P_c + max_{c,g} T_{c,g}`` with ``P_c`` the bytes prefetched
for class c and ``T_{c,g}`` the bytes of group g regenerated on demand for class c (the same
accounting as :func:`lynx.solvers.memory.peak_activation_bytes`, in item terms).

On a device the linear count does not cover (several chunks, deferred weight gradients) the
layout carries the device's replay events (``Layout.chunked``) and the books keep one running
total per event instead (``Books.ev``, :mod:`lynx.solvers.heu.chunked`); every helper here
answers from those then.

:mod:`lynx.solvers.heu.moves` answers "what would the peak be if ..." without copying the
books and moves items between kept, prefetched and on demand; :mod:`lynx.solvers.heu.clusters`
says which items move together and which window they fit.

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.books import Books, Layout
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2)
    >>> books = Books(Layout(model_from_problem(p)), [False] * 30)
    >>> books.peak() == 2 * sum(n.saved_bytes for n in p.nodes)
    True
"""

from __future__ import annotations

from collections.abc import Collection

from lynx.solvers.heu import chunked as _ch
from lynx.solvers.stage_model import StageModel

__all__ = ["Layout", "Books", "on_demand_bytes"]


class Layout:
    """A stage model's per-item figures as lists (see module docstring)."""

    def __init__(self, model: StageModel) -> None:
        items = model.items
        self.model = model
        self.n = len(items)
        self.classes = model.classes
        self.counts = [cls.count for cls in model.classes]
        self.in_flight = model.in_flight
        self.wbytes = [it.mult * it.saved_bytes for it in items]  # kept or prefetched: every replica
        self.tbytes = [it.saved_bytes for it in items]  # on-demand transient: one replica at a time
        self.wcost = [it.mult * it.recompute_s for it in items]
        # on demand: what the backward re-runs (zero bubble: in each part that may: ModelItem.on_demand_s)
        self.odcost = [it.mult * (it.recompute_s if it.on_demand_s is None else it.on_demand_s) for it in items]
        self.group = [it.group for it in items]
        self.out_saved = [it.output_saved for it in items]
        self.inputs = [it.inputs for it in items]  # ((producer, crosses groups), ...)
        self.srcs = [tuple(u for u, _ in it.inputs) for it in items]
        self.consumers: list[list[int]] = [[] for _ in items]
        for i, it in enumerate(items):
            for u, _ in it.inputs:
                self.consumers[u].append(i)
        # the device's events where the linear count is not the replay's peak (several chunks,
        # deferred W): lynx.solvers.heu.chunked; None: ``in_flight · kept + P + T``
        self.chunked: _ch.Chunked | None = None
        # the on-demand totals T: per item, (key, bytes) each key gains while it is on demand
        # (its group, its bytes; with the events, per group and backward part:
        # lynx.solvers.heu.ondemand), and per key its value with every item held
        self.tdelta: list[tuple[tuple[int, int], ...]] = [((g, b),) for g, b in zip(self.group, self.tbytes)]
        self.tbase: dict[int, int] = {}
        self.tdrop = [dict(d) for d in self.tdelta]   # (the same, as dicts: one item's drop)

    def for_model(self, model: StageModel) -> Layout:
        """This layout for a model with the same items and other classes, in-flight or budget."""
        other = object.__new__(Layout)
        other.__dict__.update(self.__dict__)
        other.model, other.classes, other.in_flight = model, model.classes, model.in_flight
        other.counts = [cls.count for cls in model.classes]
        other.chunked = None   # (the events depend on the problem's windows: attached again)
        other.tdelta, other.tbase = [((g, b),) for g, b in zip(other.group, other.tbytes)], {}
        other.tdrop = [dict(d) for d in other.tdelta]
        return other

    def with_chunked(self, chunked: _ch.Chunked, tdelta: list[tuple[tuple[int, int], ...]],
                     tbase: dict[int, int]) -> Layout:
        """This layout with the device's events attached (:mod:`lynx.solvers.heu.chunked`) and
        its on-demand terms (:mod:`lynx.solvers.heu.ondemand`)."""
        other = object.__new__(Layout)
        other.__dict__.update(self.__dict__)
        other.chunked, other.tdelta, other.tbase = chunked, tdelta, tbase
        other.tdrop = [dict(d) for d in tdelta]
        return other

    def cost(self, unit: list[int]) -> float:
        """Window seconds of a unit (summed in the unit's order, so results are reproducible)."""
        return sum(map(self.wcost.__getitem__, unit))

    def on_demand_cost(self, unit: list[int]) -> float:
        """Seconds a unit exposes per microbatch on demand (zero bubble: each part's re-runs)."""
        return sum(map(self.odcost.__getitem__, unit))

    def nbytes(self, unit: list[int]) -> int:
        return sum(map(self.wbytes.__getitem__, unit))


class Books:
    """One partial plan on a :class:`Layout` with its exact peak-memory totals."""

    __slots__ = ("lay", "rec", "where", "kept", "P", "T", "load", "_tmax", "_tops", "_stale", "ev", "_ctop")

    def __init__(self, lay: Layout, rec: list[bool], *, _empty: bool = False) -> None:
        self.lay = lay
        self.rec = rec
        self._tmax: list[int] | None = None  # per class: largest on-demand group bytes
        self._tops: list[tuple[int, int | None, int]] | None = None  # per class: see tops()
        self._stale: set[int] = set()  # classes whose cached maxima are out of date
        self.ev: list[int] | None = None  # per replay event: its total but for T (lay.chunked)
        # per class, per chunk: largest on-demand group; at -1 the per-event list (chunked.py)
        self._ctop: dict = {}
        if _empty:
            return
        n, classes = lay.n, lay.classes
        self.where: list[list[int | None]] = [[None] * n for _ in classes]
        wbytes, tdelta = lay.wbytes, lay.tdelta
        self.kept = sum(wbytes[i] for i in range(n) if not rec[i])
        self.P = [0] * len(classes)
        on_demand: dict[int, int] = dict(lay.tbase)
        for i in range(n):
            if rec[i]:
                for key, b in tdelta[i]:
                    on_demand[key] = on_demand.get(key, 0) + b
        self.T = [dict(on_demand) for _ in classes]
        self.load = [[0.0] * len(cls.capacities) for cls in classes]
        ch = lay.chunked
        if ch is not None:
            self.ev = [0] * ch.n_events
            for i in range(n):
                if not rec[i]:
                    _ch.add(self.ev, ch.keep_gain[i])
                elif ch.handed_parts[i]:
                    for c in range(len(classes)):
                        _ch.add(self.ev, ch.hand_gain(c, i))

    def copy(self) -> Books:
        other = Books(self.lay, list(self.rec), _empty=True)
        other.where = [list(w) for w in self.where]
        other.kept = self.kept
        other.P = list(self.P)
        other.T = [dict(t) for t in self.T]
        other.load = [list(ld) for ld in self.load]
        other._stale = set(self._stale)
        if self.ev is not None:
            other.ev = list(self.ev)
            other._ctop = dict(self._ctop)
            if -1 in other._ctop:   # (the per-event list is patched in place: each books its own)
                other._ctop[-1] = list(other._ctop[-1])
        if self._tmax is not None:
            other._tmax, other._tops = list(self._tmax), list(self._tops)
        return other

    def changed(self) -> None:
        """Call after changing T directly (the per-class maxima are cached)."""
        self._tmax = self._tops = None
        self._stale.clear()
        self._ctop = {}

    def tmax(self) -> list[int]:
        """Largest on-demand group bytes per class."""
        if self._tmax is None:
            self._tops = [_tops_of(t) for t in self.T]
            self._tmax = [t[0] for t in self._tops]
            self._stale.clear()
        elif self._stale:
            for c in self._stale:
                self._tops[c] = top = _tops_of(self.T[c])
                self._tmax[c] = top[0]
            self._stale.clear()
        return self._tmax

    def tops(self, c: int) -> tuple[int, int | None, int]:
        """Class c's largest on-demand group bytes, its group, and the largest of the others."""
        if self._tops is None or self._stale:
            self.tmax()
        return self._tops[c]

    def _retop(self, c: int) -> None:
        """Class c's T changed: its cached maxima are refreshed when next read."""
        if self._tmax is not None:
            self._stale.add(c)
        if self.ev is not None:
            _ch.retop(self, c)

    def peak(self) -> int:
        if self.ev is not None:
            return _ch.peak(self)
        return self.lay.in_flight * self.kept + max(self.P, default=0) + max(self.tmax(), default=0)

    def peak_if_placed(self, c: int, cluster: list[int], k: int | None = None) -> int:
        """The peak after prefetching ``cluster`` in class c (window k; not applied). Per
        (chunk, microbatch) books need k: None is the least of the class's windows."""
        lay = self.lay
        if self.ev is not None:
            drop = {c: on_demand_bytes(lay, cluster)}
            if k is None:
                return min(_ch.peak_after(self, _ch.place_delta(self, c, w, cluster), drop)
                           for w in range(len(lay.classes[c].capacities)))
            return _ch.peak_after(self, _ch.place_delta(self, c, k, cluster), drop)
        wbytes = lay.wbytes
        b = 0
        for i in cluster:
            b += wbytes[i]
        P = self.P
        p = P[c] + b
        for k, v in enumerate(P):
            if k != c and v > p:
                p = v
        tmax = self.tmax()
        others = 0
        for k, v in enumerate(tmax):
            if k != c and v > others:
                others = v
        base = lay.in_flight * self.kept + p
        if tmax[c] <= others:  # placing only lowers class c's on-demand groups
            return base + others
        drop = on_demand_bytes(lay, cluster)
        tc = self.T[c]
        t = others
        for g, v in tc.items():
            v -= drop.get(g, 0)
            if v > t:
                t = v
        return base + t

    def exposed(self) -> float:
        """Exposed seconds in item terms: on-demand recompute plus window overflow."""
        total = 0.0
        lay = self.lay
        odcost, rec, n = lay.odcost, self.rec, lay.n
        for c, cls in enumerate(lay.classes):
            where = self.where[c]
            on_demand = sum([odcost[i] for i in range(n) if rec[i] and where[i] is None])
            over = sum(max(0.0, load - cap) for load, cap in zip(self.load[c], cls.capacities))
            total += cls.count * (on_demand + over)
        return total

    def place(self, c: int, k: int, cluster: list[int]) -> None:
        lay = self.lay
        where, tc, load = self.where[c], self.T[c], self.load[c]
        for i in cluster:
            where[i] = k
            self.P[c] += lay.wbytes[i]
            for key, b in lay.tdelta[i]:
                tc[key] -= b
            load[k] += lay.wcost[i]
        if self.ev is not None:
            _ch.add(self.ev, _ch.place_delta(self, c, k, cluster))
        self._retop(c)  # only class c's maxima moved


def on_demand_bytes(lay: Layout, unit: Collection[int]) -> dict[int, int]:
    """What ``unit``'s items add to each T key while on demand (see ``Layout.tdelta``; a dict
    the caller must not change)."""
    if len(unit) == 1:
        return lay.tdrop[next(iter(unit))]
    out: dict[int, int] = {}
    tdelta = lay.tdelta
    for i in unit:
        for key, b in tdelta[i]:
            out[key] = out.get(key, 0) + b
    return out


def _tops_of(tc: dict[int, int]) -> tuple[int, int | None, int]:
    """(largest value, its key, largest of the other values); 0 and None when empty (bytes >= 0)."""
    top, top_group, second = 0, None, 0
    for g, v in tc.items():
        if v > top:
            top, top_group, second = v, g, top
        elif v > second:
            second = v
    return top, top_group, second
