"""The exposed recomputation of a stage's plan, as the solvers compare plans: on-demand seconds
plus window overflow — under zero bubble, each part of the split backward re-running what it
needs on demand.

A device that defers its weight gradients (:func:`~lynx.solvers.problem.defers_weights`) runs
each backward as two generated graphs; each re-runs the dropped values it needs, ``W`` what
``I`` did not hand over — a value ``I`` re-ran only for a consumer, or for its statistics
alone, is re-run again (:func:`~lynx.solvers.memory_weights.regenerated_nodes`). So a
microbatch's on-demand seconds are each part's re-runs, and a node both re-run counts twice;
the timeline charges the same seconds to ``I`` and ``W`` (``lynx.planner.problems.loads_from_assignments``).
Otherwise this is :func:`lynx.solvers.problem.exposed_recompute_s`.

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=1, microbatches=2, in_flight=1)
    >>> exposed_recompute_s(p, Assignment(recompute=frozenset()))
    0.0
"""

from __future__ import annotations

from collections.abc import Iterator

from lynx.solvers.memory_replay import chunk_problems
from lynx.solvers.memory_weights import regenerated_nodes
from lynx.solvers.problem import Assignment, StageProblem, defers_weights
from lynx.solvers.problem import exposed_recompute_s as _once

__all__ = ["exposed_recompute_s", "split_on_demand_s", "split_reruns"]


def exposed_recompute_s(problem: StageProblem, assignment: Assignment) -> float:
    """Σ on-demand recompute over microbatches (under zero bubble, part by part) + Σ window
    overflow beyond capacity."""
    if not defers_weights(problem):
        return _once(problem, assignment)
    return _once(problem, assignment, on_demand=False) + split_on_demand_s(problem, assignment)


def split_on_demand_s(problem: StageProblem, assignment: Assignment) -> float:
    """A split backward's on-demand seconds over microbatches: what each part re-runs, chunk by
    chunk, given what was prefetched in windows for each microbatch."""
    cost = {n.name: n.recompute_s for n in problem.nodes}
    return sum(sum(cost[n] for n in in_i) + sum(cost[n] for n in in_w)
               for _, in_i, in_w in split_reruns(problem, assignment))


def split_reruns(problem: StageProblem,
                 assignment: Assignment) -> Iterator[tuple[int, frozenset[str], frozenset[str]]]:
    """``(microbatch, what I re-runs, what W re-runs)`` for each chunk of a split backward and each
    microbatch, given what was prefetched in windows for it (:func:`regenerated_nodes`, computed
    once per distinct prefetched set)."""
    for sub in chunk_problems(problem).values():
        names = {n.name for n in sub.nodes} & assignment.recompute
        found: dict[frozenset[str], tuple[frozenset[str], frozenset[str]]] = {}
        for mb in range(problem.microbatches):
            prefetched = frozenset(n for n in names if (n, mb) in assignment.window_of)
            if prefetched not in found:
                found[prefetched] = regenerated_nodes(sub, assignment, prefetched)
            yield (mb, *found[prefetched])
