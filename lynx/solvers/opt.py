"""OPT: the exact whole-stage solve (CP-SAT), and the budget error every solver raises.

:func:`solve_opt` contracts the stage (:func:`~lynx.solvers.opt_model.model_from_problem`),
starts CP-SAT (:func:`~lynx.solvers.opt_cpsat.solve_model`) from HEU's plan as a hint, and
expands the solution back to nodes (validated: an invalid expansion — a modelling bug — is
never returned; HEU's plan is, with a warning). Status OPTIMAL (within ``RELATIVE_GAP``) or FEASIBLE
with the gap to CP-SAT's bound when the time limit stops the search. :func:`budget_error`
says how much memory the leanest plan needs and what dominates it. The model's pieces are
re-exported here (``from lynx.solvers.opt import solve_model`` keeps working).

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
import warnings

from lynx.errors import LynxBudgetError, LynxConfigError, LynxPlanError
from lynx.solvers.opt_cpsat import RELATIVE_GAP, ProgressFn, solve_model
from lynx.solvers.opt_model import (
    ModelClass,
    ModelItem,
    ModelSolution,
    StageModel,
    expand_solution,
    hint_from_assignment,
    model_from_problem,
)
from lynx.solvers.problem import (
    Assignment,
    SolveResult,
    StageProblem,
    exposed_recompute_s,
    kept_bytes,
    on_demand_transient_bytes,
    peak_activation_bytes,
    peak_upper_bound_bytes,
    prefetched_bytes,
    validate,
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
    "RELATIVE_GAP",
    "ProgressFn",
]


def check_time_limit(time_limit_s: float) -> None:
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise LynxConfigError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


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
        hint=hint_from_assignment(problem, model, hint) if hint is not None else None,
        progress=progress,
        workers=workers,
    )
    if sol.status == "INFEASIBLE":
        raise budget_error(problem)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        if hint is None or not _usable(problem, hint):
            raise LynxPlanError(
                f"stage {problem.stage}: OPT found no plan within time_limit_s={time_limit_s}; "
                f"raise the time limit or use solver='heu'"
            )
        exposed = exposed_recompute_s(problem, hint)
        gap = (exposed - sol.bound_s) / exposed if exposed > 0 and math.isfinite(sol.bound_s) else 0.0
        return SolveResult(hint, "FEASIBLE", exposed, max(gap, 0.0), time.perf_counter() - start)
    assignment = expand_solution(problem, model, sol)
    try:
        validate(problem, assignment)
    except LynxPlanError as err:  # a modelling bug: never return it; say so and fall back to the hint
        if hint is None or not _usable(problem, hint):
            raise LynxPlanError(f"OPT's plan is invalid ({err}) and there is no valid plan to fall back to; "
                                f"use solver='heu' and report this") from None
        warnings.warn(f"OPT's plan is invalid ({err}); returning HEU's plan (status FEASIBLE) instead",
                      RuntimeWarning, stacklevel=2)
        exposed = exposed_recompute_s(problem, hint)
        gap = (exposed - sol.bound_s) / exposed if exposed > 0 and math.isfinite(sol.bound_s) else 0.0
        return SolveResult(hint, "FEASIBLE", exposed, max(gap, 0.0), time.perf_counter() - start)
    exposed = exposed_recompute_s(problem, assignment)
    gap = (sol.objective_s - sol.bound_s) / sol.objective_s if sol.objective_s > 0 else 0.0
    return SolveResult(assignment, sol.status, exposed, max(gap, 0.0), time.perf_counter() - start)


def _usable(problem: StageProblem, assignment: Assignment) -> bool:
    """Valid and within the activation budget."""
    try:
        validate(problem, assignment)
    except LynxPlanError:
        return False
    return peak_activation_bytes(problem, assignment) <= problem.activation_budget_bytes


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
    # what the solvers must fit (their bound, never below the runtime's predicted peak)
    peak = peak_upper_bound_bytes(problem, lean)
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
