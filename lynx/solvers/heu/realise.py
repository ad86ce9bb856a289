"""HEU's realisation of a replicated representative policy on the full stage model.

The representative's recompute decisions hold for every family layer; its prefetches are
placed window by window in time order (:func:`fill`: clusters that must share a window move
together with their not-yet-placed inputs; exact peak bookkeeping), inputs that an
on-demand consumer of another group reads are prefetched or kept
(:func:`prefetch_needed`), then HEU keeps more where memory is left (:func:`keep_more`) and
moves on-demand recompute into windows with room (the most recompute per prefetched byte
first), in both orders (:func:`realise`).

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.books import Layout
    >>> from lynx.solvers.heu.realise import realise
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=0.001)
    >>> lay = Layout(model_from_problem(p))
    >>> anywhere = [[True] * lay.n for _ in lay.classes]
    >>> books = realise(lay, [True] * lay.n, p.activation_budget_bytes, anywhere)
    >>> [b.peak() <= p.activation_budget_bytes for b in books]
    [True, True]
"""

from __future__ import annotations

from lynx.solvers.heu.books import Books, Layout
from lynx.solvers.heu.clusters import CAPACITY_SLACK, clusters_of, with_prereqs
from lynx.solvers.heu.moves import apply_keep, peak_if_kept, repair_order

__all__ = ["realise", "reserves", "fill", "prefetch_needed", "keep_more"]

Wanted = list[list[bool]]  # per class, per item: place the cluster it heads in this pass


def realise(lay: Layout, rec: list[bool], budget: int, designated: Wanted, *,
            reserve: bool = False) -> list[Books | None]:
    """The replicated policy ``rec`` on the full model: designated prefetches, then fill and
    keep more — keeping after filling, and keeping first (None where that order fails).
    ``reserve``: see :func:`fill`."""
    out_saved = lay.out_saved
    changed = True
    while changed:  # inputs that do not keep their output are dropped with their consumer
        changed = False
        for i in range(lay.n):
            if rec[i]:
                for u in lay.srcs[i]:
                    if not rec[u] and not out_saved[u]:
                        rec[u] = changed = True
    books = Books(lay, rec)
    clusters = clusters_of(lay, rec)
    fill(lay, books, clusters, budget, wanted=designated, reserve=reserve)
    if not prefetch_needed(lay, books, clusters, budget):
        return [None, None]
    results: list[Books | None] = []
    for keep_first in (False, True):
        b = books.copy() if not keep_first else books
        if keep_first:
            keep_more(lay, b, clusters_of(lay, b.rec), budget)
        fill(lay, b, clusters_of(lay, b.rec), budget, wanted=None, reserve=reserve)
        if not keep_first:
            keep_more(lay, b, clusters_of(lay, b.rec), budget)
        repair_order(lay, b)
        ok = prefetch_needed(lay, b, clusters_of(lay, b.rec), budget) and b.peak() <= budget
        results.append(b if ok else None)
    return results


def fill(lay: Layout, books: Books, clusters: list[list[int]], budget: int, *, wanted: Wanted | None,
         reserve: bool = False, share: float = 1.0) -> None:
    """Place clusters into windows in time order: inputs first, capacity and budget respected.

    ``wanted[c][i]``: place the cluster whose first item is i in class c in this pass (None:
    every cluster). ``reserve``: a window open to every item that only windows serving some
    layers follow (tensor-parallel collectives inside the backward serve the layers below)
    takes first the clusters no later window can take — the top layer's — then the rest by
    value (without it, by value alone: the better order when memory, not room, binds).
    ``share``: fill each window up to that share of its capacity only."""
    cluster_of = {i: cl for cl in clusters for i in cl}
    group, wbytes, in_flight = lay.group, lay.wbytes, lay.in_flight
    # Layers served by the fewest windows first: the last layer of the forward can use only
    # the windows before its backward, the first layer every one of them.
    by_need = sorted(clusters, key=lambda cl: (-group[cl[0]], cl[0]))
    # Windows any layer can use take the most recompute time per prefetched byte first.
    cost_of = {cl[0]: lay.cost(cl) for cl in clusters}
    by_value = sorted(clusters, key=lambda cl: (-cost_of[cl[0]] / max(1, lay.nbytes(cl)), cl[0]))
    orders = {}
    # Upper bounds on the peak's terms while only placing: P only grows, T only shrinks.
    p_max, t_max = max(books.P, default=0), max(books.tmax(), default=0)
    for c, cls in enumerate(lay.classes):
        where, load, want = books.where[c], books.load[c], wanted[c] if wanted is not None else None
        later = _served_later(cls.eligible) if reserve else [None] * len(cls.capacities)
        for k, cap in enumerate(cls.capacities):
            elig = cls.eligible[k]
            limit = cap * share * CAPACITY_SLACK
            # A window open to every item, followed only by windows that serve some layers
            # (tp collectives inside a backward): the clusters no later window can take first.
            key = False if elig is not None else later[k]
            if key not in orders:
                if elig is not None:
                    order = by_need
                elif key is None:
                    order = by_value
                else:
                    order = ([cl for cl in by_value if any(i not in key for i in cl)]
                             + [cl for cl in by_value if all(i in key for i in cl)])
                orders[key] = (order, [cost_of[cl[0]] for cl in order])
            order, costs = orders[key]
            for cl, cost in zip(order, costs):
                first = cl[0]
                if where[first] is not None or load[k] + cost > limit or (want is not None and not want[first]):
                    continue  # (prerequisites only add to the cost)
                if elig is not None and any(i not in elig for i in cl):
                    continue
                unit = with_prereqs(lay, books, c, cl, cluster_of)
                if unit is not cl:
                    if elig is not None and any(i not in elig for i in unit):
                        continue
                    cost = lay.cost(unit)
                    if load[k] + cost > limit:
                        continue
                # Cheap bound first: placing never raises the on-demand term.
                added = sum(wbytes[i] for i in unit)
                bound = in_flight * books.kept + max(p_max, books.P[c] + added) + t_max
                if books.ev is not None:   # (per-event books: no shortcut)
                    bound = budget + 1
                if bound <= budget or books.peak_if_placed(c, unit, k) <= budget:
                    books.place(c, k, unit)
                    p_max = max(p_max, books.P[c])


def reserves(lay: Layout) -> bool:
    """Whether ``reserve=True`` can change a fill: some class has a window open to every item
    followed only by windows that serve some layers."""
    for cls in lay.classes:
        later = _served_later(cls.eligible)
        if any(e is None and later[k] for k, e in enumerate(cls.eligible)):
            return True
    return False


def _served_later(eligible: tuple) -> list[frozenset[int] | None]:
    """Per window position: the items some later window of the class may take (None: every
    item, a later window is open to all)."""
    out: list[frozenset[int] | None] = [None] * len(eligible)
    acc: set[int] = set()
    open_later = False
    for k in reversed(range(len(eligible))):
        out[k] = None if open_later else frozenset(acc)
        if eligible[k] is None:
            open_later = True
        else:
            acc |= eligible[k]
    return out


def prefetch_needed(lay: Layout, books: Books, clusters: list[list[int]], budget: int) -> bool:
    """Inputs read across groups by an on-demand consumer must be prefetched (or kept).

    Place such clusters in any eligible window of the classes that lack them (overflow is
    exposed, as on demand would be), else keep them. False when neither fits the budget.
    """
    rec, inputs = books.rec, lay.inputs
    crossed = {u for i in range(lay.n) if rec[i] for u, cross in inputs[i] if cross and rec[u]}
    if not crossed:
        return True
    for cl in clusters:
        if not crossed.intersection(cl) or not rec[cl[0]]:
            continue
        members = set(cl)
        for c, cls in enumerate(lay.classes):
            where = books.where[c]
            if where[cl[0]] is not None:
                continue
            readers = [lay.group[i] for i in range(lay.n)
                       if rec[i] and where[i] is None and any(u in members and cross for u, cross in inputs[i])]
            if not readers:
                continue
            latest = min((where[j] for j in range(lay.n) if rec[j] and where[j] is not None
                          and any(u in members for u in lay.srcs[j])), default=len(cls.capacities))
            spots = [k for k, e in enumerate(cls.eligible) if k <= latest and (e is None or all(i in e for i in cl))
                     and cls.before_on_demand(k, max(readers))]   # (a TP window: before their regeneration)
            inputs_ok = all(not rec[u] or u in members or where[u] is not None for i in cl for u in lay.srcs[i])
            k = max(spots, key=lambda q: cls.capacities[q] - books.load[c][q]) if spots else None
            if spots and inputs_ok and books.peak_if_placed(c, cl, k) <= budget:
                books.place(c, k, cl)
                continue
            if not all(lay.out_saved[i] for i in cl if i in crossed):
                return False
            apply_keep(lay, books, cl)  # keep it: undo its placements, stop dropping it
            if books.peak() > budget:
                return False
            break
    return True


def keep_more(lay: Layout, books: Books, clusters: list[list[int]], budget: int) -> None:
    """Un-drop on-demand clusters with the best exposed-time saving per byte while memory lasts."""
    rec, out_saved, classes = books.rec, lay.out_saved, range(len(lay.classes))
    cluster_id = {i: k for k, cl in enumerate(clusters) for i in cl}
    consumers_outside: set[int] = set()
    for i in range(lay.n):
        if rec[i]:
            for u in lay.srcs[i]:
                if u in cluster_id and cluster_id.get(i) != cluster_id[u] and not out_saved[u]:
                    consumers_outside.add(u)
    scored = []
    for cl in clusters:
        if any(i in consumers_outside for i in cl):
            continue
        saving = sum(lay.counts[c] * lay.on_demand_cost(cl) for c in classes if books.where[c][cl[0]] is None)
        if saving > 0:
            scored.append((-saving / max(lay.nbytes(cl), 1), cl))
    scored.sort(key=lambda t: (t[0], t[1][0]))
    for _, cl in scored:
        if any(books.where[c][cl[0]] is not None for c in classes):
            continue
        if peak_if_kept(lay, books, cl) <= budget:  # (on demand in every class, as checked above)
            apply_keep(lay, books, cl)
