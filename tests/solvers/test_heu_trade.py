"""HEU's drop-and-prefetch trade (lynx.solvers.heu.trade).

Where memory, not window room, limits prefetching, dropping more cheap kept tensors into
windows with spare capacity frees memory for prefetching exposed recompute (found on gpt-20b
a100 pp4 tp4 at budget level 0.3, stage 0: 8.35 -> 7.28 ms exposed; OPT 7.05 ms in 60 s).
"""

import pytest

import lynx.solvers.heu.solve as heu
from lynx.solvers.heu.books import Books, Layout
from lynx.solvers.heu.trade import trade
from lynx.solvers.stage_model import model_from_problem
from lynx.solvers.problem import exposed_recompute_s
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.validate import validate


def _problem():
    # six layers (more items than the polish takes), two microbatches in flight, tp windows
    # serving the layers below theirs: 2.99 -> 2.42 ms exposed with the trade
    return make_uniform_problem(layers=6, microbatches=4, in_flight=2, budget_fraction=0.5,
                                recv_grad_capacity_s=0.001, tp_capacity_s=0.0002)


def test_the_trade_hides_more_than_the_greedy_alone(monkeypatch):
    p = _problem()
    heu.clear_cache()
    with_trade = heu.solve_heu(p)
    validate(p, with_trade.assignment)
    assert peak_activation_bytes(p, with_trade.assignment) <= p.activation_budget_bytes
    assert with_trade.objective_s == pytest.approx(exposed_recompute_s(p, with_trade.assignment))
    monkeypatch.setattr(heu, "trade", lambda lay, books, budget, reserve=False, drops=True: books)
    heu.clear_cache()
    without = heu.solve_heu(p)
    heu.clear_cache()
    assert with_trade.objective_s < without.objective_s - 1e-6


def test_nothing_exposed_nothing_traded():
    p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=0.001)
    lay = Layout(model_from_problem(p))
    books = Books(lay, [False] * lay.n)
    assert trade(lay, books, p.activation_budget_bytes) is books


def test_a_trade_never_exposes_more_nor_exceeds_the_budget():
    p = _problem()
    lay = Layout(model_from_problem(p))
    from lynx.solvers.heu.greedy import greedy

    books = greedy(lay, p.activation_budget_bytes)
    assert books is not None
    out = trade(lay, books, p.activation_budget_bytes)
    assert out.exposed() <= books.exposed() + 1e-12
    assert out.peak() <= p.activation_budget_bytes
