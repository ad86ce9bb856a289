"""HEU with offload solves the winning set's rest again with the budget the exact peak leaves."""

from __future__ import annotations

import pytest

from lynx.solvers.cpsat_offload import with_copies
from lynx.solvers.heu import offload as heu_offload
from lynx.solvers.heu import offload_join
from lynx.solvers.heu.solve import clear_cache, solve_heu
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import host_bytes, total_exposed_s
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import validate


def _stage(fraction: float):
    return with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=4, budget_fraction=fraction))


def _solved(p, raise_: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(heu_offload, "raised", offload_join.raised if raise_ else lambda *args: args[3])
    monkeypatch.setattr(heu_offload, "exact_fill", lambda problem, assignment: assignment)   # (raised alone)
    heu_offload.forget_winners()
    clear_cache()
    return solve_heu(p)


def test_the_rest_gets_the_budget_the_joined_plans_exact_peak_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    # at 10% of its saved bytes the additive offload_overhead leaves the rest a quarter of the
    # budget unused by the exact peak; solved again with it, the rest recomputes less
    p = _stage(0.1)
    once = _solved(p, False, monkeypatch)
    again = _solved(p, True, monkeypatch)
    budget = p.activation_budget_bytes
    assert peak_activation_bytes(p, once.assignment) < 0.8 * budget
    assert again.objective_s < once.objective_s - 1e-4
    validate(p, again.assignment)
    assert peak_activation_bytes(p, again.assignment) <= budget
    assert host_bytes(p, again.assignment) <= p.copies.host_budget_bytes
    assert again.objective_s == pytest.approx(total_exposed_s(p, again.assignment))
    assert again.assignment.offload   # still a plan with offload


def test_raising_keeps_a_plan_that_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _stage(0.25)
    once = _solved(p, False, monkeypatch)
    again = _solved(p, True, monkeypatch)
    assert again.assignment == once.assignment


def test_a_raise_needs_slack_worth_a_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _stage(0.1)
    once = _solved(p, False, monkeypatch)
    slack = 1 - peak_activation_bytes(p, once.assignment) / p.activation_budget_bytes
    monkeypatch.setattr(offload_join, "RAISE_SLACK", slack + 0.01)
    assert _solved(p, True, monkeypatch).assignment == once.assignment
