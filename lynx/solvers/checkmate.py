"""Checkmate baseline: an ILP minimising on-demand recomputation under the budget, no overlap.

Jain et al. 2020 ("Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization") solve rematerialisation exactly as an integer program but recompute on
the critical path. Here: the OPT model (:mod:`lynx.solvers.opt`) with every window removed,
so all recomputation is on demand and the objective is Σ microbatches · recompute time.

Example::

    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.checkmate import solve_checkmate
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=4, budget_fraction=0.5)
    >>> solve_checkmate(p).status
    'OPTIMAL'
"""

from __future__ import annotations

import dataclasses
import time

from lynx.errors import LynxPlanError
from lynx.solvers.cpsat import ProgressFn, solve_model
from lynx.solvers.budget import budget_error, check_time_limit
from lynx.solvers.stage_model import expand_solution, model_from_problem
from lynx.solvers.exposed import exposed_recompute_s
from lynx.solvers.problem import SolveResult, StageProblem

__all__ = ["solve_checkmate", "without_windows"]


def without_windows(problem: StageProblem) -> StageProblem:
    """The same stage with no windows: the no-overlap problem Checkmate and knapsack solve."""
    return dataclasses.replace(problem, windows=())


def solve_checkmate(
    problem: StageProblem, *, time_limit_s: float = 10.0, progress: ProgressFn | None = None, workers: int = 1
) -> SolveResult:
    check_time_limit(time_limit_s)
    start = time.perf_counter()
    bare = without_windows(problem)
    model = model_from_problem(bare)
    sol = solve_model(model, time_limit_s=time_limit_s, progress=progress, workers=workers)
    if sol.status == "INFEASIBLE":
        raise budget_error(bare)
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        raise LynxPlanError(f"stage {problem.stage}: Checkmate found no plan within time_limit_s={time_limit_s}")
    assignment = expand_solution(bare, model, sol)
    gap = (sol.objective_s - sol.bound_s) / sol.objective_s if sol.objective_s > 0 else 0.0
    return SolveResult(
        assignment, sol.status, exposed_recompute_s(problem, assignment), max(gap, 0.0), time.perf_counter() - start
    )
