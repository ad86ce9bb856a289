"""HEU's last local-search move: drop one more kept tensor to prefetch more.

Where a plan still exposes recompute and windows have room, dropping a kept tensor and
prefetching it in every class frees ``(in_flight - 1)`` copies of it; that memory can pay for
prefetching recompute that was on demand (the trade the greedy policies do not make: they
either drop to fit or keep while it fits). :func:`trade` tries the bulkiest, cheapest kept
tensors that every class's windows can take, refills the windows and keeps a trial only when
it exposes less within the budget. The first trial is the plan itself refilled: keeping more
after the fill can leave memory a second fill spends. What HEU hides over the default grid,
point by point: ``benchmarks/results/grid.md``.

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.books import Books, Layout
    >>> from lynx.solvers.heu.trade import trade
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=0.001)
    >>> lay = Layout(model_from_problem(p))
    >>> books = Books(lay, [False] * lay.n)
    >>> trade(lay, books, p.activation_budget_bytes) is books  # nothing exposed: nothing to trade
    True
"""

from __future__ import annotations

from lynx.solvers.heu.books import Books, Layout
from lynx.solvers.heu.clusters import CAPACITY_SLACK, clusters_of, first_window
from lynx.solvers.heu.moves import repair_order
from lynx.solvers.heu.greedy import drop_unit, try_drop, boundary_kept
from lynx.solvers.heu.realise import fill, prefetch_needed

__all__ = ["trade", "CANDIDATES", "SHARE"]

CANDIDATES = 21  # kept tensors tried (bulkiest per window second first)
# A drop, and the refill after it, fill each window to at most this share of its capacity: a
# plan loaded to the brim exposed more in simulation once the planner's fixed point re-derived
# the windows (the hidden share per point: benchmarks/results/grid.md).
SHARE = 0.9


def trade(lay: Layout, books: Books, budget: int, *, reserve: bool = False, drops: bool = True) -> Books:
    """``books`` improved by drop-and-prefetch trades (the same object when none helps).

    The candidates — kept tensors, bulkiest per window second first — are dropped one after
    another wherever every class's windows can hide them (so the exposed time stays put and
    the memory freed grows); after each, a copy refills the windows with what was exposed,
    and the best refill wins."""
    if books.exposed() <= 1e-12 or not _room(lay, books):
        return books
    best, best_exposed = books, books.exposed()
    cur = _refill(lay, books, clusters_of(lay, books.rec), budget, reserve, 1.0) or books
    if cur.exposed() < best_exposed - 1e-12:  # (keeping more after the fill left memory to spend)
        best, best_exposed = cur, cur.exposed()
    if not drops or best_exposed <= 1e-12:
        return best
    # What the refill left on demand, per class: the drops below free memory for these.
    waiting = [{i for i in range(lay.n) if cur.rec[i] and where[i] is None} for where in cur.where]
    droppable = boundary_kept(lay)
    rec = cur.rec
    units = []
    for i in range(lay.n):
        if rec[i] or not droppable[i] or lay.tbytes[i] == 0:
            continue
        unit = drop_unit(lay, rec, droppable, i)
        if unit is not None:
            units.append((-lay.nbytes(unit) / max(lay.cost(unit), 1e-12), i, unit))
    units.sort(key=lambda t: (t[0], -t[1]))  # (ties: the last layers first, to the few windows serving them)
    for _, _, unit in units[:CANDIDATES]:
        if any(cur.rec[i] for i in unit):
            continue  # (dropped with an earlier candidate)
        cost = lay.cost(unit)
        if any(first_window(lay, cur, c, unit, cost) is None for c in range(len(lay.classes))):
            continue  # (checked before copying: no window of some class can take it)
        trial = try_drop(lay, cur, unit, hide=True)
        if any(where[i] is None for where in trial.where for i in unit):
            continue  # not hidden everywhere: it would only add exposure
        if any(load[where[unit[0]]] > cls.capacities[where[unit[0]]] * SHARE
               for cls, where, load in zip(lay.classes, trial.where, trial.load)):
            continue
        clusters = clusters_of(lay, trial.rec)
        if not _placeable(trial, clusters, waiting, budget):
            cur = trial  # (not yet enough memory freed for anything exposed: drop on)
            continue
        test = _refill(lay, trial, clusters, budget, reserve, SHARE)
        if test is None:
            continue
        cur = test  # (even when a consumer it sent back to on demand found no window again)
        e = test.exposed()
        if e < best_exposed - 1e-12:
            best, best_exposed = test, e
            if e <= 1e-12:
                break
    return best


def _refill(lay: Layout, books: Books, clusters: list[list[int]], budget: int, reserve: bool,
            share: float) -> Books | None:
    """A copy of ``books`` with the windows filled again (None when it breaks the budget)."""
    test = books.copy()
    fill(lay, test, clusters, budget, wanted=None, reserve=reserve, share=share)
    repair_order(lay, test)  # (neither changes what is recomputed: the same clusters)
    if test.peak() > budget or not prefetch_needed(lay, test, clusters, budget):
        return None
    return test


def _placeable(books: Books, clusters: list[list[int]], waiting: list[set[int]], budget: int) -> bool:
    """Whether the memory left admits prefetching, in some class, a cluster it had on demand."""
    for cl in clusters:
        for c, where in enumerate(books.where):
            if cl[0] in waiting[c] and where[cl[0]] is None and books.peak_if_placed(c, cl) <= budget:
                return True
    return False


def _room(lay: Layout, books: Books) -> bool:
    """Whether some window of some class has spare capacity."""
    for c, cls in enumerate(lay.classes):
        for load, cap in zip(books.load[c], cls.capacities):
            if load < cap * CAPACITY_SLACK - 1e-12 and cap > 0:
                return True
    return False
