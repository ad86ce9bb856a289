"""Stage solvers: decide, per pipeline stage, what to keep, what to recompute and where.

``solve(name, problem)`` runs one of :data:`SOLVERS` on a
:class:`~lynx.solvers.problem.StageProblem` and returns a
:class:`~lynx.solvers.problem.SolveResult`:

* ``opt`` — exact CP-SAT over the whole stage (:mod:`lynx.solvers.opt`)
* ``heu`` — representative layer, replicated, greedy fill (:mod:`lynx.solvers.heu.solve`)
* ``none``, ``full``, ``full-block``, ``selective`` — fixed policies (:mod:`lynx.solvers.baselines`)
* ``checkmate`` — ILP minimising on-demand recompute, no overlap (:mod:`lynx.solvers.checkmate`)

``progress``, when given, is called as ``progress(elapsed_s, objective_s, bound_s)`` on each
improving solution of the CP-SAT based solvers. A solver's module is imported on its first use
(:mod:`lynx.solvers.setup`: OPT's imports OR-tools, HEU's does not). Every result is validated
(:func:`~lynx.solvers.validate.validate`): an invalid plan raises ``LynxPlanError`` naming the
solver instead of being returned.

Example::

    >>> from lynx.solvers import solve
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=1.0)
    >>> solve("opt", p, time_limit_s=10.0).status
    'OPTIMAL'
"""

from __future__ import annotations

from collections.abc import Callable

from lynx.errors import LynxConfigError, LynxPlanError
from lynx.solvers.problem import SolveResult, StageProblem
from lynx.solvers.setup import REGISTRY, prepare
from lynx.solvers.validate import validate

__all__ = ["solve", "SOLVERS"]

SOLVERS: tuple[str, ...] = tuple(REGISTRY)


def solve(
    name: str,
    problem: StageProblem,
    *,
    time_limit_s: float = 10.0,
    progress: Callable[[float, float, float], None] | None = None,
) -> SolveResult:
    """Run solver ``name`` on one stage problem."""
    if name not in REGISTRY:
        raise LynxConfigError(f"unknown solver {name!r}; valid solvers: {', '.join(SOLVERS)}")
    from lynx.solvers.budget import check_time_limit

    check_time_limit(time_limit_s)
    fn = prepare(name)  # (imported on first use: see lynx.solvers.setup)
    result = fn(problem, time_limit_s=time_limit_s, progress=progress)
    try:  # every plan is checked here, so an invalid one never reaches a caller unnoticed
        validate(problem, result.assignment)
    except LynxPlanError as err:
        raise LynxPlanError(f"solver {name!r} returned an invalid plan: {err}. This is a bug in the solver; "
                            f"try another solver (e.g. 'heu' or 'full') and report it") from None
    return result
