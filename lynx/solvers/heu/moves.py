"""HEU's moves on the books, and the peaks they would give: keep, drop, prefetch, send back.

Queries (the books are not changed): the peak after prefetching units in several classes at
once (:func:`peak_if_placed_all`), after keeping a unit (:func:`peak_if_kept`), a class's
largest on-demand term after lowering some keys (:func:`tmax_after`). Moves: keep a unit
(:func:`apply_keep`), drop kept items to on demand (:func:`drop_items`), send a prefetched
item back to on demand (:func:`unplace`), and undo placements whose inputs are not ready
(:func:`repair_order`). Each answers from the per-event totals where the layout carries the
device's events (:mod:`lynx.solvers.heu.chunked`), else from ``in_flight · kept + P + T``.

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.books import Books, Layout
    >>> lay = Layout(model_from_problem(make_uniform_problem(layers=2, microbatches=4, in_flight=2)))
    >>> books = Books(lay, [True] * lay.n)
    >>> keep_all = peak_if_kept(lay, books, list(range(lay.n)))
    >>> apply_keep(lay, books, list(range(lay.n)))
    >>> books.peak() == keep_all
    True
"""

from __future__ import annotations

from lynx.solvers.heu import chunked as _ch
from lynx.solvers.heu.books import Books, Layout, on_demand_bytes

__all__ = ["tmax_after", "peak_if_placed_all", "peak_if_kept", "apply_keep", "unplace", "repair_order", "drop_items",
           "read_too_early"]


def tmax_after(books: Books, c: int, drop: dict[int, int]) -> int:
    """Class c's largest on-demand group bytes after lowering groups by ``drop``."""
    tc = books.T[c]
    if len(drop) == 1:
        top, top_group, second = books.tops(c)
        for g, d in drop.items():
            if g != top_group:
                return top  # another group holds the maximum
            return max(second, tc[g] - d)
    return max((v - drop.get(g, 0) for g, v in tc.items()), default=0)


def peak_if_placed_all(lay: Layout, books: Books, spots: list[tuple[int, int, list[int]]]) -> int:
    """The peak after prefetching each (class, window, unit) of ``spots`` (not applied)."""
    if books.ev is not None:
        delta = [0] * len(books.ev)
        drops: dict[int, dict[int, int]] = {}
        for c, k, unit in spots:
            _ch.add(delta, _ch.place_delta(books, c, k, unit))
            for g, b in on_demand_bytes(lay, unit).items():
                drops.setdefault(c, {})[g] = drops.get(c, {}).get(g, 0) + b
        return _ch.peak_after(books, delta, drops)
    P = list(books.P)
    tmax = list(books.tmax())
    wbytes = lay.wbytes
    for c, _, unit in spots:
        for i in unit:
            P[c] += wbytes[i]
        tmax[c] = tmax_after(books, c, on_demand_bytes(lay, unit))
    return lay.in_flight * books.kept + max(P, default=0) + max(tmax, default=0)


def peak_if_kept(lay: Layout, books: Books, cl: list[int]) -> int:
    """The peak after keeping ``cl`` (no longer recomputed in any class; not applied)."""
    if books.ev is not None:
        drops = {}
        for c, where in enumerate(books.where):
            on_demand = [i for i in cl if where[i] is None]
            if on_demand:
                drops[c] = on_demand_bytes(lay, on_demand)
        return _ch.peak_after(books, _ch.keep_delta(books, cl), drops)
    wbytes, tdelta = lay.wbytes, lay.tdelta
    nbytes = sum(wbytes[i] for i in cl)
    pmax, tmax_all = 0, 0
    tmax = books.tmax()
    for c, where in enumerate(books.where):
        p = books.P[c]
        drop: dict[int, int] | None = None
        for i in cl:
            if where[i] is not None:
                p -= wbytes[i]
            else:
                if drop is None:
                    drop = {}
                for key, b in tdelta[i]:
                    drop[key] = drop.get(key, 0) + b
        if p > pmax:
            pmax = p
        t = tmax[c] if drop is None else tmax_after(books, c, drop)
        if t > tmax_all:
            tmax_all = t
    return lay.in_flight * (books.kept + nbytes) + pmax + tmax_all


def apply_keep(lay: Layout, books: Books, cl: list[int]) -> None:
    """Keep ``cl``: undo its placements in every class and stop recomputing it."""
    wbytes, tdelta, wcost = lay.wbytes, lay.tdelta, lay.wcost
    if books.ev is not None:
        _ch.add(books.ev, _ch.keep_delta(books, cl))
    for c in range(len(lay.classes)):
        where, tc = books.where[c], books.T[c]
        for i in cl:
            k = where[i]
            if k is not None:
                books.P[c] -= wbytes[i]
                books.load[c][k] -= wcost[i]
                where[i] = None
            else:
                for key, b in tdelta[i]:
                    tc[key] -= b
    books.kept += sum(wbytes[i] for i in cl)
    for i in cl:
        books.rec[i] = False
    books.changed()


def unplace(lay: Layout, books: Books, c: int, i: int) -> None:
    """Send item i of class c back to on demand."""
    k = books.where[c][i]
    assert k is not None, "unplace: the item is not prefetched in this class"
    if books.ev is not None:
        _ch.add(books.ev, _ch.place_delta(books, c, k, [i]), -1)
    books.where[c][i] = None
    books.P[c] -= lay.wbytes[i]
    tc = books.T[c]
    for key, b in lay.tdelta[i]:
        tc[key] = tc.get(key, 0) + b
    books.load[c][k] -= lay.wcost[i]
    books._retop(c)  # only class c's maxima moved


def repair_order(lay: Layout, books: Books) -> None:
    """Send to on demand any placement whose inputs are not ready by then, and any member of
    a must-share-a-window cluster whose partners are not in its window (fixed point)."""
    rec, srcs, out_saved = books.rec, lay.srcs, lay.out_saved
    changed = True
    while changed:
        changed = False
        for c in range(len(lay.classes)):
            where = books.where[c]
            for i in range(lay.n):
                k = where[i]
                if k is None:
                    continue
                for u in srcs[i]:
                    w = where[u]
                    if rec[u] and (w is None or w > k or (not out_saved[u] and w != k)):
                        unplace(lay, books, c, i)
                        changed = True
                        break
            for i in range(lay.n):  # placed, read on demand where it may not be (read_too_early)
                if rec[i] and where[i] is None:
                    for u in srcs[i]:
                        k = where[u]
                        if rec[u] and k is not None and read_too_early(lay, c, k, u, i):
                            unplace(lay, books, c, u)
                            changed = True


def read_too_early(lay: Layout, c: int, k: int, u: int, i: int) -> bool:
    """Whether item ``u``, placed in window ``k`` of class ``c``, may not feed item ``i``'s
    on-demand regeneration: ``u``'s output is not saved (nothing counts it in between), or
    ``k`` is a tensor-parallel window running after ``i``'s group regenerates
    (:meth:`~lynx.solvers.stage_model.ModelClass.before_on_demand`)."""
    return not lay.out_saved[u] or not lay.classes[c].before_on_demand(k, lay.group[i])


def drop_items(lay: Layout, books: Books, unit: list[int]) -> None:
    """Drop the kept items ``unit`` to on demand in every class (not placed anywhere)."""
    if books.ev is not None:
        _ch.add(books.ev, _ch.drop_delta(books, unit))
    for i in unit:
        books.rec[i] = True
        books.kept -= lay.wbytes[i]
        for tc in books.T:
            for key, b in lay.tdelta[i]:
                tc[key] = tc.get(key, 0) + b
    books.changed()
