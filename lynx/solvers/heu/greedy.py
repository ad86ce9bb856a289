"""HEU's two greedy policies for the (small) representative model.

* :func:`reverse_greedy` — *drop until it fits*: from keep-all, drop what frees the most peak
  memory per exposed second, prefetching where that costs no peak.
* :func:`greedy` — *keep while it fits*: from "drop all but layer boundaries"
  (:func:`boundary_kept`), keep or prefetch what saves the most exposed time per byte.

Both return :class:`~lynx.solvers.heu.books.Books` (or None when no plan fits), which
:mod:`lynx.solvers.heu.solve` replicates to every layer of the family.

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.books import Layout
    >>> from lynx.solvers.heu.greedy import greedy
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=0.001)
    >>> books = greedy(Layout(model_from_problem(p)), p.activation_budget_bytes)
    >>> books.peak() <= p.activation_budget_bytes
    True
"""

from __future__ import annotations

from lynx.solvers.heu.books import Books, Layout, on_demand_bytes
from lynx.solvers.heu.clusters import clusters_of, first_fit, first_window, with_prereqs
from lynx.solvers.heu.moves import (apply_keep, drop_items, peak_if_kept, peak_if_placed_all, read_too_early,
                                    repair_order, tmax_after)

__all__ = ["boundary_kept", "greedy", "reverse_greedy"]


def boundary_kept(lay: Layout) -> list[bool]:
    """Drop every item that can be dropped, except outputs read across groups (kept)."""
    tbytes, out_saved = lay.tbytes, lay.out_saved
    rec = [tbytes[i] > 0 or not out_saved[i] for i in range(lay.n)]
    changed = True
    while changed:
        changed = False
        for i in range(lay.n):
            if not rec[i]:
                continue
            for u, cross in lay.inputs[i]:
                if cross and rec[u] and out_saved[u]:
                    rec[u] = False
                    changed = True
                elif (cross and rec[u]) or (not rec[u] and not out_saved[u]):
                    rec[i] = False
                    changed = True
                    break
    return rec


def _ratio(gain: float, added: float) -> tuple[float, float]:
    """Sort key: moves adding no memory first (by gain), then by gain per byte."""
    return (1.0, gain) if added <= 0 else (0.0, gain / added)


def greedy(lay: Layout, budget: int) -> Books | None:
    """Best-ratio greedy from "drop all but layer boundaries": keep a cluster, or prefetch it.

    Each step takes the move with the most exposed time saved per byte of peak added (moves
    that add no memory first). None when even the starting point does not fit.
    """
    books = Books(lay, boundary_kept(lay))
    if books.peak() > budget:
        return None
    while True:
        now = books.peak()
        clusters = clusters_of(lay, books.rec)
        best, best_key = _best_keep(lay, books, budget, now)
        best, best_key = _best_place(lay, books, budget, now, clusters, best, best_key)
        if best is None:
            return books
        kind, moves = best
        if kind == "keep":
            apply_keep(lay, books, moves)
            _drop_unneeded(lay, books)
        else:
            for c, k, unit in moves:
                books.place(c, k, unit)


def _best_keep(lay: Layout, books: Books, budget: int, now: int) -> tuple[tuple | None, tuple[float, float]]:
    """The best "keep this recomputed item (and the consumers that need it)" move."""
    rec, wheres = books.rec, books.where
    counts, odcost, out_saved, classes = lay.counts, lay.odcost, lay.out_saved, range(len(lay.classes))
    wbytes, tbytes, group = lay.wbytes, lay.tbytes, lay.group
    best, best_key = None, (0.0, 0.0)
    kept_base = lay.in_flight * books.kept
    tmax = books.tmax()
    tops = [books.tops(c) for c in classes]
    chunked = books.ev is not None   # (per-event books: no shortcut below)
    for i in range(lay.n):
        if not rec[i]:
            continue
        if out_saved[i] and not chunked:
            unit = [i]
            gain = 0  # Σ_c |c| · (cost if on demand for c), summed as below for a longer unit
            for c in classes:
                gain += counts[c] * (odcost[i] if wheres[c][i] is None else 0)
            if gain <= 0:
                continue
            # peak_if_kept for one item, from the per-class top groups
            g, tb, wb = group[i], tbytes[i], wbytes[i]
            pmax = tall = 0
            for c in classes:
                if wheres[c][i] is not None:
                    p, t = books.P[c] - wb, tmax[c]
                else:
                    top, top_group, second = tops[c]
                    p, t = books.P[c], (top if g != top_group else max(second, books.T[c][g] - tb))
                if p > pmax:
                    pmax = p
                if t > tall:
                    tall = t
            after = kept_base + lay.in_flight * wb + pmax + tall
        else:
            unit = _keep_unit(lay, rec, i) if not out_saved[i] else [i]
            gain = sum(counts[c] * sum(odcost[j] for j in unit if wheres[c][j] is None) for c in classes)
            if gain <= 0:
                continue
            after = peak_if_kept(lay, books, unit)
        if after <= budget:
            key = _ratio(gain, after - now)
            if key > best_key:
                best, best_key = ("keep", unit), key
    return best, best_key


def _best_place(lay: Layout, books: Books, budget: int, now: int, clusters: list[list[int]],
                best: tuple | None, best_key: tuple[float, float]) -> tuple[tuple | None, tuple[float, float]]:
    """The best "prefetch this cluster (with its unplaced inputs) in the earliest window with
    room" move, in one class or in every class at once (P is a maximum over classes)."""
    rec, wheres, srcs = books.rec, books.where, lay.srcs
    counts, classes = lay.counts, range(len(lay.classes))
    cluster_of = {i: cl for cl in clusters for i in cl}
    base = lay.in_flight * books.kept
    P, tmax = books.P, books.tmax()
    p_other, t_other = _max_excluding(P), _max_excluding(tmax)
    memos: list[dict[int, Closure | None]] = [{} for _ in classes]
    linear = books.ev is None   # (per-event books answer the peak themselves: no T maxima here)
    for cl in clusters:
        members = set(cl)
        outside = [u for i in cl for u in srcs[i] if rec[u] and u not in members]
        cl_cost, cl_bytes, cl_drop = lay.cost(cl), lay.nbytes(cl), on_demand_bytes(lay, cl)
        spots = []  # (class, window, unit, cost, P[c] after, class c's on-demand maximum after)
        for c in classes:
            where = wheres[c]
            if where[cl[0]] is not None:
                continue
            ready = 0  # earliest window all recomputed inputs are placed by (None: one is not)
            for u in outside:
                w = where[u]
                if w is None:
                    ready = None
                    break
                if w > ready:
                    ready = w
            if ready is None:  # prefetch the missing inputs with it
                closure = _closure(lay, books, c, cl, cluster_of, memos[c], set())
                if closure is None:  # clusters reading each other: the plain walk
                    unit = with_prereqs(lay, books, c, cl, cluster_of)
                    cost = lay.cost(unit)
                    k = first_window(lay, books, c, unit, cost)
                    nbytes, drop = lay.nbytes(unit), on_demand_bytes(lay, unit)
                else:
                    members_c, ready_c, nbytes, drop = closure
                    unit = sorted(members_c)
                    cost = lay.cost(unit)
                    k = first_fit(lay, books, c, unit, cost, ready_c)
                if k is None or cost <= 0:
                    continue
                p_c, t_c = P[c] + nbytes, (tmax_after(books, c, drop) if linear else 0)
            else:
                unit, cost = cl, cl_cost
                k = first_fit(lay, books, c, cl, cost, ready) if cost > 0 else None
                if k is None:
                    continue
                p_c, t_c = P[c] + cl_bytes, (tmax_after(books, c, cl_drop) if linear else 0)
            spots.append((c, k, unit, cost, p_c, t_c))
            if books.ev is not None:
                after = books.peak_if_placed(c, unit, k)
            else:
                after = base + max(p_c, p_other[c]) + max(t_c, t_other[c])
            if after <= budget:
                key = _ratio(counts[c] * cost, after - now)
                if key > best_key:
                    best, best_key = ("place", [(c, k, unit)]), key
        if len(spots) > 1:
            p_all, t_all = list(P), list(tmax)
            for c, _, _, _, p_c, t_c in spots:
                p_all[c], t_all[c] = p_c, t_c
            if books.ev is not None:
                after = peak_if_placed_all(lay, books, [(c, k, unit) for c, k, unit, _, _, _ in spots])
            else:
                after = base + max(p_all) + max(t_all)
            if after <= budget:
                key = _ratio(sum(counts[c] * cost for c, _, _, cost, _, _ in spots), after - now)
                if key > best_key:
                    best, best_key = ("place", [(c, k, unit) for c, k, unit, _, _, _ in spots]), key
    return best, best_key


Closure = tuple[frozenset[int], int, int, dict[int, int]]  # members, ready window, bytes, bytes per group


def _closure(lay: Layout, books: Books, c: int, cl: list[int], cluster_of: dict[int, list[int]],
             memo: dict[int, Closure | None], visiting: set[int]) -> Closure | None:
    """What :func:`with_prereqs` and :func:`first_window` find for ``cl`` in class c — the
    cluster with every cluster it reaches through recomputed, unplaced inputs, and the window
    its placed inputs are ready by — built from the reached clusters' own (memoised within
    one greedy step). None on a cycle between clusters (the caller walks instead)."""
    key = cl[0]
    if key in memo:
        return memo[key]
    if key in visiting:
        return None
    visiting.add(key)
    where, rec, srcs = books.where[c], books.rec, lay.srcs
    members, ready = set(cl), 0
    for i in cl:
        for u in srcs[i]:
            if not rec[u] or u in members:
                continue
            w = where[u]
            if w is not None:
                if w > ready:
                    ready = w
                continue
            sub = _closure(lay, books, c, cluster_of[u], cluster_of, memo, visiting)
            if sub is None:
                memo[key] = None
                return None
            members |= sub[0]
            if sub[1] > ready:
                ready = sub[1]
    visiting.discard(key)
    frozen = frozenset(members)
    memo[key] = result = (frozen, ready, lay.nbytes(frozen), on_demand_bytes(lay, frozen))
    return result


def _max_excluding(values: list[int]) -> list[int]:
    """Per position, the largest of the other values (0 when there are none)."""
    top = second = 0
    for v in values:
        if v > top:
            top, second = v, top
        elif v > second:
            second = v
    return [second if v == top else top for v in values]


def reverse_greedy(lay: Layout, budget: int, *, hide: bool = False, give_up_at: float = float("inf")) -> Books | None:
    """From keep-all, drop what frees the most memory per exposed second until it fits.

    A dropped unit is prefetched in every class whose windows have room (hidden), else
    recomputed on demand there. Ties on exposed time go to the unit using the least window
    time per byte freed, so windows hold the bulky, cheap tensors. Outputs read across
    groups stay kept.

    ``hide=True`` prefetches every dropped unit wherever a window has room, even when that
    costs peak memory: drop-and-prefetch frees ``(in_flight - 1)`` copies instead of
    ``in_flight``, so it drops more, but hides it (what a tight budget with roomy windows and
    few microbatches in flight wants).

    Exposed time only grows as units are dropped, so the search gives up (None) once it
    exposes more than ``give_up_at`` (with a relative margin for rounding): a caller that
    only wants plans better than that is told so early.
    """
    droppable = boundary_kept(lay)
    books = Books(lay, [False] * lay.n)
    tbytes = lay.tbytes
    while books.peak() > budget:
        now = books.peak()
        exposed_now = books.exposed()
        used_now = sum(sum(ld) for ld in books.load)
        best, best_key = None, None
        for i in range(lay.n):
            if books.rec[i] or not droppable[i] or tbytes[i] == 0:
                continue
            unit = drop_unit(lay, books.rec, droppable, i)
            if unit is None:
                continue
            trial = try_drop(lay, books, unit, hide)
            freed = now - trial.peak()
            if freed <= 0:
                continue
            exposed = trial.exposed() - exposed_now
            used = sum(sum(ld) for ld in trial.load) - used_now
            key = (exposed / freed, used / freed, i)
            if best_key is None or key < best_key:
                best, best_key = trial, key
        if best is None:
            return None
        books = best
        if books.exposed() > give_up_at * (1 + 1e-9) + 1e-15:
            return None
    return books


def drop_unit(lay: Layout, rec: list[bool], droppable: list[bool], i: int) -> list[int] | None:
    """Item i plus the not-saved producers it needs regenerated (None if one cannot be)."""
    unit, stack = {i}, [i]
    out_saved = lay.out_saved
    while stack:
        j = stack.pop()
        for u, cross in lay.inputs[j]:
            if not out_saved[u] and not rec[u] and u not in unit:
                if cross or not droppable[u]:
                    return None
                unit.add(u)
                stack.append(u)
    return sorted(unit)


def try_drop(lay: Layout, books: Books, unit: list[int], hide: bool = False) -> Books:
    """A copy of the books with ``unit`` dropped, prefetched wherever a window has room (and
    that costs no peak, unless ``hide``)."""
    trial = books.copy()
    drop_items(lay, trial, unit)
    cost = lay.cost(unit)
    spots = [(c, k, unit) for c in range(len(lay.classes))
             if (k := first_window(lay, trial, c, unit, cost)) is not None]
    # Prefetch only where it costs no peak memory (memory is what dropping is short of; the
    # fill after replication spends what is left). P and T are maxima over classes, so
    # prefetching in every class at once can pay where one class alone does not.
    if hide or (len(spots) > 1 and peak_if_placed_all(lay, trial, spots) <= trial.peak()):
        for c, k, u in spots:
            trial.place(c, k, u)
    else:
        for c, k, u in spots:
            if trial.peak_if_placed(c, u, k) <= trial.peak():
                trial.place(c, k, u)
    if _needs_repair(lay, trial, unit):  # consumers prefetched before their newly dropped input
        repair_order(lay, trial)
    return trial


def _needs_repair(lay: Layout, books: Books, unit: list[int]) -> bool:
    """Whether :func:`repair_order` has anything to do after ``unit`` was dropped (and
    perhaps placed) in books that were in order before: only the unit and its consumers can
    break a rule."""
    rec, srcs, out_saved = books.rec, lay.srcs, lay.out_saved
    touched = set(unit)
    for i in unit:
        touched.update(lay.consumers[i])
    for c, where in enumerate(books.where):
        for i in touched:
            k = where[i]
            if k is not None:
                for u in srcs[i]:
                    if rec[u] and (where[u] is None or where[u] > k or (not out_saved[u] and where[u] != k)):
                        return True
            elif rec[i]:
                for u in srcs[i]:
                    ku = where[u]
                    if rec[u] and ku is not None and read_too_early(lay, c, ku, u, i):
                        return True
    return False


def _keep_unit(lay: Layout, rec: list[bool], i: int) -> list[int]:
    """Item i and, if its output is not saved, the recomputed consumers that read it."""
    if lay.out_saved[i]:
        return [i]
    unit, stack = {i}, [i]
    while stack:
        j = stack.pop()
        if lay.out_saved[j]:
            continue
        for c in lay.consumers[j]:
            if rec[c] and c not in unit:
                unit.add(c)
                stack.append(c)
    return sorted(unit)


def _drop_unneeded(lay: Layout, books: Books) -> None:
    """Zero-byte helpers no recomputed consumer needs any more are simply kept (free)."""
    for j in reversed(range(lay.n)):
        if books.rec[j] and lay.tbytes[j] == 0 and not any(books.rec[c] for c in lay.consumers[j]):
            apply_keep(lay, books, [j])
