"""HEU's polish: a small stage whose greedy plan exposes recompute is improved by a short,
deterministic CP-SAT search from it (found on gpt-1.3b pp 8, 32 microbatches, at `full`'s
peak, where the greedy selection trailed checkmate's exact one)."""

import pytest

import lynx.solvers.heu.solve as heu
from lynx.solvers import solve
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.validate import validate


def _problem():
    return make_uniform_problem(layers=2, microbatches=4, in_flight=2, budget_fraction=0.6)


def test_polish_reaches_the_optimum_the_greedy_misses(monkeypatch):
    p = _problem()
    heu.clear_cache()
    monkeypatch.setattr(heu, "POLISH_ITEMS", -1)
    greedy_only = solve("heu", p).objective_s
    monkeypatch.setattr(heu, "POLISH_ITEMS", 64)
    heu.clear_cache()
    polished = solve("heu", p)
    optimum = solve("opt", p, time_limit_s=10.0)
    validate(p, polished.assignment)
    assert peak_activation_bytes(p, polished.assignment) <= p.activation_budget_bytes
    assert greedy_only > polished.objective_s * 1.1  # the greedy alone is > 10% off here
    assert polished.objective_s == pytest.approx(optimum.objective_s, rel=1e-9)
    heu.clear_cache()
    assert solve("heu", p).assignment == polished.assignment  # deterministic
