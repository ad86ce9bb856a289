"""The CP-SAT model of a stage (OPT, Checkmate, and HEU's fallback): build it, solve it.

:func:`solve_model` builds, over a :class:`~lynx.solvers.stage_model.StageModel`:

* ``r[i]`` — item i is recomputed; ``x[c, i, k]`` — for class c it is recomputed in the
  class's k-th window (else on demand: ``od[c, i] = r[i] − Σ_k x[c, i, k]``).
* validity: an input that does not keep its output must be recomputed with its consumer, in
  the same window or on demand with it; a recomputed input must be placed no later than its
  consumer (windows in time order, on demand last; an input of an earlier group is
  regenerated on demand only *after* its consumer's group, so it must be kept or
  prefetched — and a consumer of an earlier group's not-saved output is never on demand).
* memory — the bound :func:`lynx.solvers.memory.peak_upper_bound_bytes` defines, never
  below the runtime's peak: ``in_flight·kept + P + T ≤ budget`` with ``P ≥ prefetched(c)``
  and ``T ≥ on-demand bytes of any group + early(c)`` for every class c, where ``early(c)``
  counts each on-demand item whose output a later group saves (it is regenerated during that
  group's backward) with its on-demand ancestors in its group. A stage output saved only by
  the next stage (``sent``) is never worth dropping (it stays held) and is fixed as kept.
* window capacity is soft: ``o[c, k] ≥ load − capacity`` counts as exposed.
* objective: ``Σ_c |c| · (Σ_i cost_i · od[c, i] + Σ_k o[c, k])`` (or the peak, for
  ``minimise="memory"``); on demand, ``cost_i`` is what the backward re-runs (zero bubble: once
  per part that may re-run the item, ``ModelItem.on_demand_s``).
* offload (a stage with copy lanes): ``f[i]`` beside ``r[i]``, its memory, host-budget, time
  and validity terms in :mod:`lynx.solvers.cpsat_offload`.

Times are scaled to integers relative to the stage's recompute total, bytes to the tensor
sizes' common divisor when that is at least ``budget / 2**26`` (exact), else to a unit of
``budget / 2**26`` rounded up (so a model solution never exceeds the exact budget).

Example::

    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.stage_model import model_from_problem
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=1.0)
    >>> sol = solve_model(model_from_problem(p), time_limit_s=10.0)
    >>> sol.status
    'OPTIMAL'
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from ortools.sat.python import cp_model

from lynx.solvers.cpsat_offload import OffloadVars, add_offload, forbid_window_readers
from lynx.solvers.stage_model import ModelSolution, StageModel
from lynx.solvers.cpsat_symmetry import break_layer_symmetry

__all__ = ["solve_model", "ProgressFn", "RELATIVE_GAP"]

# OPTIMAL means proven within this relative gap (the customary MIP tolerance, as Gurobi's
# and CPLEX's defaults); the exact gap is reported in SolveResult.gap.
RELATIVE_GAP = 1e-4

ProgressFn = Callable[[float, float, float], None]  # (elapsed_s, objective_s, bound_s)


def _free_items(model: StageModel) -> list[bool]:
    """Items worth deciding: dropping them frees memory, or a consumer may need them dropped."""
    needed_by_drop = [False] * len(model.items)
    for item in model.items:
        for src, _ in item.inputs:
            if not model.items[src].output_saved:
                needed_by_drop[src] = True
    # a stage output (sent) keeps its bytes whatever the plan does: never worth dropping
    free = [(it.saved_bytes > 0 and not it.sent) or needed_by_drop[i] for i, it in enumerate(model.items)]
    # Propagate: a zero-byte item is free only if a free consumer could force it.
    changed = True
    while changed:
        changed = False
        forced = [False] * len(model.items)
        for i, item in enumerate(model.items):
            if free[i]:
                for src, _ in item.inputs:
                    if not model.items[src].output_saved:
                        forced[src] = True
        for i, item in enumerate(model.items):
            if free[i] and item.saved_bytes == 0 and not forced[i]:
                free[i] = False
                changed = True
    return free


def _byte_unit(model: StageModel) -> int:
    """Bytes per model memory unit: exact when the tensor sizes allow it, else coarse.

    Real tensor sizes share a large power-of-two factor (8 KiB on GPT stages), usually
    coarser than ``budget / 2**26``; with that common divisor as the unit every item's bytes
    are exact and ``peak <= budget`` holds in units exactly when it holds in bytes, so a plan
    that fits the budget to the byte (e.g. `full` at a budget of its own peak) stays feasible.
    Otherwise bytes round up per item (never optimistic), which may reject a plan within a
    few KiB of the budget.
    """
    coarse = max(
        1, model.budget_bytes // 2**26, max((it.mult * it.saved_bytes for it in model.items), default=1) // 2**40
    )
    common = math.gcd(*(it.saved_bytes for it in model.items))
    return common if common >= coarse else coarse


def solve_model(
    model: StageModel,
    *,
    time_limit_s: float,
    minimise: str = "exposed",
    hint: tuple[tuple[bool, ...], tuple[tuple[int | None, ...], ...]] | None = None,
    progress: ProgressFn | None = None,
    workers: int = 1,
    deterministic_limit: float | None = None,
    symmetry: bool = True,
) -> ModelSolution:
    """Build and solve the CP-SAT model; ``minimise`` is "exposed" or "memory" (no budget).

    ``deterministic_limit`` caps CP-SAT's deterministic time (work units independent of
    machine load), so a short search gives the same answer on every run. ``symmetry`` orders
    identical layers (:mod:`lynx.solvers.cpsat_symmetry`; the optimum is kept).
    """
    start = time.perf_counter()
    items = model.items
    total_cost = sum(it.mult * it.recompute_s for it in items) or 1.0
    tau = total_cost / 1e6  # seconds per time unit
    unit = _byte_unit(model)
    mem_w = [-(-it.mult * it.saved_bytes // unit) for it in items]  # ceil: never optimistic
    mem_t = [-(-it.saved_bytes // unit) for it in items]
    cost = [round(it.mult * it.recompute_s / tau) for it in items]

    m = cp_model.CpModel()
    free = _free_items(model)
    r, x, od = _decision_vars(m, model, free)
    _dependencies(m, model, free, r, x, od)
    off = None
    if model.offload is not None and all(it.mult == 1 for it in items):   # the fourth choice (cpsat_offload)
        off = add_offload(m, model, model.offload, free, r, mem_w, unit, tau)
        forbid_window_readers(m, model, model.offload, off, x)
    elif symmetry:   # (identical layers are not interchangeable once copies are pending)
        break_layer_symmetry(m, model, free, r, x)
    peak = _peak(m, model, free, r, x, od, mem_w, mem_t, off)
    exposed = _exposed(m, model, free, x, od, cost, tau)
    if off is not None:
        exposed = exposed + off.exposed
    if minimise == "memory":
        m.minimize(peak)
        scale = float(unit)
    else:
        m.add(peak <= model.budget_bytes // unit)
        m.minimize(exposed)
        scale = tau
    if hint is not None:
        _add_hint(m, hint, free, r, x)
        if off is not None and len(hint) == 3:
            for i, v in off.f.items():
                m.add_hint(v, bool(hint[2][i]))

    solver = _solver(time_limit_s - (time.perf_counter() - start), workers, deterministic_limit)
    callback = _Progress(progress, scale, start) if progress else None
    code = solver.solve(m, callback) if callback else solver.solve(m)
    status = solver.status_name(code)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound = solver.best_objective_bound * scale if code == cp_model.UNKNOWN else math.inf
        return ModelSolution(status, (), (), math.inf, bound, time.perf_counter() - start)
    rec = tuple(bool(solver.value(v)) for v in r)
    placement = []
    for xc in x:
        where = [None] * len(items)
        for (i, k), v in xc.items():
            if solver.value(v):
                where[i] = k
        placement.append(tuple(where))
    moved = tuple(bool(solver.value(off.f[i])) if i in off.f else False for i in range(len(items))) if off else ()
    return ModelSolution(
        status,
        rec,
        tuple(placement),
        solver.objective_value * scale,
        solver.best_objective_bound * scale,
        time.perf_counter() - start,
        moved,
    )


def _decision_vars(m: cp_model.CpModel, model: StageModel, free: list[bool]):
    """``r[i]``: item i is recomputed; ``x[c][i, k]``: for microbatch class c it is recomputed in
    window k; ``od[c][i]``: on demand (recomputed and placed in no window)."""
    items, classes = model.items, model.classes
    r = [m.new_bool_var(f"r{i}") if free[i] else m.new_constant(0) for i in range(len(items))]
    x: list[dict[tuple[int, int], cp_model.IntVar]] = []
    od: list[list] = []
    # Classes with a single window open to every item prefetch the same set WLOG: P is the
    # largest class's prefetched bytes, so each such class can take the set of the class that
    # hides the most (no more bytes, no less hidden, no more on-demand bytes than that class,
    # which the transient bound already covers). One set of variables for all of them.
    single = None
    for c, cls in enumerate(classes):
        if single is not None and cls.eligible == (None,):
            xc = single
        else:
            xc = {}
            for k, elig in enumerate(cls.eligible):
                for i in range(len(items)):
                    if free[i] and (elig is None or i in elig):
                        xc[i, k] = m.new_bool_var(f"x{c}_{i}_{k}")
            if cls.eligible == (None,):
                single = xc
        x.append(xc)
        odc = []
        for i in range(len(items)):
            placed = [xc[i, k] for k in range(len(cls.capacities)) if (i, k) in xc]
            if placed:
                m.add(sum(placed) <= r[i])
            odc.append(r[i] - sum(placed))
        od.append(odc)
    return r, x, od


def _dependencies(m: cp_model.CpModel, model: StageModel, free: list[bool], r, x, od) -> None:
    """A recomputed item's inputs are kept, or recomputed no later than it."""
    items, classes = model.items, model.classes
    for i, item in enumerate(items):
        if not free[i]:
            continue
        for u, cross in item.inputs:
            if not items[u].output_saved:
                m.add_implication(r[i], r[u]) if free[u] else m.add(r[i] == 0)
            if not free[u]:
                continue  # kept forever: available whenever its output is saved
            if not items[u].output_saved:
                # Its output is not a saved tensor, so nothing accounts for it living across
                # windows: it runs in the same window as each recomputed consumer.
                # From an earlier group it is regenerated on demand only after its consumer,
                # so the consumer cannot be on demand at all: it is placed (with u).
                for c, cls in enumerate(classes):
                    xc = x[c]
                    for k in range(len(cls.capacities)):
                        if (i, k) in xc:
                            m.add(xc[i, k] <= xc[u, k]) if (u, k) in xc else m.add(xc[i, k] == 0)
                    m.add(od[c][i] <= od[c][u])
                    if cross:
                        m.add(od[c][i] == 0)
                continue
            for c, cls in enumerate(classes):
                xc = x[c]
                for k in range(len(cls.capacities)):
                    if (i, k) in xc:  # placed in window k: u kept or placed in a window <= k
                        before = [xc[u, q] for q in range(k + 1) if (u, q) in xc]
                        m.add(xc[i, k] <= 1 - r[u] + sum(before))
                if cross:  # on demand for c: u kept or prefetched for c (before i's group regenerates)
                    upre = [xc[u, q] for q in range(len(cls.capacities))
                            if (u, q) in xc and cls.before_on_demand(q, item.group)]
                    m.add(od[c][i] <= 1 - r[u] + sum(upre))


def _exposed(m: cp_model.CpModel, model: StageModel, free: list[bool], x, od, cost: list[int], tau: float):
    """Exposed recompute time in units of ``tau``: everything on demand plus each window's
    load beyond its capacity, per microbatch class times its count."""
    exposed_terms = []
    for c, cls in enumerate(model.classes):
        # on demand, an item costs what the backward re-runs (zero bubble: in each part that may)
        terms = [round(cost[i] * _parts(model.items[i])) * od[c][i] for i in range(len(model.items))
                 if free[i] and cost[i]]
        for k, cap in enumerate(cls.capacities):
            load = [cost[i] * v for (i, q), v in x[c].items() if q == k and cost[i]]
            if load:
                ov = m.new_int_var(0, sum(cost), f"o{c}_{k}")
                m.add(ov >= sum(load) - round(cap / tau))
                terms.append(ov)
        if terms:
            exposed_terms.append(cls.count * sum(terms))
    return sum(exposed_terms) if exposed_terms else 0


def _parts(item) -> float:
    """How many times over an item's on-demand regeneration costs its recompute seconds (1 but
    under a split backward: :attr:`~lynx.solvers.stage_model.ModelItem.on_demand_s`)."""
    if item.on_demand_s is None or item.recompute_s <= 0:
        return 1.0
    return item.on_demand_s / item.recompute_s


def _add_hint(m: cp_model.CpModel, hint, free: list[bool], r, x) -> None:
    rec, plc = hint[0], hint[1]   # (a third part: offload, added by solve_model)
    for i in range(len(r)):
        if free[i]:
            m.add_hint(r[i], bool(rec[i]))
    hinted: set[int] = set()
    for c, xc in enumerate(x):
        if id(xc) in hinted:  # classes sharing one set of variables (see _decision_vars)
            continue
        hinted.add(id(xc))
        for (i, k), v in xc.items():
            m.add_hint(v, plc[c][i] == k)


def _solver(time_left_s: float, workers: int, deterministic_limit: float | None) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.001, time_left_s)
    solver.parameters.num_workers = workers
    if deterministic_limit is not None:
        solver.parameters.max_deterministic_time = deterministic_limit
    solver.parameters.random_seed = 0
    solver.parameters.relative_gap_limit = RELATIVE_GAP
    solver.parameters.linearization_level = 2  # cuts: proves these knapsack-like models far faster
    if workers > 1:
        solver.parameters.interleave_search = True  # deterministic with several workers
    return solver


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, fn: ProgressFn, scale: float, start: float) -> None:
        super().__init__()
        self._fn, self._scale, self._start = fn, scale, start

    def on_solution_callback(self) -> None:
        self._fn(
            time.perf_counter() - self._start,
            self.objective_value * self._scale,
            self.best_objective_bound * self._scale,
        )


def _peak(m: cp_model.CpModel, model: StageModel, free, r, x, od, mem_w, mem_t, off: OffloadVars | None = None):
    """``in_flight · kept + P + T`` (see the module docstring), T per class including the
    on-demand items regenerated early by a later group's saver; with offload, its terms
    (:mod:`lynx.solvers.cpsat_offload`)."""
    items, classes = model.items, model.classes
    P = m.new_int_var(0, sum(mem_w), "prefetched")
    T = m.new_int_var(0, max(sum(mem_t), 0) * (1 if off is None else model.in_flight + 2), "transient")
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        if free[i] and mem_t[i] > 0:
            groups.setdefault(item.group, []).append(i)
    for c in range(len(classes)):
        if x[c] or off is not None:
            m.add(P >= sum(mem_w[i] * v for (i, _), v in x[c].items()) + (off.slot_bytes if off else 0))
    on_demand = od if classes else [[r[i] for i in range(len(items))]]
    early_items = [i for i, it in enumerate(items) if free[i] and it.saved_until is not None and it.mult == 1]
    for c, odc in enumerate(on_demand):
        early = []
        for i in early_items:
            closure = [k for k in _group_ancestors(items, i) | {i} if mem_t[k] > 0 and free[k]]
            reach = sum(mem_t[k] for k in closure)
            if reach:
                u = m.new_int_var(0, reach, f"early{c}_{i}")
                m.add(u >= sum(mem_t[k] * odc[k] for k in closure) - reach * (1 - odc[i]))
                early.append(u)
        if off is None:
            for members in groups.values():
                m.add(T >= sum(mem_t[i] * odc[i] for i in members) + sum(early))
        else:   # every group: its offloaded values streamed back and the copies still pending
            for q, held in enumerate(off.per_group):
                members = groups.get(q, [])
                m.add(T >= sum(mem_t[i] * odc[i] for i in members) + sum(early) + held)
    freed = off.kept_freed if off is not None else 0
    if model.chunk_in_flight:   # several chunks: each item's chunk's most microbatches in flight
        times = dict(model.chunk_in_flight)
        coef = [times.get(it.chunk, model.in_flight) for it in items]
        kept = sum(coef[i] * mem_w[i] for i in range(len(items))) - sum(
            coef[i] * mem_w[i] * r[i] for i in range(len(items)) if free[i])
    else:
        kept = model.in_flight * (sum(mem_w) - sum(mem_w[i] * r[i] for i in range(len(items)) if free[i]) - freed)
    if model.held_over:   # other microbatches holding prefetched and handed-over values (lynx.solvers.memory_replay)
        unit = _byte_unit(model)
        handed = sum(-(-it.weight_bytes * it.mult // unit) * r[i] for i, it in enumerate(items) if free[i])
        return kept + (1 + model.held_over) * P + model.handing * handed + T
    return kept + P + T


def _group_ancestors(items, i: int) -> set[int]:
    """Items item i reads, directly or through others, within its own group."""
    seen: set[int] = set()
    stack = [i]
    while stack:
        for u, cross in items[stack.pop()].inputs:
            if not cross and items[u].group == items[i].group and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen
