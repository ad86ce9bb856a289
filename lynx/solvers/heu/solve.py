"""HEU: solve one representative layer, replicate it, fill what is left greedily.

0. A stage whose keep-all fits the budget keeps everything, at once: nothing is exposed, so
   no plan is better (its peak is ``in_flight`` × the stage's saved bytes).
1. Contract the stage as OPT does (:func:`lynx.solvers.opt.model_from_problem`) and find the
   family of structurally identical layers (:mod:`lynx.solvers.heu.layers`).
2. Build the reduced model (one item per family position, ``mult`` = family size; edge
   blocks and odd layers on their own; each microbatch class's windows merged into its
   layers' share) and solve it with three greedy policies (:mod:`lynx.solvers.heu.greedy`):
   *drop until it fits* (prefetching where that costs no peak), *keep while it fits*, and
   *drop until it fits, hiding every drop* (``POLICIES``); a tiny stage (``EXACT_ITEMS``)
   adds a short deterministic CP-SAT search on the representative model.
3. Replicate each policy to every family layer and realise it on the full model
   (:mod:`lynx.solvers.heu.realise`): the representative's prefetches window by window in time
   order, then keep more where memory is left and move on-demand recompute into windows with
   room, in both orders (and, where tensor-parallel windows serve only the layers below
   theirs, once more with the open windows taking first what no later window can:
   :func:`~lynx.solvers.heu.realise.fill`); the best realisation wins (a policy that adds nothing new, or comes
   after a realisation exposing nothing, is skipped). If none fits, the full model's layer
   boundaries (Megatron-full's memory) are realised the same way; if even that does not fit,
   the exact model is solved instead.
4. A plan that still exposes recompute while windows have room gets the drop-and-prefetch
   trade (:mod:`lynx.solvers.heu.trade`): refill the windows, then (a large stage with
   tensor-parallel windows) drop more cheap kept tensors into windows with spare capacity and
   spend the memory freed on prefetching what was exposed (kept only when it fits and exposes
   less). A small stage (``POLISH_ITEMS``) whose plan still exposes recompute is then
   polished by a short deterministic CP-SAT search from it.

On a device with several chunks, or with deferred weight gradients (interleaved 1F1B, ZB-H1:
:func:`lynx.solvers.memory_replay.replayed_beyond_bound`), the books count memory as the
replay does, per (chunk, microbatch) at each backward action (:mod:`lynx.solvers.heu.chunked`),
so the same steps plan against the real budget. Such a stage is not polished: the polish's
CP-SAT model bounds memory by the solvers' linear bound (``peak_upper_bound_bytes``: each
chunk's most microbatches in flight), looser than the books, and with a class per microbatch it
cost seconds per stage (gpt-2.7b pp 8 × 16 microbatches: 0.8–1.9 s against 0.07 s without) for
a few percent less exposed recompute on some ZB-H1 stages and none on interleaved ones.

The contraction and the layer families depend only on the stage's nodes, not on its
windows or budget, so they are cached per node set: the planner's fixed point re-solves the
same stages with re-derived windows. A stage solved again with the same windows and budget
(HEU is deterministic) returns the earlier result. :func:`clear_cache` empties both caches;
benchmarks call it to time cold solves. CP-SAT (the tiny stages' searches, the exact
fallback) is imported only when first used (:func:`lynx.solvers.setup.cpsat`): most plans
never import OR-tools, and one that does counts the import as setup, not search.

Example::

    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.validate import validate
    >>> from lynx.solvers.heu.solve import solve_heu
    >>> p = make_uniform_problem(layers=4, microbatches=8, in_flight=4, recv_grad_capacity_s=0.002)
    >>> res = solve_heu(p)
    >>> validate(p, res.assignment); res.status
    'HEURISTIC'
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from dataclasses import dataclass

from lynx.errors import LynxBudgetError, LynxPlanError
from lynx.solvers.heu.books import Books, Layout
from lynx.solvers.heu.chunked import full_layout, reduced_layout
from lynx.solvers.heu.greedy import boundary_kept, greedy, reverse_greedy
from lynx.solvers.heu.layers import Family, families, reduced, reduced_classes
from lynx.solvers.heu.offload import forget_winners, solve_heu_offload
from lynx.solvers.heu.realise import realise, reserves
from lynx.solvers.heu.trade import trade
from lynx.solvers.stage_model import (ModelClass, ModelSolution, StageModel, expand_solution, model_from_problem,
                                     windows_after)
from lynx.solvers.budget import budget_error
from lynx.solvers.stage_model import hint_from_assignment
from lynx.solvers.exposed import exposed_recompute_s
from lynx.solvers.problem import Assignment, SolveResult, StageProblem, microbatch_classes
from lynx.solvers.setup import cpsat
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.memory_replay import replayed_beyond_bound
from lynx.solvers.validate import validate

__all__ = ["solve_heu", "clear_cache"]

# The representative's greedy policies (see lynx.solvers.heu.greedy), each realised in both orders
_HIDE_ALL = functools.partial(reverse_greedy, hide=True)
POLICIES = (reverse_greedy, greedy, _HIDE_ALL)
OPTIONAL = (_HIDE_ALL,)  # realised only when its representative exposes less than the best plan so far
# A stage of at most this many items (a layer or two of a small model) also gets a short exact
# search on its representative model, when the greedy plans expose anything: there the greedy
# can be far from OPT in relative terms (if not in step time), and the search costs little.
EXACT_ITEMS = 40
EXACT_WORK = 0.05  # CP-SAT deterministic time units (load-independent, so plans are reproducible)
# A stage of at most this many items (three layers of a GPT) whose plan still exposes
# recompute is polished by a short deterministic CP-SAT search on the whole stage model: at a
# budget near `full`'s peak the greedy selection can be well off the exact one there, which is
# what checkmate finds (HEU against OPT per stage: benchmarks/results/solver_quality.md).
POLISH_ITEMS = 64
POLISH_WORK = 0.2  # CP-SAT deterministic time units
# Node sets whose structure is cached (a plan has one per stage; a grid a few hundred)
CACHE_SIZE = 64
# Results remembered per node set (the fixed point's iterations, a grid's budgets)
RESULTS_PER_STAGE = 16


@dataclass
class _Structure:
    """What HEU derives from a stage's nodes alone."""

    nodes: tuple  # the stage's nodes (the cache key)
    model: StageModel  # model_from_problem of the first problem seen with these nodes
    layer_of: list[int | None]  # per model item
    family: Family
    reduced: StageModel
    to_red: list[int]  # full item -> reduced item
    layout: Layout  # of the full model
    reduced_layout: Layout
    # results by (windows, microbatches, in_flight, budget, stage, time limit)
    results: dict[tuple, SolveResult] = dataclasses.field(default_factory=dict)


_CACHE: OrderedDict[int, list[_Structure]] = OrderedDict()  # by hash of the nodes, oldest first


def clear_cache() -> None:
    """Forget the cached stage structures (benchmarks time cold solves with it), and the offload
    sets chosen before (:mod:`lynx.solvers.heu.offload`)."""
    _CACHE.clear()
    forget_winners()


def _structure(problem: StageProblem) -> tuple[_Structure, StageModel, Layout, StageModel, Layout]:
    """The cached structure and, for this problem's windows and budget, the full and reduced
    models with their layouts."""
    digest = hash(problem.nodes)  # (once: a tuple of nodes does not cache its hash)
    cached = next((s for s in _CACHE.get(digest, ()) if s.nodes is problem.nodes or s.nodes == problem.nodes), None)
    if cached is None:
        model = model_from_problem(problem)
        by_name = {n.name: n for n in problem.nodes}
        fam = families(problem, model)
        red, to_red = reduced(model, fam)
        cached = _Structure(problem.nodes, model, [by_name[it.nodes[-1]].layer for it in model.items], fam, red,
                            to_red, Layout(model), Layout(red))
        _CACHE.setdefault(digest, []).append(cached)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
        return cached, model, cached.layout, red, cached.reduced_layout
    # Same nodes, other windows or budget: new classes on the cached items.
    classes = []
    for mc in microbatch_classes(problem):
        eligible = tuple(
            None if layers is None else frozenset(i for i, layer in enumerate(cached.layer_of) if layer in layers)
            for layers in mc.eligible_layers
        )
        classes.append(ModelClass(len(mc.members), mc.capacities, eligible, windows_after(problem, mc)))
    model = dataclasses.replace(cached.model, classes=tuple(classes), in_flight=problem.in_flight,
                                budget_bytes=problem.activation_budget_bytes)
    red = dataclasses.replace(cached.reduced, classes=reduced_classes(model, cached.to_red),
                              in_flight=problem.in_flight, budget_bytes=problem.activation_budget_bytes)
    return cached, model, cached.layout.for_model(model), red, cached.reduced_layout.for_model(red)


def solve_heu(problem: StageProblem, *, time_limit_s: float = 10.0, progress=None, exact: bool = True,
              quick: bool = False) -> SolveResult:
    """HEU plan for one stage (see module docstring); raises LynxBudgetError when none fits
    (``exact=False``: without trying the exact model first). ``quick``: the first policy only,
    no trade or polish (offload candidates, :mod:`lynx.solvers.heu.offload`). A stage with copy
    lanes (offload) is planned by :func:`lynx.solvers.heu.offload.solve_heu_offload`."""
    if problem.copies is not None:
        return solve_heu_offload(problem, solve_heu, time_limit_s=time_limit_s)
    return _solve(problem, time_limit_s=time_limit_s, exact=exact, quick=quick)


def _solve(problem: StageProblem, *, time_limit_s: float, exact: bool, quick: bool) -> SolveResult:
    start = time.perf_counter()
    beyond = replayed_beyond_bound(problem)
    if (peak_activation_bytes(problem, Assignment(frozenset())) if beyond
            else problem.in_flight * sum(n.saved_bytes for n in problem.nodes)) <= problem.activation_budget_bytes:
        # Keeping everything fits (its peak is in_flight × all saved bytes: lynx.solvers.memory)
        # and exposes nothing: no plan is better, and none needs the stage's structure.
        return SolveResult(Assignment(frozenset()), "HEURISTIC", 0.0, None, time.perf_counter() - start)
    cached, model, lay, red, red_lay = _structure(problem)
    if beyond:
        # Several chunks per device, or deferred W: the books count per (chunk, microbatch),
        # event by event, as the replay does (lynx.solvers.heu.chunked), not in_flight · kept.
        lay = full_layout(lay, problem)
        red_lay = reduced_layout(red_lay, lay, cached.to_red)
    # The planner's fixed point re-solves stages whose windows did not change: same answer.
    key = (problem.windows, problem.microbatches, problem.in_flight, problem.activation_budget_bytes, problem.stage,
           time_limit_s, quick, problem.actions)  # (the time limit matters only to the exact fallback)
    if key in cached.results:
        hit = cached.results[key]
        return dataclasses.replace(hit, search_time_s=time.perf_counter() - start)
    to_red = cached.to_red
    budget = problem.activation_budget_bytes
    seen: list[tuple[tuple[bool, ...], tuple[tuple[int | None, ...], ...]]] = []
    plans: list[tuple[Books, float]] = []  # every realisation, in order, with its exposed seconds
    best_exposed = float("inf")
    reserve = reserves(lay)  # windows that serve some layers only (tp): also fill reserving for them
    for policy in (POLICIES[0],) if quick else (*POLICIES, _exact):
        if best_exposed <= 1e-12:
            break  # nothing hidden better than nothing exposed
        if policy is _exact:
            if lay.n > EXACT_ITEMS or not seen:
                break
            found = _exact(red, seen[0], time_limit_s)
        else:
            rep = policy(red_lay, budget, give_up_at=best_exposed) if policy in OPTIONAL else policy(red_lay, budget)
            if rep is None or (policy in OPTIONAL and rep.exposed() >= best_exposed):
                continue  # (an optional policy only when the representative alone promises better)
            found = (tuple(rep.rec), tuple(tuple(w) for w in rep.where))
        if found is None or found in seen:
            continue  # the same policy realises the same way
        seen.append(found)
        rep_rec, rep_where = found
        base = [rep_rec[to_red[i]] for i in range(lay.n)]
        designated = [[where[to_red[i]] is not None for i in range(lay.n)] for where in rep_where]
        realised = realise(lay, list(base), budget, designated)
        if reserve:  # (after: on equal exposure the plain order's plan wins)
            realised += realise(lay, base, budget, designated, reserve=True)
        for books in realised:
            if books is not None:
                exposed = books.exposed()
                plans.append((books, exposed))
                if exposed < best_exposed - 1e-12:  # (the rule _by_exposed ranks by)
                    best_exposed = exposed
    for books in _by_exposed(plans):
        assignment = _checked(problem, model, books)
        if assignment is not None:
            break
    else:
        # No replicated policy fits (the representative misses a layer-specific need, e.g. an
        # input read across groups by another family layer): start from the full model's
        # layer boundaries (Megatron-full's memory) and fill windows and keep more from there.
        nothing = [[False] * lay.n for _ in lay.classes]
        plans = [(b, b.exposed()) for b in realise(lay, boundary_kept(lay), budget, nothing) if b is not None]
        whole = greedy(lay, budget)  # the greedy on the full model: slower, rare
        if whole is not None:
            placed = [[k is not None for k in where] for where in whole.where]
            plans += [(b, b.exposed()) for b in realise(lay, list(whole.rec), budget, placed) if b is not None]
        for books in _by_exposed(plans):
            assignment = _checked(problem, model, books)
            if assignment is not None:
                break
        else:
            if not exact:
                raise LynxBudgetError(f"stage {problem.stage}: HEU's greedy plans do not fit the budget")
            return _remember(cached, key, _fallback(problem, model, time_limit_s, start))
    exposed = exposed_recompute_s(problem, assignment)
    if exposed > 0 and not quick:
        assignment, exposed = _traded(problem, model, lay, books, assignment, exposed, reserve,
                                      drops=reserve and lay.n > POLISH_ITEMS)
    if exposed > 0 and lay.n <= POLISH_ITEMS and not quick and not beyond:
        assignment, exposed = _polish(problem, model, assignment, exposed, time_limit_s)
    result = SolveResult(assignment, "HEURISTIC", exposed, None, time.perf_counter() - start)
    return _remember(cached, key, result)


def _traded(problem: StageProblem, model: StageModel, lay: Layout, books: Books, assignment, exposed: float,
            reserve: bool, drops: bool):
    """The plan refilled after drop-and-prefetch trades (:func:`lynx.solvers.heu.trade.trade`),
    kept only when it fits and exposes less."""
    traded = trade(lay, books, problem.activation_budget_bytes, reserve=reserve, drops=drops)
    if traded is books:
        return assignment, exposed
    better = _checked(problem, model, traded)
    if better is None:
        return assignment, exposed
    better_exposed = exposed_recompute_s(problem, better)
    if better_exposed >= exposed - 1e-12:
        return assignment, exposed
    return better, better_exposed  # (built as the realisations are, from the same moves on the books)


def _polish(problem: StageProblem, model: StageModel, assignment, exposed: float, time_limit_s: float):
    """A small stage's plan improved by a short deterministic CP-SAT search on the whole
    stage model from it (kept only when valid, within the budget and exposing less)."""
    sol = cpsat().solve_model(model, time_limit_s=time_limit_s, hint=hint_from_assignment(problem, model, assignment),
                      deterministic_limit=POLISH_WORK)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        return assignment, exposed
    better = expand_solution(problem, model, sol)
    better_exposed = exposed_recompute_s(problem, better)
    if better_exposed >= exposed - 1e-12 or peak_activation_bytes(problem, better) > problem.activation_budget_bytes:
        return assignment, exposed
    try:
        validate(problem, better)
    except LynxPlanError:
        return assignment, exposed
    return better, better_exposed


def _exact(red: StageModel, hint: tuple, time_limit_s: float) -> tuple | None:
    """A short, deterministic CP-SAT search on a tiny stage's representative model, from the
    first greedy policy (None when it finds nothing)."""
    sol = cpsat().solve_model(red, time_limit_s=time_limit_s, hint=hint, deterministic_limit=EXACT_WORK)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        return None
    return tuple(sol.recompute), tuple(tuple(w) for w in sol.placement)


def _by_exposed(plans: list[tuple[Books, float]]) -> list[Books]:
    """Plans best first: the first of any that expose within 1e-12 s of each other wins."""
    order: list[Books] = []
    rest = list(plans)
    while rest:
        best = rest[0]
        for entry in rest[1:]:
            if entry[1] < best[1] - 1e-12:
                best = entry
        order.append(best[0])
        rest.remove(best)
    return order


def _checked(problem: StageProblem, model: StageModel, books: Books):
    """The plan's assignment, or None when the runtime's peak exceeds the budget.

    The books count ``in_flight · kept + P + T`` without two terms of the solvers' bound
    (:func:`lynx.solvers.memory.peak_upper_bound_bytes`): on-demand items a later group
    regenerates early (``saved_until``) and dropped outputs only a later stage saves
    (``sent``, held anyway). Plans that have neither are within that bound, hence within the
    runtime's peak; the others are checked at node level (rare: layer boundaries are kept), and
    so is every plan of a device whose replay the bound does not cover (several chunks, or
    deferred weight gradients: :func:`lynx.solvers.memory_replay.replayed_beyond_bound`).
    """
    msol = ModelSolution("HEURISTIC", tuple(books.rec), tuple(tuple(w) for w in books.where), 0.0, 0.0, 0.0)
    assignment = expand_solution(problem, model, msol)
    beyond = any(books.rec[i] and (it.sent or (it.saved_until is not None and any(w[i] is None for w in books.where)))
                 for i, it in enumerate(model.items))
    if beyond or replayed_beyond_bound(problem):
        if peak_activation_bytes(problem, assignment) > problem.activation_budget_bytes:
            return None
    return assignment


def _remember(cached: _Structure, key: tuple, result: SolveResult) -> SolveResult:
    if len(cached.results) >= RESULTS_PER_STAGE:
        cached.results.clear()
    cached.results[key] = result
    return result


def _fallback(problem: StageProblem, model: StageModel, time_limit_s: float, start: float) -> SolveResult:
    """The greedy could not realise a fitting plan: take the exact model's first good answer."""
    sol = cpsat().solve_model(model, time_limit_s=time_limit_s)
    if sol.status == "INFEASIBLE":
        raise budget_error(problem)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        raise LynxBudgetError(f"stage {problem.stage}: HEU found no plan within the budget in {time_limit_s} s")
    assignment = expand_solution(problem, model, sol)
    exposed = exposed_recompute_s(problem, assignment)
    return SolveResult(assignment, "HEURISTIC", exposed, None, time.perf_counter() - start)
