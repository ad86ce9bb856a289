"""OPT: the exact whole-stage solve (CP-SAT).

:func:`solve_opt` contracts the stage (:func:`~lynx.solvers.stage_model.model_from_problem`),
starts CP-SAT (:func:`~lynx.solvers.cpsat.solve_model`) from HEU's plan as a hint, and
expands the solution back to nodes (validated: an invalid expansion — a modelling bug — is
never returned; HEU's plan is, with a warning). Status OPTIMAL (within ``RELATIVE_GAP``) or FEASIBLE
with the gap to CP-SAT's bound when the time limit stops the search. The budget error
every solver raises is :func:`lynx.solvers.budget.budget_error`.

Example::

    >>> from lynx.solvers.synthetic import make_uniform_problem
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

from lynx.errors import LynxBudgetError, LynxPlanError
from lynx.solvers.budget import budget_error, check_time_limit
from lynx.solvers.cpsat import ProgressFn, solve_model
from lynx.solvers.heu.solve import solve_heu
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import host_bytes, total_exposed_s
from lynx.solvers.problem import Assignment, SolveResult, StageProblem
from lynx.solvers.stage_model import expand_solution, hint_from_assignment, model_from_problem
from lynx.solvers.validate import validate

__all__ = ["solve_opt"]


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
        exposed = total_exposed_s(problem, hint)
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
        exposed = total_exposed_s(problem, hint)
        gap = (exposed - sol.bound_s) / exposed if exposed > 0 and math.isfinite(sol.bound_s) else 0.0
        return SolveResult(hint, "FEASIBLE", exposed, max(gap, 0.0), time.perf_counter() - start)
    exposed = total_exposed_s(problem, assignment)
    gap = (sol.objective_s - sol.bound_s) / sol.objective_s if sol.objective_s > 0 else 0.0
    return SolveResult(assignment, sol.status, exposed, max(gap, 0.0), time.perf_counter() - start)


def _usable(problem: StageProblem, assignment: Assignment) -> bool:
    """Valid and within the activation budget."""
    try:
        validate(problem, assignment)
    except LynxPlanError:
        return False
    if problem.copies is not None and host_bytes(problem, assignment) > problem.copies.host_budget_bytes:
        return False
    return peak_activation_bytes(problem, assignment) <= problem.activation_budget_bytes
