"""Baselines scored by the same simulator as OPT and HEU: none, Megatron full / block, selective.

Every baseline recomputes on demand (no windows). A fixed policy that does not fit the
budget is still returned, with status ``INFEASIBLE`` (the simulator reports it as not
fitting); one that fits has status ``FEASIBLE``.

* ``none`` — keep everything.
* ``full`` — Megatron ``--recompute-granularity full --recompute-method uniform``: keep each
  layer's inputs (the outputs of earlier groups it reads), recompute every other node of
  every layer on demand; edge blocks are kept.
* ``full-block`` — Megatron ``--recompute-method block``: recompute the first N layers of the
  stage fully, keep the rest; the smallest N that fits.
* ``selective`` — Megatron ``--recompute-granularity selective``: recompute core attention
  (QKᵀ, softmax, attention dropout, ·V) on demand.

Example::

    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.baselines import solve_full
    >>> p = make_uniform_problem(layers=4, in_flight=4, budget_fraction=0.3)
    >>> solve_full(p).status
    'FEASIBLE'
"""

from __future__ import annotations

import time

from lynx.solvers.exposed import exposed_recompute_s
from lynx.solvers.problem import Assignment, SolveResult, StageProblem, group_key, group_ranks
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.validate import required_recompute_closure

__all__ = ["solve_none", "solve_full", "solve_full_block", "solve_selective", "make_valid", "layer_recompute_set"]


def make_valid(problem: StageProblem, recompute: set[str] | frozenset[str]) -> frozenset[str]:
    """A valid on-demand plan from ``recompute``: required producers added, offenders kept.

    Adds not-saved producers of the same group (they must be regenerated too). A node that
    reads an output of an earlier group which is dropped or not saved is kept instead (on
    demand, earlier groups are regenerated only after it), as is one that would need a kept
    node's unsaved output.
    """
    by_name = {n.name: n for n in problem.nodes}
    ranks = group_ranks(problem)
    banned: set[str] = set()
    while True:
        rec = set(required_recompute_closure(problem, set(recompute) - banned))
        bad = set()
        for name in rec:
            node = by_name[name]
            for src in node.inputs:
                producer = by_name.get(src)
                if producer is None:
                    continue
                cross = ranks[group_key(producer)] != ranks[group_key(node)]
                if (cross and (src in rec or not producer.output_saved)) or (
                    src in banned and not producer.output_saved
                ):
                    bad.add(name)
        if not bad:
            return frozenset(rec)
        banned |= bad


def layer_recompute_set(problem: StageProblem, layers: set[int] | None = None) -> frozenset[str]:
    """Megatron full recomputation of ``layers`` (all when None): keep what later groups read."""
    by_name = {n.name: n for n in problem.nodes}
    read_later = {
        src for n in problem.nodes for src in n.inputs if src in by_name and group_key(by_name[src]) != group_key(n)
    }
    chosen = {
        n.name
        for n in problem.nodes
        if n.layer is not None and (layers is None or n.layer in layers) and n.name not in read_later
    }
    return make_valid(problem, chosen)


def _result(problem: StageProblem, recompute: frozenset[str], start: float) -> SolveResult:
    assignment = Assignment(recompute, {})
    fits = peak_activation_bytes(problem, assignment) <= problem.activation_budget_bytes
    return SolveResult(
        assignment,
        "FEASIBLE" if fits else "INFEASIBLE",
        exposed_recompute_s(problem, assignment),
        None,
        time.perf_counter() - start,
    )


def solve_none(problem: StageProblem, **_: object) -> SolveResult:
    return _result(problem, frozenset(), time.perf_counter())


def solve_full(problem: StageProblem, **_: object) -> SolveResult:
    start = time.perf_counter()
    return _result(problem, layer_recompute_set(problem), start)


def solve_full_block(problem: StageProblem, **_: object) -> SolveResult:
    start = time.perf_counter()
    layers = sorted({n.layer for n in problem.nodes if n.layer is not None})
    recompute: frozenset[str] = frozenset()
    for count in range(len(layers) + 1):
        recompute = layer_recompute_set(problem, set(layers[:count])) if count else frozenset()
        if peak_activation_bytes(problem, Assignment(recompute, {})) <= problem.activation_budget_bytes:
            break
    return _result(problem, recompute, start)


def solve_selective(problem: StageProblem, **_: object) -> SolveResult:
    start = time.perf_counter()
    return _result(problem, make_valid(problem, {n.name for n in problem.nodes if n.core_attention}), start)
