"""What every solver checks before and says after a search: time limits and budget errors.

:func:`budget_error` asks CP-SAT for the leanest plan of a stage whose budget no plan meets and
says how much memory it needs and what dominates it, so the error tells the user what to change.

Example::

    >>> from lynx.solvers.budget import check_time_limit
    >>> check_time_limit(5.0)
    >>> check_time_limit(0)
    Traceback (most recent call last):
    ...
    lynx.errors.LynxConfigError: time_limit_s must be a positive number of seconds, got 0
"""

from __future__ import annotations

import math

from lynx.errors import LynxBudgetError, LynxConfigError
from lynx.solvers.memory import kept_bytes, on_demand_transient_bytes, peak_upper_bound_bytes, prefetched_bytes
from lynx.solvers.problem import StageProblem
from lynx.units import format_size as _fmt

__all__ = ["check_time_limit", "budget_error"]


def check_time_limit(time_limit_s: float) -> None:
    """Raise LynxConfigError unless ``time_limit_s`` is a positive, finite number of seconds."""
    if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise LynxConfigError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


def budget_error(problem: StageProblem, *, time_limit_s: float = 5.0) -> LynxBudgetError:
    """A LynxBudgetError saying how much memory the leanest plan needs and what dominates it."""
    from lynx.solvers.cpsat import solve_model  # OR-tools only on this error path
    from lynx.solvers.stage_model import expand_solution, model_from_problem

    model = model_from_problem(problem)
    sol = solve_model(model, time_limit_s=time_limit_s, minimise="memory")
    if sol.status not in ("OPTIMAL", "FEASIBLE"):
        return LynxBudgetError(
            f"stage {problem.stage}: no plan fits the activation budget of {_fmt(problem.activation_budget_bytes)}"
        )
    lean = expand_solution(problem, model, sol)
    # what the solvers must fit (their bound, never below the runtime's predicted peak)
    peak = peak_upper_bound_bytes(problem, lean)
    kept = kept_bytes(problem, lean)
    transient = on_demand_transient_bytes(problem, lean)
    prefetched = max(prefetched_bytes(problem, lean).values(), default=0)
    biggest = sorted((n for n in problem.nodes if n.name not in lean.recompute), key=lambda n: -n.saved_bytes)[:3]
    parts = {
        f"{problem.in_flight} microbatches in flight x {_fmt(kept)} kept each "
        f"(largest kept: {', '.join(f'{n.name} {_fmt(n.saved_bytes)}' for n in biggest) or 'none'})": problem.in_flight
        * kept,
        f"{_fmt(transient)} regenerated on demand for one layer": transient,
        f"{_fmt(prefetched)} prefetched for one microbatch": prefetched,
    }
    dominant = max(parts, key=parts.__getitem__)
    bound = "" if sol.status == "OPTIMAL" else " (at most; the search stopped early)"
    return LynxBudgetError(
        f"stage {problem.stage}: no plan fits the activation budget of {_fmt(problem.activation_budget_bytes)}; "
        f"the leanest plan needs {_fmt(peak)}{bound}, dominated by {dominant}. "
        f"Raise memory_budget by at least {_fmt(peak - problem.activation_budget_bytes)}, "
        f"use more pipeline stages, or fewer microbatches in flight"
    )
