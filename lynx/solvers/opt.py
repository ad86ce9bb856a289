"""OPT: the whole-stage CP-SAT model (also used by HEU's representative solve and Checkmate).

A :class:`StageModel` is a stage problem in solver form: *items* (one per node, or one per
family of identical nodes replicated over ``mult`` layers), *microbatch classes* (microbatches
with identical windows, decided once), the microbatches in flight and the budget.
:func:`solve_model` builds the CP-SAT model over it:

* ``r[i]`` — item i is recomputed; ``x[c, i, k]`` — for class c it is recomputed in the
  class's k-th window (else on demand: ``od[c, i] = r[i] − Σ_k x[c, i, k]``).
* validity: an input that does not keep its output must be recomputed with its consumer; a
  recomputed input must be placed no later than its consumer (windows in time order, on
  demand last; an input of an earlier group is regenerated on demand only *after* its
  consumer's group, so it must be kept or prefetched).
* memory: ``in_flight · kept + P + T ≤ budget`` with ``P ≥ prefetched(c)`` and
  ``T ≥ on-demand bytes of any group`` for every class.
* window capacity is soft: ``o[c, k] ≥ load − capacity`` counts as exposed.
* objective: ``Σ_c |c| · (Σ_i cost_i · od[c, i] + Σ_k o[c, k])`` (or the peak, for
  :func:`minimum_memory`).

Times are scaled to integers relative to the stage's recompute total, bytes to the tensor
sizes' common divisor when that is at least ``budget / 2**26`` (exact), else to a unit of
``budget / 2**26`` rounded up (so a model solution never exceeds the exact budget).

Example::

    >>> from lynx.solvers.problem import make_uniform_problem
    >>> from lynx.solvers.opt import solve_opt
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=1.0)
    >>> res = solve_opt(p, time_limit_s=10.0)
    >>> res.status, res.gap < 1e-4
    ('OPTIMAL', True)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from lynx.errors import LynxBudgetError, LynxConfigError, LynxPlanError
from lynx.solvers.problem import (
    Assignment,
    SolveResult,
    StageProblem,
    exposed_recompute_s,
    required_recompute_closure,
    group_key,
    group_ranks,
    kept_bytes,
    microbatch_classes,
    on_demand_transient_bytes,
    peak_activation_bytes,
    prefetched_bytes,
)

__all__ = [
    "solve_opt",
    "budget_error",
    "check_time_limit",
    "ModelItem",
    "ModelClass",
    "StageModel",
    "ModelSolution",
    "model_from_problem",
    "solve_model",
    "expand_solution",
]

# OPTIMAL means proven within this relative gap (the customary MIP tolerance, as Gurobi's
# and CPLEX's defaults); the exact gap is reported in SolveResult.gap.
RELATIVE_GAP = 1e-4

ProgressFn = Callable[[float, float, float], None]  # (elapsed_s, objective_s, bound_s)


@dataclass(frozen=True)
class ModelItem:
    nodes: tuple[str, ...]  # stage nodes decided together (bundled helpers, replicated layers)
    mult: int  # identical replicas (layers) the item stands for
    saved_bytes: int  # per replica
    recompute_s: float  # per replica
    inputs: tuple[tuple[int, bool], ...]  # (item index, input is in an earlier group)
    output_saved: bool
    group: int  # transient group (one layer or edge block, regenerated at once)


@dataclass(frozen=True)
class ModelClass:
    count: int  # microbatches in the class
    capacities: tuple[float, ...]  # per window position, in time order
    eligible: tuple[frozenset[int] | None, ...]  # items allowed in each window (None: all)


@dataclass(frozen=True)
class StageModel:
    items: tuple[ModelItem, ...]
    classes: tuple[ModelClass, ...]
    in_flight: int
    budget_bytes: int


@dataclass(frozen=True)
class ModelSolution:
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    recompute: tuple[bool, ...]  # per item
    placement: tuple[tuple[int | None, ...], ...]  # per class, per item: window position or None
    objective_s: float  # exposed seconds (or peak bytes when minimising memory)
    bound_s: float
    search_time_s: float


def _contract(problem: StageProblem) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Shrink the model without changing what it can express (up to rounding).

    Zero-byte nodes that do not keep their output are recomputed exactly when a consumer
    is. Those too cheap to register in the objective (views, transposes) become transparent:
    their consumers read their inputs directly. One with a single consumer in its own group
    is bundled with that consumer (recomputed in the same window). Returns node → bundle
    head, and transparent node → its (resolved) inputs.
    """
    total = sum(n.recompute_s for n in problem.nodes) or 1.0
    consumers: dict[str, list[str]] = {n.name: [] for n in problem.nodes}
    by_name = {n.name: n for n in problem.nodes}
    for n in problem.nodes:
        for src in n.inputs:
            if src in consumers:
                consumers[src].append(n.name)
    head = {n.name: n.name for n in problem.nodes}
    transparent: dict[str, tuple[str, ...]] = {}
    candidates = []
    for n in problem.nodes:
        outs = consumers[n.name]
        if n.saved_bytes or n.output_saved or not outs:
            continue
        if any(by_name[c].layer != n.layer or by_name[c].layer_class != n.layer_class for c in outs):
            continue  # (same group_key, compared without formatting strings)
        if n.recompute_s < 1e-4 * total:  # a view or transpose: negligible next to the stage
            transparent[n.name] = n.inputs
        else:
            candidates.append(n)
    for n in candidates:
        outs = consumers[n.name]
        if len(outs) == 1 and outs[0] not in transparent:
            head[n.name] = outs[0]
    for name in reversed([n.name for n in problem.nodes]):  # chains: follow to the last head
        if head[name] != name:
            head[name] = head[head[name]]
    return head, transparent


def model_from_problem(problem: StageProblem) -> StageModel:
    """Items from contracted nodes; microbatches grouped into classes of identical windows."""
    head, transparent = _contract(problem)
    ranks = group_ranks(problem)
    by_name = {n.name: n for n in problem.nodes}
    heads = [n.name for n in problem.nodes if head[n.name] == n.name and n.name not in transparent]
    index = {h: i for i, h in enumerate(heads)}
    members: dict[str, list[str]] = {h: [] for h in heads}
    for n in problem.nodes:
        if n.name not in transparent:
            members[head[n.name]].append(n.name)

    def resolve(src: str) -> set[str]:  # in-stage producers seen through transparent nodes
        if src not in by_name:
            return set()
        if src in transparent:
            return set().union(*(resolve(s) for s in transparent[src])) if transparent[src] else set()
        return {head[src]}

    items = []
    for h in heads:
        nodes = members[h]
        inner = set(nodes)
        srcs: set[str] = set()
        for name in nodes:
            for src in by_name[name].inputs:
                srcs |= resolve(src)
        srcs -= {h}
        srcs = {s for s in srcs if s not in inner}
        g = ranks[group_key(by_name[h])]
        inputs = tuple(sorted((index[s], ranks[group_key(by_name[s])] != g) for s in srcs))
        items.append(
            ModelItem(
                nodes=tuple(nodes),
                mult=1,
                saved_bytes=sum(by_name[x].saved_bytes for x in nodes),
                recompute_s=sum(by_name[x].recompute_s for x in nodes),
                inputs=inputs,
                output_saved=by_name[h].output_saved,
                group=g,
            )
        )
    layer_of = [by_name[h].layer for h in heads]
    classes = []
    for mc in microbatch_classes(problem):
        eligible = tuple(
            None if layers is None else frozenset(i for i, layer in enumerate(layer_of) if layer in layers)
            for layers in mc.eligible_layers
        )
        classes.append(ModelClass(len(mc.members), mc.capacities, eligible))
    return StageModel(tuple(items), tuple(classes), problem.in_flight, problem.activation_budget_bytes)


def _free_items(model: StageModel) -> list[bool]:
    """Items worth deciding: dropping them frees memory, or a consumer may need them dropped."""
    needed_by_drop = [False] * len(model.items)
    for item in model.items:
        for src, _ in item.inputs:
            if not model.items[src].output_saved:
                needed_by_drop[src] = True
    free = [it.saved_bytes > 0 or needed_by_drop[i] for i, it in enumerate(model.items)]
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
    coarse = max(1, model.budget_bytes // 2**26, max((it.mult * it.saved_bytes for it in model.items), default=1) // 2**40)
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
) -> ModelSolution:
    """Build and solve the CP-SAT model; ``minimise`` is "exposed" or "memory" (no budget).

    ``deterministic_limit`` caps CP-SAT's deterministic time (work units independent of
    machine load), so a short search gives the same answer on every run.
    """
    start = time.perf_counter()
    items, classes = model.items, model.classes
    total_cost = sum(it.mult * it.recompute_s for it in items) or 1.0
    tau = total_cost / 1e6  # seconds per time unit
    unit = _byte_unit(model)
    mem_w = [-(-it.mult * it.saved_bytes // unit) for it in items]  # ceil: never optimistic
    mem_t = [-(-it.saved_bytes // unit) for it in items]
    cost = [round(it.mult * it.recompute_s / tau) for it in items]
    budget = model.budget_bytes // unit
    total_w = sum(mem_w)

    m = cp_model.CpModel()
    free = _free_items(model)
    r = [m.new_bool_var(f"r{i}") if free[i] else m.new_constant(0) for i in range(len(items))]
    x: list[dict[tuple[int, int], cp_model.IntVar]] = []
    od: list[list] = []
    for c, cls in enumerate(classes):
        xc = {}
        for k, elig in enumerate(cls.eligible):
            for i in range(len(items)):
                if free[i] and (elig is None or i in elig):
                    xc[i, k] = m.new_bool_var(f"x{c}_{i}_{k}")
        x.append(xc)
        odc = []
        for i in range(len(items)):
            placed = [xc[i, k] for k in range(len(cls.capacities)) if (i, k) in xc]
            if placed:
                m.add(sum(placed) <= r[i])
            odc.append(r[i] - sum(placed))
        od.append(odc)

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
                for c, cls in enumerate(classes):
                    xc = x[c]
                    for k in range(len(cls.capacities)):
                        if (i, k) in xc:
                            m.add(xc[i, k] <= xc[u, k]) if (u, k) in xc else m.add(xc[i, k] == 0)
                    m.add(od[c][i] <= od[c][u])
                continue
            for c, cls in enumerate(classes):
                xc = x[c]
                for k in range(len(cls.capacities)):
                    if (i, k) in xc:  # placed in window k: u kept or placed in a window <= k
                        before = [xc[u, q] for q in range(k + 1) if (u, q) in xc]
                        m.add(xc[i, k] <= 1 - r[u] + sum(before))
                if cross:  # on demand for c: u kept or prefetched for c
                    upre = [xc[u, q] for q in range(len(cls.capacities)) if (u, q) in xc]
                    m.add(od[c][i] <= 1 - r[u] + sum(upre))

    # memory
    P = m.new_int_var(0, sum(mem_w), "prefetched")
    T = m.new_int_var(0, max(sum(mem_t), 0), "transient")
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        if free[i] and mem_t[i] > 0:
            groups.setdefault(item.group, []).append(i)
    for c, cls in enumerate(classes):
        if x[c]:
            m.add(P >= sum(mem_w[i] * v for (i, _), v in x[c].items()))
    for members in groups.values():
        if classes:
            for c in range(len(classes)):
                m.add(T >= sum(mem_t[i] * od[c][i] for i in members))
        else:
            m.add(T >= sum(mem_t[i] * r[i] for i in members))
    peak = model.in_flight * (total_w - sum(mem_w[i] * r[i] for i in range(len(items)) if free[i])) + P + T

    # exposed time
    exposed_terms = []
    for c, cls in enumerate(classes):
        terms = [cost[i] * od[c][i] for i in range(len(items)) if free[i] and cost[i]]
        for k, cap in enumerate(cls.capacities):
            load = [cost[i] * v for (i, q), v in x[c].items() if q == k and cost[i]]
            if load:
                ov = m.new_int_var(0, sum(cost), f"o{c}_{k}")
                m.add(ov >= sum(load) - round(cap / tau))
                terms.append(ov)
        if terms:
            exposed_terms.append(cls.count * sum(terms))
    exposed = sum(exposed_terms) if exposed_terms else 0

    if minimise == "memory":
        m.minimize(peak)
        scale = float(unit)
    else:
        m.add(peak <= budget)
        m.minimize(exposed)
        scale = tau

    if hint is not None:
        rec, plc = hint
        for i in range(len(items)):
            if free[i]:
                m.add_hint(r[i], bool(rec[i]))
        for c, xc in enumerate(x):
            for (i, k), v in xc.items():
                m.add_hint(v, plc[c][i] == k)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.001, time_limit_s - (time.perf_counter() - start))
    solver.parameters.num_workers = workers
    if deterministic_limit is not None:
        solver.parameters.max_deterministic_time = deterministic_limit
    solver.parameters.random_seed = 0
    solver.parameters.relative_gap_limit = RELATIVE_GAP
    solver.parameters.linearization_level = 2  # cuts: proves these knapsack-like models far faster
    if workers > 1:
        solver.parameters.interleave_search = True  # deterministic with several workers
    callback = _Progress(progress, scale, start) if progress else None
    code = solver.solve(m, callback) if callback else solver.solve(m)
    status = solver.status_name(code)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound = solver.best_objective_bound * scale if code == cp_model.UNKNOWN else math.inf
        return ModelSolution(status, (), (), math.inf, bound, time.perf_counter() - start)
    rec = tuple(bool(solver.value(v)) for v in r)
    placement = []
    for c, cls in enumerate(classes):
        where = [None] * len(items)
        for (i, k), v in x[c].items():
            if solver.value(v):
                where[i] = k
        placement.append(tuple(where))
    return ModelSolution(
        status,
        rec,
        tuple(placement),
        solver.objective_value * scale,
        solver.best_objective_bound * scale,
        time.perf_counter() - start,
    )


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, fn: ProgressFn, scale: float, start: float) -> None:
        super().__init__()
        self._fn, self._scale, self._start = fn, scale, start

    def on_solution_callback(self) -> None:
        self._fn(time.perf_counter() - self._start, self.objective_value * self._scale, self.best_objective_bound * self._scale)


# --------------------------------------------------------------------------- OPT


def check_time_limit(time_limit_s: float) -> None:
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise LynxConfigError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


def expand_solution(problem: StageProblem, model: StageModel, sol: ModelSolution) -> Assignment:
    """Per-node assignment from a solution of ``model_from_problem(problem)``.

    Transparent nodes (see :func:`_contract`) are recomputed when a consumer is, placed with
    their earliest consumer: in the earliest window any recomputed consumer uses, on demand
    only when every recomputed consumer is. (A view such as ``split`` feeding one consumer
    prefetched in a window and another regenerated on demand must run in that window; it
    saves no bytes, so running early costs nothing.)
    """
    recompute = {name for item, dropped in zip(model.items, sol.recompute) if dropped for name in item.nodes}
    window_of: dict[tuple[str, int], str] = {}
    classes = microbatch_classes(problem)
    position: dict[tuple[str, int], int] = {}
    for mc, where in zip(classes, sol.placement):
        for item, k in zip(model.items, where):
            if k is not None:
                for name in item.nodes:
                    for mb, wid in zip(mc.members, mc.window_ids[k]):
                        window_of[name, mb] = wid
                        position[name, mb] = k
    extra = required_recompute_closure(problem, recompute) - recompute
    if extra:
        consumers: dict[str, list[str]] = {}
        for n in problem.nodes:
            for src in n.inputs:
                consumers.setdefault(src, []).append(n.name)
        for n in reversed(problem.nodes):
            if n.name not in extra:
                continue
            recompute.add(n.name)
            for mc in classes:
                for m_i, mb in enumerate(mc.members):
                    ks = [position.get((c, mb)) for c in consumers.get(n.name, ()) if c in recompute]
                    ks = [k for k in ks if k is not None]
                    if ks:
                        k = min(ks)
                        window_of[n.name, mb] = mc.window_ids[k][m_i]
                        position[n.name, mb] = k
    return Assignment(frozenset(recompute), window_of)


def _hint_from(problem: StageProblem, model: StageModel, assignment: Assignment):
    """Item values from an assignment (an item takes its bundle head's decision)."""
    rec = tuple(item.nodes[-1] in assignment.recompute for item in model.items)
    placement = []
    for mc in microbatch_classes(problem):
        first = mc.members[0]
        position = {ids[0]: k for k, ids in enumerate(mc.window_ids)}
        where = tuple(position.get(assignment.window_of.get((item.nodes[-1], first), ""), None) for item in model.items)
        placement.append(where)
    return rec, tuple(placement)


def solve_opt(
    problem: StageProblem,
    *,
    time_limit_s: float = 10.0,
    progress: ProgressFn | None = None,
    workers: int = 1,
    hint: Assignment | None = None,
) -> SolveResult:
    """Exact whole-stage solve; starts from HEU's plan (as a hint) unless ``hint`` is given.

    Status OPTIMAL (gap 0) or FEASIBLE with the relative gap to CP-SAT's bound when the time
    limit stops the search. Raises LynxBudgetError when no plan fits.
    """
    check_time_limit(time_limit_s)
    start = time.perf_counter()
    if hint is None:
        from lynx.solvers.heu import solve_heu  # local: heu builds on this module

        try:
            hint = solve_heu(problem).assignment
        except LynxBudgetError:
            hint = None
    model = model_from_problem(problem)
    remaining = time_limit_s - (time.perf_counter() - start)
    sol = solve_model(
        model,
        time_limit_s=max(remaining, 0.01),
        hint=_hint_from(problem, model, hint) if hint is not None else None,
        progress=progress,
        workers=workers,
    )
    if sol.status == "INFEASIBLE":
        raise budget_error(problem)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        if hint is None or peak_activation_bytes(problem, hint) > problem.activation_budget_bytes:
            raise LynxPlanError(
                f"stage {problem.stage}: OPT found no plan within time_limit_s={time_limit_s}; "
                f"raise the time limit or use solver='heu'"
            )
        exposed = exposed_recompute_s(problem, hint)
        gap = (exposed - sol.bound_s) / exposed if exposed > 0 and math.isfinite(sol.bound_s) else 0.0
        return SolveResult(hint, "FEASIBLE", exposed, max(gap, 0.0), time.perf_counter() - start)
    assignment = expand_solution(problem, model, sol)
    exposed = exposed_recompute_s(problem, assignment)
    gap = (sol.objective_s - sol.bound_s) / sol.objective_s if sol.objective_s > 0 else 0.0
    return SolveResult(assignment, sol.status, exposed, max(gap, 0.0), time.perf_counter() - start)


def _fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def budget_error(problem: StageProblem, *, time_limit_s: float = 5.0) -> LynxBudgetError:
    """A LynxBudgetError saying how much memory the leanest plan needs and what dominates it."""
    model = model_from_problem(problem)
    sol = solve_model(model, time_limit_s=time_limit_s, minimise="memory")
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        return LynxBudgetError(f"stage {problem.stage}: no plan fits the activation budget of {_fmt(problem.activation_budget_bytes)}")
    lean = expand_solution(problem, model, sol)
    peak = peak_activation_bytes(problem, lean)
    kept = kept_bytes(problem, lean)
    transient = on_demand_transient_bytes(problem, lean)
    prefetched = max(prefetched_bytes(problem, lean).values(), default=0)
    biggest = sorted((n for n in problem.nodes if n.name not in lean.recompute), key=lambda n: -n.saved_bytes)[:3]
    parts = {
        f"{problem.in_flight} microbatches in flight x {_fmt(kept)} kept each "
        f"(largest kept: {', '.join(f'{n.name} {_fmt(n.saved_bytes)}' for n in biggest) or 'none'})": problem.in_flight * kept,
        f"{_fmt(transient)} regenerated on demand for one layer": transient,
        f"{_fmt(prefetched)} prefetched for one microbatch": prefetched,
    }
    dominant = max(parts, key=parts.get)
    bound = "" if sol.status == "OPTIMAL" else " (at most; the search stopped early)"
    return LynxBudgetError(
        f"stage {problem.stage}: no plan fits the activation budget of {_fmt(problem.activation_budget_bytes)}; "
        f"the leanest plan needs {_fmt(peak)}{bound}, dominated by {dominant}. "
        f"Raise memory_budget by at least {_fmt(peak - problem.activation_budget_bytes)}, "
        f"use more pipeline stages, or fewer microbatches in flight"
    )
