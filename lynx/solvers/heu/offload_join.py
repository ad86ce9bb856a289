"""Joining an offload set with the recompute plan of what it leaves on the device (HEU with offload).

:func:`rest_problem` is the recompute problem of the values ``chosen`` leaves on the device;
:func:`with_offload` solves it and :func:`joined` puts the two together: a window may not
recompute from a value that comes back only during the backward (:func:`on_demand_readers`),
and the whole plan is checked — valid, its exact peak within the stage's budget, the host
budget held. :func:`raised` solves the rest again with the budget the joined plan's exact peak
leaves. Used by :func:`lynx.solvers.heu.offload.solve_heu_offload`.

Example::

    >>> from lynx.solvers.cpsat_offload import with_copies
    >>> from lynx.solvers.heu.solve import solve_heu
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=4, budget_fraction=0.3))
    >>> chosen = frozenset(n.name for n in p.nodes if n.name.endswith("fc1"))
    >>> found = with_offload(p, chosen, rest_problem(p, chosen, p.activation_budget_bytes), solve_heu, 10.0)
    >>> found is None or found[1].offload <= chosen
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lynx.errors import LynxBudgetError, LynxPlanError
from lynx.solvers.heu.offload_exact import lean
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import (group_layout, host_bytes, issue_group, read_groups, slot_prefetch, streamed_before,
                                  total_exposed_s)
from lynx.solvers.problem import Assignment, SolveResult, StageProblem
from lynx.solvers.validate import uncounted_output, validate

__all__ = ["rest_problem", "lean_fits", "with_offload", "raised", "joined", "on_demand_readers", "RAISE_SLACK"]

# the least share of the stage's budget the joined plan must leave for :func:`raised` to spend a
# solve on it (gpt-20b's cold search at level 0.3 left 5–6% per stage and gained 2.6 of 34.8 ms
# there, at 1.3× the search time)
RAISE_SLACK = 0.125


def on_demand_readers(problem: StageProblem, recompute: frozenset[str], window_of: dict, streamed: set[str]
                       ) -> dict:
    """``window_of`` without the placements that read a streamed value issued after their
    window (all but tensor-parallel windows after the issue: :func:`streamed_before`), or
    (transitively) a value of the same microbatch recomputed on demand, or whose output no
    byte count covers while a reader of it is recomputed on demand (:func:`uncounted_output`)."""
    inputs = {n.name: n.inputs for n in problem.nodes}
    total = sum(n.recompute_s for n in problem.nodes)
    readers: dict[str, list[str]] = {}   # per placed node whose output is uncounted, its recomputed readers
    for n in problem.nodes:
        for src in n.inputs:
            if n.name in recompute:
                readers.setdefault(src, []).append(n.name)
    uncounted = {n.name for n in problem.nodes if n.name in recompute and uncounted_output(n, total)}
    watch: dict[str, tuple[str, ...]] = {}   # per placed node, the inputs that can unplace it
    for name, _mb in window_of:
        if name not in watch:
            watch[name] = tuple(src for src in inputs[name] if src in streamed or src in recompute)
    placed = [key for key in window_of if watch[key[0]] or key[0] in uncounted]
    late = {(src, window_of[key]) for key in placed for src in watch[key[0]] if src in streamed}
    late = {pair for pair in late if not streamed_before(problem, *pair)}   # (issued after the window)
    changed = True
    while changed:
        changed = False
        for key in placed:
            name, mb = key
            if key in window_of and (any((src in streamed and (src, window_of[key]) in late)
                                         or (src in recompute and (src, mb) not in window_of)
                                         for src in watch[name])
                                     or name in uncounted and any((c, mb) not in window_of
                                                                  for c in readers.get(name, ()))):
                del window_of[key]
                changed = True
    return window_of


def rest_problem(problem: StageProblem, chosen: frozenset[str], budget: int) -> StageProblem:
    """The recompute problem of what ``chosen`` leaves on the device (see the module docstring):
    ``budget`` is the stage's less what offloading can add to a backward (``offload_overhead``;
    :func:`lean_fits` says whether its leanest plan fits)."""
    nodes = tuple(dataclasses.replace(n, saved_bytes=0, output_bytes=None if n.output_bytes is None else 0)
                  if n.name in chosen else n for n in problem.nodes)
    return dataclasses.replace(problem, nodes=nodes, copies=None, activation_budget_bytes=budget)


def lean_fits(problem: StageProblem, chosen: frozenset[str], rest: StageProblem) -> bool:
    """Whether the leanest plan of ``rest`` (Megatron-full's kept set) fits its budget."""
    return peak_activation_bytes(rest, Assignment(lean(problem) - chosen)) <= rest.activation_budget_bytes


def with_offload(problem: StageProblem, chosen: frozenset[str], rest: StageProblem,
                  solve_plain: Callable[..., SolveResult], time_limit_s: float,
                  quick: bool = False, exact: bool = False) -> tuple[float, Assignment] | None:
    """The recompute plan of ``rest`` with ``chosen`` offloaded, joined and checked (None: no fit);
    ``exact``: ``rest``'s budget is :func:`~lynx.solvers.heu.offload_exact.exact_left`'s, which
    covers the leanest plan only — the joined plan is checked whole, and the leanest is the fallback."""
    try:   # (no exact model for a candidate)
        res = solve_plain(rest, time_limit_s=time_limit_s, exact=False, quick=quick)
    except LynxBudgetError:
        res = None
    if exact:
        found = joined(problem, chosen, res.assignment) if res is not None else None
        if found is None:
            found = joined(problem, chosen, Assignment(lean(problem) - chosen))
        return found
    if res is None:
        return None
    return joined(problem, chosen, res.assignment)


def raised(problem: StageProblem, chosen: frozenset[str], left: int, best: tuple[float, Assignment],
            solve_plain: Callable[..., SolveResult], time_limit_s: float) -> tuple[float, Assignment]:
    """``best`` (``chosen`` offloaded, its rest solved with budget ``left``), or the rest solved
    again with ``left`` raised by what the joined plan's exact peak leaves of the stage's budget
    where that exposes less (the joined plan checked whole: :func:`joined`). Once: a second raise
    gained ≤ 0.002 of the step on nine grid points and costs another solve."""
    if best[0] <= 1e-12:
        return best   # (nothing exposed: nothing to gain)
    slack = problem.activation_budget_bytes - peak_activation_bytes(problem, best[1])
    if slack < problem.activation_budget_bytes * RAISE_SLACK:
        return best
    found = with_offload(problem, chosen, rest_problem(problem, chosen, left + slack), solve_plain, time_limit_s)
    return found if found is not None and found[0] < best[0] - 1e-12 else best


def joined(problem: StageProblem, chosen: frozenset[str], plan: Assignment) -> tuple[float, Assignment] | None:
    """``plan`` (of the rest) with ``chosen`` offloaded, checked: valid and its exact peak within
    the budget (None: no fit). :func:`~lynx.solvers.offload.offload_overhead` does not bound what
    offloading adds to the rest's peak in every case (a synthetic stage at 7.5% of its saved bytes
    came out at 1.44× its budget unchecked), and the check costs no measurable search time."""
    recompute = plan.recompute
    offload = chosen - recompute   # a zero-byte helper recomputed with its consumer is recomputed
    layout, reads = group_layout(problem), read_groups(problem)
    copies = problem.copies
    assert copies is not None
    prefetch = slot_prefetch(problem, offload)
    # a window may not recompute from a value that comes back only during the backward (but a
    # TP window after its issue): there, recompute on demand instead — and so what reads that
    streamed = {n for n in offload if issue_group(reads[n], layout) >= 0}
    window_of = on_demand_readers(problem, recompute, dict(plan.window_of), streamed)
    assignment = Assignment(recompute, window_of, offload, prefetch)
    if host_bytes(problem, assignment) > copies.host_budget_bytes:
        return None
    try:
        validate(problem, assignment)
    except LynxPlanError:
        return None
    if peak_activation_bytes(problem, assignment) > problem.activation_budget_bytes:
        return None
    return total_exposed_s(problem, assignment), assignment
