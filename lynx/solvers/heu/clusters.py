"""HEU's clusters: which recomputed items move together, and the window they fit in.

A recomputed item whose output is not saved must be re-run in the same window as its
recomputed consumers (:func:`clusters_of`); a cluster placed in a window needs its recomputed
inputs placed by then (:func:`with_prereqs`, :func:`first_window`); a window takes it while
its load stays within its capacity and it is eligible for every item (:func:`first_fit`).

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.books import Layout
    >>> lay = Layout(model_from_problem(make_uniform_problem(layers=2, views=True)))
    >>> clusters = clusters_of(lay, [True] * lay.n)
    >>> sorted(i for cl in clusters for i in cl) == list(range(lay.n))
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lynx.solvers.heu.books import Books, Layout

__all__ = ["CAPACITY_SLACK", "clusters_of", "with_prereqs", "first_window", "first_fit"]

# Relative slack on window capacity (float sums of recompute seconds)
CAPACITY_SLACK = 1 + 1e-9


def clusters_of(lay: Layout, rec: list[bool]) -> list[list[int]]:
    """Recomputed items joined by not-saved outputs (they must share a window), forward order."""
    parent = list(range(lay.n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    out_saved = lay.out_saved
    for i in range(lay.n):
        if rec[i]:
            for u in lay.srcs[i]:
                if rec[u] and not out_saved[u]:
                    parent[find(i)] = find(u)
    out: dict[int, list[int]] = {}
    for i in range(lay.n):
        if rec[i]:
            out.setdefault(find(i), []).append(i)
    return sorted(out.values(), key=lambda c: c[0])


def with_prereqs(lay: Layout, books: Books, c: int, cl: list[int], cluster_of: dict[int, list[int]]) -> list[int]:
    """The cluster plus every recomputed, not yet placed ancestor (with their clusters)."""
    where, rec, srcs = books.where[c], books.rec, lay.srcs
    for i in cl:
        for u in srcs[i]:
            if rec[u] and where[u] is None:
                break
        else:
            continue
        break
    else:
        return cl  # inputs all ready: the common case
    unit, stack = set(cl), list(cl)
    while stack:
        j = stack.pop()
        for u in srcs[j]:
            if rec[u] and where[u] is None and u not in unit:
                for v in cluster_of.get(u, [u]):
                    if v not in unit:
                        unit.add(v)
                        stack.append(v)
    return sorted(unit)


def first_window(lay: Layout, books: Books, c: int, cl: list[int], cost: float) -> int | None:
    """Earliest window of class c with room, eligibility and the cluster's inputs ready."""
    where, rec, srcs = books.where[c], books.rec, lay.srcs
    members = set(cl)
    ready = 0  # every recomputed input from outside is placed by window `ready`
    for i in cl:
        for u in srcs[i]:
            if rec[u] and u not in members:
                w = where[u]
                if w is None:
                    return None  # regenerated on demand: after every window
                if w > ready:
                    ready = w
    return first_fit(lay, books, c, cl, cost, ready)


def first_fit(lay: Layout, books: Books, c: int, cl: list[int], cost: float, ready: int) -> int | None:
    """Earliest window of class c from ``ready`` on with room and eligibility for ``cl``."""
    cls = lay.classes[c]
    load = books.load[c]
    for k in range(ready, len(cls.capacities)):
        if load[k] + cost > cls.capacities[k] * CAPACITY_SLACK:
            continue
        elig = cls.eligible[k]
        if elig is None or all(i in elig for i in cl):
            return k
    return None
