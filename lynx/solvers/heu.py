"""HEU: solve one representative layer, replicate it, fill what is left greedily.

1. Contract the stage as OPT does (:func:`lynx.solvers.opt.model_from_problem`) and find the
   family of structurally identical layers (same items, bytes, costs and internal wiring).
2. Build the reduced model: one item stands for the same node in every family layer
   (``mult`` = family size, so its bytes and window time count once per layer, its on-demand
   transient once), edge blocks and odd layers are items of their own, and each microbatch
   class has its windows merged into two (any-layer windows, layer-restricted windows) —
   each layer's share of the capacity. Solve it with two greedy passes: *drop until it fits*
   (from keep-all, drop what frees the most peak memory per exposed second, prefetching
   where that costs no peak) and *keep while it fits* (from "drop all but layer boundaries",
   keep or prefetch what saves the most exposed time per byte). ``REP_SEARCH`` > 0 adds a
   short deterministic CP-SAT search on the reduced model (off: it costs 10-80 ms).
3. Replicate each policy to every family layer and realise it on the full model: the
   representative's prefetches window by window in time order (clusters that must share a
   window move together with their not-yet-placed inputs; exact peak bookkeeping), then keep
   more where memory is left and move on-demand recompute into windows with room (the most
   recompute per prefetched byte first), in both orders; the best realisation wins.
   If none fits, the exact model is solved instead.

Example::

    >>> from lynx.solvers.problem import make_uniform_problem, validate
    >>> from lynx.solvers.heu import solve_heu
    >>> p = make_uniform_problem(layers=4, microbatches=8, in_flight=4, recv_grad_capacity_s=0.002)
    >>> res = solve_heu(p)
    >>> validate(p, res.assignment); res.status
    'HEURISTIC'
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import Counter
from dataclasses import dataclass

from lynx.errors import LynxBudgetError
from lynx.solvers.opt import (
    ModelClass,
    ModelItem,
    ModelSolution,
    StageModel,
    budget_error,
    expand_solution,
    model_from_problem,
    solve_model,
)
from lynx.solvers.problem import SolveResult, StageProblem, exposed_recompute_s, peak_activation_bytes

__all__ = ["solve_heu"]

# CP-SAT deterministic-time units for the representative model (0: greedy only)
REP_SEARCH = 0.0


@dataclass
class _Family:
    layers: list[list[int]]  # item indices per family layer, aligned by position
    rep_of: dict[int, int]  # family item -> position in its layer


def _families(problem: StageProblem, model: StageModel) -> _Family:
    """Layers whose contracted items match the most common layer structure.

    Membership compares items and their wiring inside the layer; the representative (first
    of ``layers``) is a member whose wiring to the previous layer is the most common one,
    so the first layer of a stage (whose inputs come from outside) still joins the family.
    """
    by_name = {n.name: n for n in problem.nodes}
    layer_of = [by_name[it.nodes[-1]].layer for it in model.items]
    per_layer: dict[int, list[int]] = {}
    for i, layer in enumerate(layer_of):
        if layer is not None:
            per_layer.setdefault(layer, []).append(i)
    pos = {i: p for items in per_layer.values() for p, i in enumerate(items)}
    inner, full = {}, {}
    for layer, idx in per_layer.items():
        sig_in, sig_full = [], []
        for i in idx:
            it = model.items[i]
            ins, outs = [], []
            for u, _ in it.inputs:
                if layer_of[u] == layer:
                    ins.append(pos[u])
                elif layer_of[u] is not None and layer_of[u] == layer - 1:
                    outs.append(("prev", pos[u]))
                else:
                    outs.append(("ext", by_name[model.items[u].nodes[-1]].layer_class))
            head = (it.saved_bytes, round(it.recompute_s, 15), it.output_saved, tuple(sorted(ins)))
            sig_in.append(head)
            sig_full.append((head, tuple(sorted(outs))))
        inner[layer], full[layer] = tuple(sig_in), tuple(sig_full)
    if not inner:
        return _Family([], {})
    common, _ = Counter(inner.values()).most_common(1)[0]
    members = [layer for layer in sorted(per_layer) if inner[layer] == common]
    rep_sig, _ = Counter(full[layer] for layer in members).most_common(1)[0]
    rep = next(layer for layer in members if full[layer] == rep_sig)
    layers = [per_layer[rep]] + [per_layer[layer] for layer in members if layer != rep]
    return _Family(layers, {i: p for items in layers for p, i in enumerate(items)})


def _reduced(model: StageModel, fam: _Family) -> tuple[StageModel, list[int]]:
    """Model with one item per family position; returns it and full-item -> reduced index."""
    n_rep = len(fam.layers[0]) if len(fam.layers) > 1 else 0
    rep_layer = fam.layers[0] if n_rep else []
    others = [i for i in range(len(model.items)) if not (n_rep and i in fam.rep_of)]
    to_red = {i: n_rep + k for k, i in enumerate(others)}
    if n_rep:
        to_red.update(fam.rep_of)
    rep_group = model.items[rep_layer[0]].group if n_rep else -1
    items = []
    for i in (rep_layer + others):
        it = model.items[i]
        ins = {}
        for u, cross in it.inputs:
            ru = to_red[u]
            cross_red = cross or (ru == to_red[i])
            if ru == to_red[i] and not cross:
                continue
            ins[ru] = ins.get(ru, False) or cross_red
        mult = len(fam.layers) if (n_rep and i in fam.rep_of) else 1
        items.append(ModelItem(it.nodes, mult, it.saved_bytes, it.recompute_s, tuple(sorted(ins.items())),
                               it.output_saved, rep_group if mult > 1 else it.group))
    classes = []
    for cls in model.classes:
        any_cap = sum(c for c, e in zip(cls.capacities, cls.eligible) if e is None)
        lay_cap = sum(c for c, e in zip(cls.capacities, cls.eligible) if e is not None)
        lay_items = set()
        for e in cls.eligible:
            if e is not None:
                lay_items |= {to_red[i] for i in e}
        caps, elig = [], []
        if any(e is None for e in cls.eligible):
            caps.append(any_cap)
            elig.append(None)
        if lay_items:
            caps.append(lay_cap)
            elig.append(frozenset(lay_items))
        classes.append(ModelClass(cls.count, tuple(caps), tuple(elig)))
    return StageModel(tuple(items), tuple(classes), model.in_flight, model.budget_bytes), [to_red[i] for i in range(len(model.items))]


class _Books:
    """Exact peak-memory bookkeeping over items: in_flight·kept + max P_c + max T_{c,g}."""

    def __init__(self, model: StageModel, rec: list[bool]) -> None:
        self.m = model
        self.rec = rec
        self.where: list[list[int | None]] = [[None] * len(model.items) for _ in model.classes]
        self.kept = sum(it.mult * it.saved_bytes for it, r in zip(model.items, rec) if not r)
        self.P = [0] * len(model.classes)
        self.T = [dict() for _ in model.classes]
        self.load = [[0.0] * len(c.capacities) for c in model.classes]
        self._version, self._cache_key, self._cache = 0, None, 0
        for c in range(len(model.classes)):
            for i, it in enumerate(model.items):
                if rec[i]:
                    self.T[c][it.group] = self.T[c].get(it.group, 0) + it.saved_bytes

    def peak(self) -> int:
        t = max((v for tc in self.T for v in tc.values()), default=0)
        return self.m.in_flight * self.kept + max(self.P, default=0) + t

    def peak_if_placed(self, c: int, cluster: list[int]) -> int:
        items = self.m.items
        b = sum(items[i].mult * items[i].saved_bytes for i in cluster)
        p = max(max((v for k, v in enumerate(self.P) if k != c), default=0), self.P[c] + b)
        drop: dict[int, int] = {}
        for i in cluster:
            drop[items[i].group] = drop.get(items[i].group, 0) + items[i].saved_bytes
        tc = self.T[c]
        t = max((v - drop.get(g, 0) for g, v in tc.items()), default=0)
        others = self._tmax_others(c)
        return self.m.in_flight * self.kept + p + max(t, others)

    def _tmax_others(self, c: int) -> int:
        """Largest on-demand group bytes over the classes other than c (cached per state)."""
        key = (self._version, c)
        if self._cache_key != key:
            self._cache_key = key
            self._cache = max((max(d.values(), default=0) for k, d in enumerate(self.T) if k != c), default=0)
        return self._cache

    def exposed(self) -> float:
        """Exposed seconds in item terms: on-demand recompute plus window overflow."""
        total = 0.0
        items = self.m.items
        for c, cls in enumerate(self.m.classes):
            where = self.where[c]
            on_demand = sum(it.mult * it.recompute_s for i, it in enumerate(items) if self.rec[i] and where[i] is None)
            over = sum(max(0.0, load - cap) for load, cap in zip(self.load[c], cls.capacities))
            total += cls.count * (on_demand + over)
        return total

    def place(self, c: int, k: int, cluster: list[int]) -> None:
        self._version += 1
        for i in cluster:
            it = self.m.items[i]
            self.where[c][i] = k
            self.P[c] += it.mult * it.saved_bytes
            self.T[c][it.group] -= it.saved_bytes
            self.load[c][k] += it.mult * it.recompute_s


def _clusters(model: StageModel, rec: list[bool]) -> list[list[int]]:
    """Recomputed items joined by not-saved outputs (they must share a window), forward order."""
    parent = list(range(len(model.items)))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i, it in enumerate(model.items):
        if rec[i]:
            for u, _ in it.inputs:
                if rec[u] and not model.items[u].output_saved:
                    parent[find(i)] = find(u)
    out: dict[int, list[int]] = {}
    for i in range(len(model.items)):
        if rec[i]:
            out.setdefault(find(i), []).append(i)
    return sorted(out.values(), key=lambda c: c[0])


def _fill(model: StageModel, books: _Books, clusters: list[list[int]], budget: int, *, wanted) -> None:
    """Place clusters into windows in time order: inputs first, capacity and budget respected."""
    cluster_of = {i: cl for cl in clusters for i in cl}
    # Layers served by the fewest windows first: the last layer of the forward can use only
    # the windows before its backward, the first layer every one of them.
    by_need = sorted(clusters, key=lambda cl: (-model.items[cl[0]].group, cl[0]))
    # Windows any layer can use take the most recompute time per prefetched byte first.
    by_value = sorted(clusters, key=lambda cl: (-_cost(model, cl) / max(1, sum(model.items[i].mult * model.items[i].saved_bytes for i in cl)), cl[0]))
    for c, cls in enumerate(model.classes):
        where = books.where[c]
        for k, cap in enumerate(cls.capacities):
            elig = cls.eligible[k]
            for cl in (by_value if elig is None else by_need):
                if where[cl[0]] is not None or not wanted(c, cl):
                    continue
                if elig is not None and any(i not in elig for i in cl):
                    continue
                if books.load[c][k] + _cost(model, cl) > cap * (1 + 1e-9):
                    continue  # prerequisites only add to the cost
                unit = _with_prereqs(model, books, c, cl, cluster_of)
                if elig is not None and any(i not in elig for i in unit):
                    continue
                cost = sum(model.items[i].mult * model.items[i].recompute_s for i in unit)
                if books.load[c][k] + cost > cap * (1 + 1e-9):
                    continue
                if books.peak_if_placed(c, unit) <= budget:
                    books.place(c, k, unit)


def _prefetch_needed(model: StageModel, books: _Books, clusters: list[list[int]], budget: int) -> bool:
    """Inputs read across groups by an on-demand consumer must be prefetched (or kept).

    Place such clusters in any eligible window of the classes that lack them (overflow is
    exposed, as on demand would be), else keep them. False when neither fits the budget.
    """
    rec = books.rec
    crossed = {u for i, it in enumerate(model.items) if rec[i] for u, cross in it.inputs if cross and rec[u]}
    for cl in clusters:
        if not crossed.intersection(cl) or not rec[cl[0]]:
            continue
        for c, cls in enumerate(model.classes):
            if books.where[c][cl[0]] is not None:
                continue
            consumers_on_demand = any(
                rec[i] and books.where[c][i] is None and any(u in cl and cross for u, cross in it.inputs)
                for i, it in enumerate(model.items)
            )
            if not consumers_on_demand:
                continue
            latest = min((books.where[c][j] for j, it in enumerate(model.items) if rec[j] and books.where[c][j] is not None
                          and any(u in cl for u, _ in it.inputs)), default=len(cls.capacities))
            spots = [k for k, e in enumerate(cls.eligible) if k <= latest and (e is None or all(i in e for i in cl))]
            inputs_ok = all(not rec[u] or u in cl or books.where[c][u] is not None for i in cl for u, _ in model.items[i].inputs)
            if spots and inputs_ok and books.peak_if_placed(c, cl) <= budget:
                k = max(spots, key=lambda q: cls.capacities[q] - books.load[c][q])
                books.place(c, k, cl)
                continue
            if not all(model.items[i].output_saved for i in cl if i in crossed):
                return False
            nbytes = sum(model.items[i].mult * model.items[i].saved_bytes for i in cl)
            books._version += 1
            for c2 in range(len(model.classes)):  # keep it: undo its placements, stop dropping it
                for i in cl:
                    it = model.items[i]
                    if books.where[c2][i] is not None:
                        books.P[c2] -= it.mult * it.saved_bytes
                        books.load[c2][books.where[c2][i]] -= it.mult * it.recompute_s
                        books.where[c2][i] = None
                    else:
                        books.T[c2][it.group] -= it.saved_bytes
            books.kept += nbytes
            for i in cl:
                rec[i] = False
            if books.peak() > budget:
                return False
            break
    return True


def _boundary_kept(model: StageModel) -> list[bool]:
    """Drop every item that can be dropped, except outputs read across groups (kept)."""
    rec = [it.saved_bytes > 0 or not it.output_saved for it in model.items]
    changed = True
    while changed:
        changed = False
        for i, it in enumerate(model.items):
            if not rec[i]:
                continue
            for u, cross in it.inputs:
                if cross and rec[u] and model.items[u].output_saved:
                    rec[u] = False
                    changed = True
                elif (cross and rec[u]) or (not rec[u] and not model.items[u].output_saved):
                    rec[i] = False
                    changed = True
                    break
    return rec


def _cost(model: StageModel, cl: list[int]) -> float:
    return sum(model.items[i].mult * model.items[i].recompute_s for i in cl)


def _greedy(model: StageModel, budget: int) -> _Books | None:
    """Best-ratio greedy from "drop all but layer boundaries": keep a cluster, or prefetch it.

    Each step takes the move with the most exposed time saved per byte of peak added (moves
    that add no memory first). None when even the starting point does not fit.
    """
    books = _Books(model, _boundary_kept(model))
    if books.peak() > budget:
        return None
    rec = books.rec
    consumers: list[list[int]] = [[] for _ in model.items]
    for i, it in enumerate(model.items):
        for u, _ in it.inputs:
            consumers[u].append(i)
    while True:
        now = books.peak()
        best, best_key = None, (0.0, 0.0)
        clusters = _clusters(model, rec)
        cluster_of = {i: cl for cl in clusters for i in cl}
        for i in range(len(model.items)):
            if not rec[i]:
                continue
            unit = _keep_unit(model, rec, consumers, i)
            cost = _cost(model, unit)
            gain = sum(
                cls.count * sum(model.items[j].mult * model.items[j].recompute_s for j in unit if books.where[c][j] is None)
                for c, cls in enumerate(model.classes)
            )
            if gain <= 0:
                continue
            after = _peak_if_kept(model, books, unit)
            if after <= budget:
                key = _ratio(gain, after - now)
                if key > best_key:
                    best, best_key = ("keep", unit, None, None), key
        for cl in clusters:
            on_demand = [c for c in range(len(model.classes)) if books.where[c][cl[0]] is None]
            spots = []  # (class, window, items) where the cluster could go now, with its prerequisites
            for c in on_demand:
                unit = _with_prereqs(model, books, c, cl, cluster_of)
                cost = _cost(model, unit)
                k = _first_window(model, books, c, unit, cost)
                if k is None or cost <= 0:
                    continue
                spots.append((c, k, unit))
                after = books.peak_if_placed(c, unit)
                if after <= budget:
                    key = _ratio(model.classes[c].count * cost, after - now)
                    if key > best_key:
                        best, best_key = ("place", None, [(c, k, unit)], None), key
            if len(spots) > 1:  # prefetching in every class at once: P is a max over classes
                after = _peak_if_placed_all(model, books, spots)
                gain_all = sum(model.classes[c].count * _cost(model, unit) for c, _, unit in spots)
                if after <= budget:
                    key = _ratio(gain_all, after - now)
                    if key > best_key:
                        best, best_key = ("place", None, spots, None), key
        if best is None:
            return books
        kind, unit, spots, _ = best
        if kind == "keep":
            _apply_keep(model, books, unit)
            _drop_unneeded(model, books, consumers)
        else:
            for c, k, unit in spots:
                books.place(c, k, unit)


def _reverse_greedy(model: StageModel, budget: int) -> _Books | None:
    """From keep-all, drop what frees the most memory per exposed second until it fits.

    A dropped unit is prefetched in every class whose windows have room (hidden), else
    recomputed on demand there. Ties on exposed time go to the unit using the least window
    time per byte freed, so windows hold the bulky, cheap tensors. Outputs read across
    groups stay kept.
    """
    droppable = _boundary_kept(model)
    books = _Books(model, [False] * len(model.items))
    consumers: list[list[int]] = [[] for _ in model.items]
    for i, it in enumerate(model.items):
        for u, _ in it.inputs:
            consumers[u].append(i)
    while books.peak() > budget:
        now = books.peak()
        best, best_key = None, None
        for i, it in enumerate(model.items):
            if books.rec[i] or not droppable[i] or it.saved_bytes == 0:
                continue
            unit = _drop_unit(model, books.rec, droppable, i)
            if unit is None:
                continue
            trial = _try_drop(model, books, unit)
            freed = now - trial.peak()
            if freed <= 0:
                continue
            exposed = trial.exposed() - books.exposed()
            used = sum(sum(l) for l in trial.load) - sum(sum(l) for l in books.load)
            key = (exposed / freed, used / freed, i)
            if best_key is None or key < best_key:
                best, best_key = trial, key
        if best is None:
            return None
        books = best
    return books


def _drop_unit(model: StageModel, rec: list[bool], droppable: list[bool], i: int) -> list[int] | None:
    """Item i plus the not-saved producers it needs regenerated (None if one cannot be)."""
    unit, stack = {i}, [i]
    while stack:
        j = stack.pop()
        for u, cross in model.items[j].inputs:
            if not model.items[u].output_saved and not rec[u] and u not in unit:
                if cross or not droppable[u]:
                    return None
                unit.add(u)
                stack.append(u)
    return sorted(unit)


def _try_drop(model: StageModel, books: _Books, unit: list[int]) -> _Books:
    """A copy of the books with ``unit`` dropped, prefetched wherever a window has room."""
    trial = copy.copy(books)
    trial.rec = list(books.rec)
    trial.where = [list(w) for w in books.where]
    trial.P = list(books.P)
    trial.T = [dict(t) for t in books.T]
    trial.load = [list(l) for l in books.load]
    trial._version = books._version + 1
    for i in unit:
        it = model.items[i]
        trial.rec[i] = True
        trial.kept -= it.mult * it.saved_bytes
        for tc in trial.T:
            tc[it.group] = tc.get(it.group, 0) + it.saved_bytes
    cost = _cost(model, unit)
    spots = [(c, k, unit) for c in range(len(model.classes))
             if (k := _first_window(model, trial, c, unit, cost)) is not None]
    # Prefetch only where it costs no peak memory (memory is what dropping is short of; the
    # fill after replication spends what is left). P and T are maxima over classes, so
    # prefetching in every class at once can pay where one class alone does not.
    if len(spots) > 1 and _peak_if_placed_all(model, trial, spots) <= trial.peak():
        for c, k, u in spots:
            trial.place(c, k, u)
    else:
        for c, k, u in spots:
            if trial.peak_if_placed(c, u) <= trial.peak():
                trial.place(c, k, u)
    _repair_order(model, trial)  # consumers prefetched before their newly dropped input
    return trial


def _repair_order(model: StageModel, books: _Books) -> None:
    """Send to on demand any placement whose inputs are not ready by then, and any member of
    a must-share-a-window cluster whose partners are not in its window (fixed point)."""
    rec = books.rec
    changed = True
    while changed:
        changed = False
        for c in range(len(model.classes)):
            where = books.where[c]
            for i, it in enumerate(model.items):
                k = where[i]
                if k is None:
                    continue
                for u, _ in it.inputs:
                    late = rec[u] and (where[u] is None or where[u] > k)
                    split = rec[u] and not model.items[u].output_saved and where[u] != k
                    if late or split:
                        _unplace(model, books, c, i)
                        changed = True
                        break
                else:
                    continue
            for i, it in enumerate(model.items):  # an unsaved output placed while a consumer is not
                if rec[i] and where[i] is None:
                    for u, _ in it.inputs:
                        if rec[u] and not model.items[u].output_saved and where[u] is not None:
                            _unplace(model, books, c, u)
                            changed = True


def _unplace(model: StageModel, books: _Books, c: int, i: int) -> None:
    it = model.items[i]
    k = books.where[c][i]
    books.where[c][i] = None
    books.P[c] -= it.mult * it.saved_bytes
    books.T[c][it.group] = books.T[c].get(it.group, 0) + it.saved_bytes
    books.load[c][k] -= it.mult * it.recompute_s
    books._version += 1


def _keep_unit(model: StageModel, rec: list[bool], consumers: list[list[int]], i: int) -> list[int]:
    """Item i and, if its output is not saved, the recomputed consumers that read it."""
    unit, stack = {i}, [i]
    while stack:
        j = stack.pop()
        if model.items[j].output_saved:
            continue
        for c in consumers[j]:
            if rec[c] and c not in unit:
                unit.add(c)
                stack.append(c)
    return sorted(unit)


def _drop_unneeded(model: StageModel, books: _Books, consumers: list[list[int]]) -> None:
    """Zero-byte helpers no recomputed consumer needs any more are simply kept (free)."""
    for j in reversed(range(len(model.items))):
        it = model.items[j]
        if books.rec[j] and it.saved_bytes == 0 and not any(books.rec[c] for c in consumers[j]):
            _apply_keep(model, books, [j])


def _with_prereqs(model: StageModel, books: _Books, c: int, cl: list[int], cluster_of: dict[int, list[int]]) -> list[int]:
    """The cluster plus every recomputed, not yet placed ancestor (with their clusters)."""
    where, rec = books.where[c], books.rec
    if all(not rec[u] or where[u] is not None for i in cl for u, _ in model.items[i].inputs):
        return cl  # inputs all ready: the common case
    unit, stack = set(cl), list(cl)
    while stack:
        j = stack.pop()
        for u, _ in model.items[j].inputs:
            if rec[u] and where[u] is None and u not in unit:
                for v in cluster_of.get(u, [u]):
                    if v not in unit:
                        unit.add(v)
                        stack.append(v)
    return sorted(unit)


def _first_window(model: StageModel, books: _Books, c: int, cl: list[int], cost: float) -> int | None:
    """Earliest window of class c with room, eligibility and the cluster's inputs ready."""
    cls = model.classes[c]
    where, rec = books.where[c], books.rec
    for k, cap in enumerate(cls.capacities):
        elig = cls.eligible[k]
        if books.load[c][k] + cost > cap * (1 + 1e-9) or (elig is not None and any(i not in elig for i in cl)):
            continue
        if all(not rec[u] or u in cl or (where[u] is not None and where[u] <= k) for i in cl for u, _ in model.items[i].inputs):
            return k
    return None


def _peak_if_placed_all(model: StageModel, books: _Books, spots: list[tuple[int, int, list[int]]]) -> int:
    P = list(books.P)
    T = [dict(t) for t in books.T]
    for c, _, unit in spots:
        P[c] += sum(model.items[i].mult * model.items[i].saved_bytes for i in unit)
        for i in unit:
            T[c][model.items[i].group] -= model.items[i].saved_bytes
    t = max((v for tc in T for v in tc.values()), default=0)
    return model.in_flight * books.kept + max(P, default=0) + t


def _ratio(gain: float, added: float) -> tuple[float, float]:
    """Sort key: moves adding no memory first (by gain), then by gain per byte."""
    return (1.0, gain) if added <= 0 else (0.0, gain / added)


def _peak_if_kept(model: StageModel, books: _Books, cl: list[int]) -> int:
    nbytes = sum(model.items[i].mult * model.items[i].saved_bytes for i in cl)
    P = list(books.P)
    T = [dict(t) for t in books.T]
    for c in range(len(model.classes)):
        for i in cl:
            it = model.items[i]
            if books.where[c][i] is not None:
                P[c] -= it.mult * it.saved_bytes
            else:
                T[c][it.group] -= it.saved_bytes
    t = max((v for tc in T for v in tc.values()), default=0)
    return model.in_flight * (books.kept + nbytes) + max(P, default=0) + t


def _apply_keep(model: StageModel, books: _Books, cl: list[int]) -> None:
    books._version += 1
    for c in range(len(model.classes)):
        for i in cl:
            it = model.items[i]
            k = books.where[c][i]
            if k is not None:
                books.P[c] -= it.mult * it.saved_bytes
                books.load[c][k] -= it.mult * it.recompute_s
                books.where[c][i] = None
            else:
                books.T[c][it.group] -= it.saved_bytes
    books.kept += sum(model.items[i].mult * model.items[i].saved_bytes for i in cl)
    for i in cl:
        books.rec[i] = False


def solve_heu(problem: StageProblem, *, time_limit_s: float = 10.0, progress=None) -> SolveResult:
    """HEU plan for one stage (see module docstring); raises LynxBudgetError when none fits."""
    start = time.perf_counter()
    model = model_from_problem(problem)
    fam = _families(problem, model)
    reduced, to_red = _reduced(model, fam)
    budget = problem.activation_budget_bytes
    policies = []
    for greedy in (_reverse_greedy, _greedy):
        rep = greedy(reduced, budget)
        if rep is not None:
            policies.append((tuple(rep.rec), tuple(tuple(w) for w in rep.where)))
    if not policies:
        return _fallback(problem, model, time_limit_s, start)
    # A short, deterministic exact search on the small representative model, from the greedy.
    if REP_SEARCH > 0:
        sol = solve_model(reduced, time_limit_s=min(time_limit_s, 1.0), hint=policies[0], deterministic_limit=REP_SEARCH)
        if sol.status in ("OPTIMAL", "FEASIBLE"):
            policies.insert(0, (sol.recompute, sol.placement))
    best = None
    for (rep_rec, rep_where), keep_first in itertools.product(policies, (False, True)):
        base = [rep_rec[to_red[i]] for i in range(len(model.items))]
        designated = lambda c, cl, w=rep_where: w[c][to_red[cl[0]]] is not None  # noqa: E731
        books = _realise(model, list(base), budget, designated, keep_first)
        if books is not None and (best is None or books.exposed() < best.exposed() - 1e-12):
            best = books
    if best is None:
        return _fallback(problem, model, time_limit_s, start)
    msol = ModelSolution("HEURISTIC", tuple(best.rec), tuple(tuple(w) for w in best.where), 0.0, 0.0, 0.0)
    assignment = expand_solution(problem, model, msol)
    if peak_activation_bytes(problem, assignment) > budget:  # item bookkeeping is exact; belt and braces
        return _fallback(problem, model, time_limit_s, start)
    return SolveResult(assignment, "HEURISTIC", exposed_recompute_s(problem, assignment), None, time.perf_counter() - start)


def _realise(model: StageModel, rec: list[bool], budget: int, designated, keep_first: bool) -> _Books | None:
    """Replicated policy on the full model: designated prefetches, then fill and keep more."""
    changed = True
    while changed:  # inputs that do not keep their output are dropped with their consumer
        changed = False
        for i, it in enumerate(model.items):
            if rec[i]:
                for u, _ in it.inputs:
                    if not rec[u] and not model.items[u].output_saved:
                        rec[u] = changed = True
    books = _Books(model, rec)
    clusters = _clusters(model, rec)
    _fill(model, books, clusters, budget, wanted=designated)
    if not _prefetch_needed(model, books, clusters, budget):
        return None
    if keep_first:
        _keep_more(model, books, _clusters(model, books.rec), budget)
    _fill(model, books, _clusters(model, books.rec), budget, wanted=lambda c, cl: True)
    if not keep_first:
        _keep_more(model, books, _clusters(model, books.rec), budget)
    _repair_order(model, books)
    if not _prefetch_needed(model, books, _clusters(model, books.rec), budget):
        return None
    return books if books.peak() <= budget else None


def _keep_more(model: StageModel, books: _Books, clusters: list[list[int]], budget: int) -> None:
    """Un-drop on-demand clusters with the best exposed-time saving per byte while memory lasts."""
    rec = books.rec
    consumers_outside: dict[int, bool] = {}
    cluster_id = {i: k for k, cl in enumerate(clusters) for i in cl}
    for i, it in enumerate(model.items):
        if rec[i]:
            for u, _ in it.inputs:
                if u in cluster_id and cluster_id.get(i) != cluster_id[u] and not model.items[u].output_saved:
                    consumers_outside[u] = True
    scored = []
    for cl in clusters:
        if any(consumers_outside.get(i) for i in cl):
            continue
        saving = sum(
            cls.count * sum(model.items[i].mult * model.items[i].recompute_s for i in cl)
            for c, cls in enumerate(model.classes) if books.where[c][cl[0]] is None
        )
        nbytes = sum(model.items[i].mult * model.items[i].saved_bytes for i in cl)
        if saving > 0:
            scored.append((-saving / max(nbytes, 1), cl))
    scored.sort(key=lambda t: (t[0], t[1][0]))
    for _, cl in scored:
        if any(books.where[c][cl[0]] is not None for c in range(len(model.classes))):
            continue
        nbytes = sum(model.items[i].mult * model.items[i].saved_bytes for i in cl)
        books._version += 1
        saved_T = [dict(t) for t in books.T]
        for c in range(len(model.classes)):
            for i in cl:
                books.T[c][model.items[i].group] -= model.items[i].saved_bytes
        books.kept += nbytes
        if books.peak() <= budget:
            for i in cl:
                rec[i] = False
        else:
            books.kept -= nbytes
            books.T = saved_T
            books._version += 1


def _fallback(problem: StageProblem, model: StageModel, time_limit_s: float, start: float) -> SolveResult:
    """The greedy could not realise a fitting plan: take the exact model's first good answer."""
    sol = solve_model(model, time_limit_s=time_limit_s)
    if sol.status == "INFEASIBLE":
        raise budget_error(problem)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        raise LynxBudgetError(f"stage {problem.stage}: HEU found no plan within the budget in {time_limit_s} s")
    assignment = expand_solution(problem, model, sol)
    return SolveResult(assignment, "HEURISTIC", exposed_recompute_s(problem, assignment), None, time.perf_counter() - start)
