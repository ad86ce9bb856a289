"""HEU: solve one representative layer, replicate it, fill what is left greedily.

1. Contract the stage as OPT does (:func:`lynx.solvers.opt.model_from_problem`) and find the
   family of structurally identical layers (same items, bytes, costs and wiring).
2. Solve a reduced CP-SAT model in which one item stands for the same node in every layer of
   the family (``mult`` = family size), edge blocks and odd layers are items of their own, and
   each microbatch class has its windows merged into two (any-layer windows, layer-restricted
   windows). The model is small (tens of items), so it solves in milliseconds.
3. Replicate the policy to every family layer, then realise placements window by window in
   time order (clusters of nodes that must share a window move together, inputs first, exact
   peak-memory bookkeeping), keep more where memory is left, and move remaining on-demand
   recompute into windows with capacity left.

Example::

    >>> from lynx.solvers.problem import make_uniform_problem, validate
    >>> from lynx.solvers.heu import solve_heu
    >>> p = make_uniform_problem(layers=4, microbatches=8, in_flight=4, recv_grad_capacity_s=0.002)
    >>> res = solve_heu(p)
    >>> validate(p, res.assignment); res.status
    'HEURISTIC'
"""

from __future__ import annotations

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
from lynx.solvers.problem import SolveResult, StageProblem, exposed_recompute_s, peak_activation_bytes, validate

__all__ = ["solve_heu"]


@dataclass
class _Family:
    layers: list[list[int]]  # item indices per family layer, aligned by position
    rep_of: dict[int, int]  # family item -> position in its layer


def _families(problem: StageProblem, model: StageModel) -> _Family:
    """Layers whose contracted items have the same signature as the most common one."""
    by_name = {n.name: n for n in problem.nodes}
    layer_of = [by_name[it.nodes[-1]].layer for it in model.items]
    per_layer: dict[int, list[int]] = {}
    for i, layer in enumerate(layer_of):
        if layer is not None:
            per_layer.setdefault(layer, []).append(i)
    pos = {i: p for items in per_layer.values() for p, i in enumerate(items)}
    signature = {}
    for layer, idx in per_layer.items():
        sig = []
        for i in idx:
            it = model.items[i]
            ins = []
            for u, cross in it.inputs:
                if layer_of[u] == layer:
                    ins.append(("in", pos[u]))
                elif layer_of[u] is not None and layer_of[u] == layer - 1:
                    ins.append(("prev", pos[u]))
                else:
                    ins.append(("ext", u))
            sig.append((it.saved_bytes, round(it.recompute_s, 15), it.output_saved, tuple(sorted(ins))))
        signature[layer] = tuple(sig)
    if not signature:
        return _Family([], {})
    common, _ = Counter(signature.values()).most_common(1)[0]
    layers = [per_layer[layer] for layer in sorted(per_layer) if signature[layer] == common]
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
        self.where = [[None] * len(model.items) for _ in model.classes]
        self.kept = sum(it.mult * it.saved_bytes for it, r in zip(model.items, rec) if not r)
        self.P = [0] * len(model.classes)
        self.T = [dict() for _ in model.classes]
        self.load = [[0.0] * len(c.capacities) for c in model.classes]
        for c in range(len(model.classes)):
            for i, it in enumerate(model.items):
                if rec[i]:
                    self.T[c][it.group] = self.T[c].get(it.group, 0) + it.saved_bytes

    def peak(self) -> int:
        t = max((v for tc in self.T for v in tc.values()), default=0)
        return self.m.in_flight * self.kept + max(self.P, default=0) + t

    def peak_if_placed(self, c: int, cluster: list[int]) -> int:
        b = sum(self.m.items[i].saved_bytes for i in cluster)
        p = max(max((v for k, v in enumerate(self.P) if k != c), default=0), self.P[c] + b)
        tc = dict(self.T[c])
        for i in cluster:
            tc[self.m.items[i].group] -= self.m.items[i].saved_bytes
        t = max([v for k, d in enumerate(self.T) if k != c for v in d.values()] + list(tc.values()) + [0])
        return self.m.in_flight * self.kept + p + t

    def place(self, c: int, k: int, cluster: list[int]) -> None:
        for i in cluster:
            it = self.m.items[i]
            self.where[c][i] = k
            self.P[c] += it.saved_bytes
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
    rec = books.rec
    for c, cls in enumerate(model.classes):
        where = books.where[c]
        for k, cap in enumerate(cls.capacities):
            elig = cls.eligible[k]
            for cl in clusters:
                if where[cl[0]] is not None or not wanted(c, cl):
                    continue
                if elig is not None and any(i not in elig for i in cl):
                    continue
                members = set(cl)
                ok = all(
                    not rec[u] or u in members or where[u] is not None
                    for i in cl for u, _ in model.items[i].inputs
                )
                cost = sum(model.items[i].mult * model.items[i].recompute_s for i in cl)
                if not ok or books.load[c][k] + cost > cap * (1 + 1e-9):
                    continue
                if books.peak_if_placed(c, cl) <= budget:
                    books.place(c, k, cl)


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
            spots = [k for k, e in enumerate(cls.eligible) if e is None or all(i in e for i in cl)]
            inputs_ok = all(not rec[u] or u in cl or books.where[c][u] is not None for i in cl for u, _ in model.items[i].inputs)
            if spots and inputs_ok and books.peak_if_placed(c, cl) <= budget:
                k = max(spots, key=lambda q: cls.capacities[q] - books.load[c][q])
                books.place(c, k, cl)
                continue
            if not all(model.items[i].output_saved for i in cl if i in crossed):
                return False
            nbytes = sum(model.items[i].mult * model.items[i].saved_bytes for i in cl)
            for c2 in range(len(model.classes)):  # keep it: undo its placements, stop dropping it
                for i in cl:
                    it = model.items[i]
                    if books.where[c2][i] is not None:
                        books.P[c2] -= it.saved_bytes
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


def solve_heu(problem: StageProblem, *, time_limit_s: float = 10.0, progress=None) -> SolveResult:
    """HEU plan for one stage (see module docstring); raises LynxBudgetError when none fits."""
    start = time.perf_counter()
    model = model_from_problem(problem)
    fam = _families(problem, model)
    reduced, to_red = _reduced(model, fam)
    sol = solve_model(reduced, time_limit_s=min(time_limit_s, 5.0))
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        return _fallback(problem, model, time_limit_s, start)
    rec = [sol.recompute[to_red[i]] for i in range(len(model.items))]
    # cross-layer inputs that do not keep their output must be recomputed with their consumer
    changed = True
    while changed:
        changed = False
        for i, it in enumerate(model.items):
            if rec[i]:
                for u, _ in it.inputs:
                    if not rec[u] and not model.items[u].output_saved:
                        rec[u] = changed = True
    books = _Books(model, rec)
    clusters = _clusters(model, rec)
    budget = problem.activation_budget_bytes
    designated = lambda c, cl: sol.placement[c][to_red[cl[0]]] is not None  # noqa: E731
    _fill(model, books, clusters, budget, wanted=designated)
    if not _prefetch_needed(model, books, clusters, budget):
        return _fallback(problem, model, time_limit_s, start)
    _keep_more(model, books, clusters, budget)
    clusters = _clusters(model, books.rec)
    _fill(model, books, clusters, budget, wanted=lambda c, cl: True)
    msol = ModelSolution("HEURISTIC", tuple(books.rec), tuple(tuple(w) for w in books.where), 0.0, 0.0, 0.0)
    assignment = expand_solution(problem, model, msol)
    if peak_activation_bytes(problem, assignment) > budget:
        return _fallback(problem, model, time_limit_s, start)
    validate(problem, assignment)
    return SolveResult(assignment, "HEURISTIC", exposed_recompute_s(problem, assignment), None, time.perf_counter() - start)


def _keep_more(model: StageModel, books: _Books, clusters: list[list[int]], budget: int) -> None:
    """Un-drop on-demand clusters with the best exposed-time saving per byte while memory lasts."""
    rec = books.rec
    consumers_outside: dict[int, bool] = {}
    members_of = {i: set(cl) for cl in clusters for i in cl}
    for i, it in enumerate(model.items):
        for u, _ in it.inputs:
            if rec[i] and u in members_of and i not in members_of[u] and not model.items[u].output_saved:
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


def _fallback(problem: StageProblem, model: StageModel, time_limit_s: float, start: float) -> SolveResult:
    """The greedy could not realise a fitting plan: take the exact model's first good answer."""
    sol = solve_model(model, time_limit_s=time_limit_s)
    if sol.status == "INFEASIBLE":
        raise budget_error(problem)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        raise LynxBudgetError(f"stage {problem.stage}: HEU found no plan within the budget in {time_limit_s} s")
    assignment = expand_solution(problem, model, sol)
    return SolveResult(assignment, "HEURISTIC", exposed_recompute_s(problem, assignment), None, time.perf_counter() - start)
