"""Offload baselines, scored by the same simulator as every plan: PipeOffload's policy and Megatron's.

Both need copy lanes (``offload=True``) and recompute nothing; what the first-backpropagated
group reads is prefetched in each microbatch's slot, the rest streamed during the backward,
as Lynx's plans do (:mod:`lynx.solvers.offload`). A policy that does not fit the budget is
returned with status ``INFEASIBLE``, as the other baselines are.

* ``offload-all`` — PipeOffload (Wan et al., ICML 2025; ``sail-sg/zero-bubble``): offload every
  activation that can be, on every stage holding more than one microbatch (the last stage's
  backward follows its forward: nothing to gain there).
* ``offload-modules`` — Megatron-core's fine-grained activation offloading
  (``--fine-grained-activation-offloading --offload-modules``): the activations of chosen
  modules, here ``attn_norm``, ``core_attn`` and ``mlp_norm`` (the layer norms' inputs — the
  residual stream — and core attention: QKᵀ, softmax, attention dropout, ·V).

Example::

    >>> from lynx.solvers.cpsat_offload import with_copies
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = with_copies(make_uniform_problem(layers=2, microbatches=2, in_flight=2))
    >>> res = solve_offload_all(p)
    >>> len(res.assignment.offload) > len(solve_offload_modules(p).assignment.offload) > 0
    True
"""

from __future__ import annotations

import time

from lynx.errors import LynxConfigError
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import host_bytes, offloadable, slot_prefetch, total_exposed_s
from lynx.solvers.problem import Assignment, SolveResult, StageProblem

__all__ = ["solve_offload_all", "solve_offload_modules", "MEGATRON_MODULES", "offload_assignment"]

# Megatron's module names for what the offload-modules baseline copies (see the module docstring)
MEGATRON_MODULES = ("attn_norm", "core_attn", "mlp_norm")


def offload_assignment(problem: StageProblem, names: frozenset[str] | set[str]) -> Assignment:
    """Offload ``names``: what the first group reads prefetched in each slot, the rest streamed."""
    copies = problem.copies
    if copies is None:
        raise LynxConfigError(f"stage {problem.stage}: offload baselines need copy lanes: plan with offload=True")
    return Assignment(frozenset(), {}, frozenset(names), slot_prefetch(problem, names))


def _result(problem: StageProblem, names: set[str], start: float) -> SolveResult:
    assignment = offload_assignment(problem, names)
    copies = problem.copies
    assert copies is not None
    fits = (peak_activation_bytes(problem, assignment) <= problem.activation_budget_bytes
            and host_bytes(problem, assignment) <= copies.host_budget_bytes)
    return SolveResult(assignment, "FEASIBLE" if fits else "INFEASIBLE", total_exposed_s(problem, assignment), None,
                       time.perf_counter() - start)


def solve_offload_all(problem: StageProblem, **_: object) -> SolveResult:
    start = time.perf_counter()
    names = set(offloadable(problem)) if problem.in_flight > 1 else set()
    if problem.copies is None:
        raise LynxConfigError(f"stage {problem.stage}: solver 'offload-all' needs copy lanes: plan with offload=True")
    return _result(problem, names, start)


def _megatron_module(name: str, core_attention: bool) -> bool:
    """Whether a node belongs to one of :data:`MEGATRON_MODULES`: core attention, or a layer norm
    (whose saved input is the residual stream)."""
    return core_attention or "norm" in name


def solve_offload_modules(problem: StageProblem, **_: object) -> SolveResult:
    start = time.perf_counter()
    if problem.copies is None:
        raise LynxConfigError(f"stage {problem.stage}: solver 'offload-modules' needs copy lanes: plan with "
                              "offload=True")
    can = set(offloadable(problem)) if problem.in_flight > 1 else set()
    names = {n.name for n in problem.nodes if n.name in can and n.layer is not None
             and _megatron_module(n.name, n.core_attention)}
    return _result(problem, names, start)
