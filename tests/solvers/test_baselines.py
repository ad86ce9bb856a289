"""Baselines: Megatron full / block / selective, keep-all, Checkmate; the registry."""

import pytest

from lynx.errors import LynxBudgetError
from lynx.solvers import SOLVERS, solve
from lynx.solvers.problem import Assignment
from lynx.solvers.memory import kept_bytes, peak_activation_bytes
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import validate

DIMS = dict(hidden=256, heads=8, seq=512, micro_batch=1)


def test_registry_names():
    assert SOLVERS == ("opt", "heu", "none", "full", "full-block", "selective", "checkmate", "offload-all",
                       "offload-modules")


def test_none_keeps_everything_and_says_when_it_does_not_fit():
    tight = make_uniform_problem(layers=3, budget_fraction=0.5)
    roomy = make_uniform_problem(layers=3, budget_fraction=1.0)
    assert solve("none", tight).status == "INFEASIBLE"
    res = solve("none", roomy)
    assert res.status == "FEASIBLE" and res.objective_s == 0 and not res.assignment.recompute


def test_full_keeps_exactly_the_layer_inputs():
    layers, m = 4, 8
    p = make_uniform_problem(layers=layers, microbatches=m, in_flight=4, budget_fraction=1.0, views=True, **DIMS)
    res = solve("full", p)
    validate(p, res.assignment)
    s, b, h = DIMS["seq"], DIMS["micro_batch"], DIMS["hidden"]
    # Korthikanti: full recomputation keeps 2·s·b·h per layer (its input); the first layer's
    # input comes from the previous stage, so L-1 layer inputs live in this stage.
    assert kept_bytes(p, res.assignment) == (layers - 1) * 2 * s * b * h
    per_layer = sum(n.recompute_s for n in p.nodes if n.layer == 1)
    last_add = next(n for n in p.nodes if n.name == f"l{layers - 1}.add2")
    assert res.objective_s == pytest.approx(m * (layers * per_layer - (layers - 1) * last_add.recompute_s))
    assert not res.assignment.window_of


def test_full_block_is_the_smallest_block_that_fits():
    p = make_uniform_problem(layers=6, in_flight=4, budget_fraction=0.55, **DIMS)
    res = solve("full-block", p)
    validate(p, res.assignment)
    assert res.status == "FEASIBLE"
    layers_done = {n.layer for n in p.nodes if n.name in res.assignment.recompute}
    n = len(layers_done)
    assert layers_done == set(range(n))
    from lynx.solvers.baselines import layer_recompute_set

    fewer = Assignment(layer_recompute_set(p, set(range(n - 1))) if n > 1 else frozenset(), {})
    assert peak_activation_bytes(p, fewer) > p.activation_budget_bytes


def test_selective_recomputes_core_attention_on_demand():
    p = make_uniform_problem(layers=3, budget_fraction=1.0, views=True, **DIMS)
    res = solve("selective", p)
    validate(p, res.assignment)
    core = {n.name for n in p.nodes if n.core_attention}
    assert core <= res.assignment.recompute
    assert all(n.saved_bytes == 0 or n.core_attention for n in p.nodes if n.name in res.assignment.recompute)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_checkmate_no_worse_than_fixed_policies_and_no_better_than_opt(fraction):
    p = make_uniform_problem(layers=3, microbatches=4, in_flight=3, budget_fraction=fraction,
                             recv_grad_capacity_s=[0.002, 0, 0, 0.001], **DIMS)
    cm = solve("checkmate", p)
    validate(p, cm.assignment)
    assert not cm.assignment.window_of
    assert peak_activation_bytes(p, cm.assignment) <= p.activation_budget_bytes
    for name in ("full", "full-block", "selective", "none"):
        other = solve(name, p)
        if other.status == "FEASIBLE":
            assert cm.objective_s <= other.objective_s * (1 + 1e-4) + 1e-12, name
    assert solve("opt", p).objective_s <= cm.objective_s * (1 + 1e-4) + 1e-12


def test_checkmate_infeasible_budget():
    with pytest.raises(LynxBudgetError, match="leanest plan needs"):
        solve("checkmate", make_uniform_problem(layers=2, budget_fraction=0.01))
