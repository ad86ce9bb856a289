"""OPT, HEU and the offload baselines decide keep / recompute / offload together, under the device
and host budgets, and every plan is valid and scored by the same accounting."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.config import CompileConfig
from lynx.errors import LynxBudgetError, LynxConfigError
from lynx.planner.comm import CommModel
from lynx.planner.loop import plan_graph_outcome
from lynx.planner.synthetic import synthetic_graph
from lynx.solvers import solve
from lynx.solvers.cpsat_offload import with_copies
from lynx.solvers.heu.offload import boundaries, choose_offload
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import host_bytes, offloadable, total_exposed_s
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import validate


def _tight(fraction=0.3, bytes_per_s=2e11, **copies):
    return with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=4, budget_fraction=fraction),
                       bytes_per_s=bytes_per_s, **copies)


def _check(p, res):
    validate(p, res.assignment)
    assert peak_activation_bytes(p, res.assignment) <= p.activation_budget_bytes
    assert host_bytes(p, res.assignment) <= p.copies.host_budget_bytes


def test_opt_and_heu_offload_what_recomputation_would_expose() -> None:
    p = _tight()
    plain = dataclasses.replace(p, copies=None)
    for name in ("opt", "heu"):
        without, with_ = solve(name, plain, time_limit_s=10), solve(name, p, time_limit_s=10)
        _check(p, with_)
        assert with_.assignment.offload and not (with_.assignment.offload & with_.assignment.recompute)
        assert total_exposed_s(p, with_.assignment) < without.objective_s
    opt, heu = solve("opt", p, time_limit_s=10), solve("heu", p, time_limit_s=10)
    assert opt.status == "OPTIMAL" and opt.objective_s <= heu.objective_s + 1e-12


def test_a_slow_link_or_a_small_host_leaves_offload_out() -> None:
    slow = _tight(bytes_per_s=1e6)   # a copy of a layer's bytes would take seconds
    res = solve("opt", slow, time_limit_s=10)
    _check(slow, res)
    assert not res.assignment.offload
    small = _tight(host_budget_bytes=1)
    for name in ("opt", "heu"):
        res = solve(name, small, time_limit_s=10)
        _check(small, res)
        assert not res.assignment.offload


def test_heu_offload_sets_keep_identical_layers_identical() -> None:
    p = _tight()
    by = {n.name: n for n in p.nodes}
    for chosen in (choose_offload(p, 1.0), choose_offload(p, 0.5), boundaries(p),
                   choose_offload(p, 0.9, boundaries(p))):
        per_layer: dict[int, list[int]] = {}
        for n in p.nodes:
            if n.layer is not None and n.layer < 3:   # (the top layer reads in its slot: its own room)
                per_layer.setdefault(n.layer, []).append(int(n.name in chosen))
        assert len({tuple(v) for v in per_layer.values()}) == 1
        assert chosen <= set(offloadable(p)) and all(by[n].saved_bytes > 0 for n in chosen)


def test_seeded_offload_sets_take_the_boundaries_first() -> None:
    p = _tight()
    bounds = boundaries(p)
    seeded = choose_offload(p, 0.9, bounds)
    assert bounds and bounds < seeded <= set(offloadable(p))


def test_offload_baselines() -> None:
    p = _tight(fraction=1.0)
    every, modules = solve("offload-all", p), solve("offload-modules", p)
    assert every.assignment.offload == frozenset(offloadable(p))
    assert modules.assignment.offload < every.assignment.offload and not modules.assignment.recompute
    assert every.status == "FEASIBLE"
    with pytest.raises(LynxConfigError, match="offload=True"):
        solve("offload-all", dataclasses.replace(p, copies=None))
    with pytest.raises(LynxConfigError, match="offload baseline"):
        CompileConfig(solver="offload-all")


def test_plans_with_offload_end_to_end_on_a_synthetic_pipeline() -> None:
    g, cfg, comm, full = _synthetic_pipeline_at_level_03()
    heu = plan_graph_outcome(g, cfg, comm=comm)
    recompute_only = plan_graph_outcome(g, cfg.replace(offload=False), comm=comm)
    assert heu.plan.predicted.fits_budget and heu.sim.step_time_s <= recompute_only.sim.step_time_s * (1 + 1e-9)
    assert heu.plan.config["offload"] is True and "offload" in heu.plan.config
    for solver in ("offload-all", "offload-modules"):
        out = plan_graph_outcome(g, cfg.replace(solver=solver), comm=comm, check_budget=False)
        assert any(d.action == "offload" for s in out.plan.stages for d in s.decisions)


def test_opt_charges_copy_latency_only_when_something_is_copied() -> None:
    # a pending term whose drain is negative (copy latency beyond the lane's time, as tiny
    # models get) must not hold memory when nothing is offloaded: OPT plans as without lanes
    p = _tight(fraction=0.5)
    groups = len({(n.layer, n.layer_class) for n in p.nodes})
    p = dataclasses.replace(p, copies=dataclasses.replace(p.copies, pending=(((1,) * groups, -2.0 * 2**40),)))
    plain = solve("opt", dataclasses.replace(p, copies=None), time_limit_s=10)
    res = solve("opt", p, time_limit_s=10)
    _check(p, res)
    assert not res.assignment.offload and res.objective_s <= plain.objective_s + 1e-12


def test_a_stage_holding_one_microbatch_offloads_what_drains_by_its_backward() -> None:
    """In flight 1 (the backward follows the forward): HEU offloads, node by node, only what the
    D2H lane copies out by the forward's end — the early layers, never the last one — and OPT's
    model, which decides identical layers as one item, offloads nothing there."""
    p = with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=1, budget_fraction=0.3),
                    bytes_per_s=2e10)
    assert p.copies is not None
    for chosen in (choose_offload(p, 1.0), boundaries(p), choose_offload(p, 0.9, boundaries(p))):
        layers = {n.layer for n in p.nodes if n.name in chosen}
        assert chosen and 0 in layers and 3 not in layers
        per_group = [0] * 4
        for n in p.nodes:
            if n.name in chosen:
                per_group[n.layer] += n.saved_bytes
        assert p.copies.drains_by_backward(per_group)
    heu = solve("heu", p, time_limit_s=10)
    _check(p, heu)
    assert heu.objective_s <= solve("heu", dataclasses.replace(p, copies=None), time_limit_s=10).objective_s + 1e-12
    assert not solve("opt", p, time_limit_s=10).assignment.offload


def test_heu_hands_back_its_plan_without_offload_and_the_loop_scores_it() -> None:
    # a stage's objective cannot see that a backward that copies runs whole (its input
    # gradients sent after its weight part): HEU hands back the plan it solved without offload
    # first, and the planner keeps it where the pipeline runs it faster (then goes on without)
    p = _tight()
    res = solve("heu", p, time_limit_s=10)
    assert res.assignment.offload and res.without_offload is not None
    assert not res.without_offload.assignment.offload
    validate(p, res.without_offload.assignment)
    assert peak_activation_bytes(p, res.without_offload.assignment) <= p.activation_budget_bytes

    g, cfg, comm, full = _synthetic_pipeline_at_level_03()
    with_copies_asked: list[bool] = []

    def worse_with_offload(name, problem, **kw):   # the offload plan made the slowest there is
        with_copies_asked.append(problem.copies is not None)
        if problem.copies is None:
            return solve(name, problem, **kw)
        plain = solve(name, dataclasses.replace(problem, copies=None), **kw)
        return dataclasses.replace(solve("full", problem, **kw), without_offload=plain)

    out = plan_graph_outcome(g, cfg, comm=comm, solve=worse_with_offload)
    assert out.sim.step_time_s < full.sim.step_time_s * (1 - 1e-3)
    assert not any(r.assignment.offload for r in out.results)
    assert with_copies_asked[0] and not with_copies_asked[-1]


def test_offload_plans_that_miss_the_budget_in_their_first_round_get_a_second() -> None:
    # the first round's problems estimate the copies pending at a backward's start from a replay
    # without offload: a plan filled to the budget can miss it there. The loop then solves once
    # more from the offload replay before it gives offload up for the plans without it.
    g, cfg, comm, _ = _synthetic_pipeline_at_level_03()
    rounds: list[bool] = []

    def missing_once(name, problem, **kw):   # the first offload round's plans keep everything
        res = solve(name, problem, **kw)
        if problem.copies is None:
            return res
        if problem.stage == 0:
            rounds.append(True)
        if len(rounds) == 1 and res.assignment.offload:
            keep_all = dataclasses.replace(res.assignment, recompute=frozenset(), window_of={})
            return dataclasses.replace(res, assignment=keep_all)
        return res

    out = plan_graph_outcome(g, cfg, comm=comm, solve=missing_once)
    assert len(rounds) >= 2
    assert out.sim.fits_budget and any(r.assignment.offload for r in out.results)


def _synthetic_pipeline_at_level_03():
    """An 8-layer synthetic graph on pp 2 × 8 microbatches (a100-80g), HEU with offload at a budget
    0.3 of the way from ``full``'s peak to ``none``'s: the graph, the config, the comm model, and
    ``full``'s outcome."""
    from lynx.planner.hardware import get_hardware

    g = synthetic_graph(layers=8)
    hw = get_hardware("a100-80g")
    base = CompileConfig(pp=2, microbatches=8, hardware=hw, solver="none", memory_budget=2**40)
    comm = CommModel.from_hardware(hw, tp=1, dp=1, optimizer="adamw")
    none = plan_graph_outcome(g, base, comm=comm, check_budget=False)
    full = plan_graph_outcome(g, base.replace(solver="full"), comm=comm, check_budget=False)
    budget = int(max(full.sim.peak_memory_bytes) + 0.3 * (max(none.sim.peak_memory_bytes)
                                                            - max(full.sim.peak_memory_bytes)))
    return g, base.replace(memory_budget=budget, offload=True, solver="heu"), comm, full


@pytest.mark.parametrize("fraction", [0.075, 0.1, 0.15])
def test_heu_with_offload_never_returns_a_plan_over_its_budget(fraction: float) -> None:
    # at 7.5% the additive offload_overhead bound let a joined plan through at 1.44x the budget
    problem = with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=4, budget_fraction=fraction))
    try:
        result = solve("heu", problem)
    except LynxBudgetError:
        return   # (no plan: refused, as the leanest plan does not fit either)
    assert peak_activation_bytes(problem, result.assignment) <= problem.activation_budget_bytes
