"""Planning end to end: lynx.compile / plan_graph with the solver registry, budgets, plan reuse."""

from __future__ import annotations

import pytest

import lynx
from lynx.planner.fingerprint import graph_fingerprint
from lynx.planner.loop import plan_graph, plan_graph_outcome
from lynx.config import CompileConfig
from lynx.errors import LynxBudgetError, LynxConfigError, LynxFingerprintError
from lynx.planner.comm import CommModel
from lynx.plan import Plan
from lynx.planner.problems import assignment_from_decisions
from lynx.planner.synthetic import synthetic_graph
from lynx.solvers.validate import validate

FREE = CommModel.free()


def _cfg(**kw) -> CompileConfig:
    base = dict(pp=2, microbatches=4, memory_budget="80GiB", solver="heu", time_limit_s=10)
    base.update(kw)
    return CompileConfig(**base)


def test_plan_decisions_are_valid_and_scored_by_the_simulator() -> None:
    g = synthetic_graph(layers=4)
    none = plan_graph_outcome(g, _cfg(solver="none"), comm=FREE)
    full = plan_graph_outcome(g, _cfg(solver="full"), comm=FREE, pipeline=none.pipeline)
    budget = int(
        max(full.sim.peak_memory_bytes) + 0.3 * (max(none.sim.peak_memory_bytes) - max(full.sim.peak_memory_bytes))
    )
    heu = plan_graph_outcome(g, _cfg(memory_budget=budget), comm=FREE, pipeline=none.pipeline)
    assert heu.plan.predicted.fits_budget
    for problem, stage in zip(heu.problems, heu.plan.stages):
        validate(problem, assignment_from_decisions(stage.decisions, 4))
        assert stage.peak_memory_bytes <= budget
    assert heu.plan.predicted.step_time_s <= full.plan.predicted.step_time_s + 1e-12
    assert none.plan.predicted.exposed_recompute_s == 0.0
    assert full.plan.predicted.exposed_recompute_s > 0


def test_same_inputs_same_plan_and_save_load(tmp_path) -> None:
    g = synthetic_graph(layers=4)
    a = plan_graph(g, _cfg(memory_budget="3GiB"), comm=FREE)
    b = plan_graph(g, _cfg(memory_budget="3GiB"), comm=FREE)
    assert [s.decisions for s in a.stages] == [s.decisions for s in b.stages]
    assert a.fingerprint == b.fingerprint
    assert Plan.load(a.save(tmp_path / "p.json")) == a


def test_budget_no_plan_can_meet_says_what_dominates() -> None:
    g = synthetic_graph(layers=4)
    with pytest.raises(LynxBudgetError, match="below the static memory alone") as err:
        plan_graph(g, _cfg(memory_budget="1MiB"), comm=FREE)
    assert "optimizer state" in str(err.value)
    # above static memory but below what any plan's activations need
    none = plan_graph_outcome(g, _cfg(solver="none"), comm=FREE)
    tight = max(none.sim.static_bytes) + 1024
    with pytest.raises(LynxBudgetError, match=r"stage \d.*leanest plan needs") as err:
        plan_graph(g, _cfg(memory_budget=tight), comm=FREE)
    assert "leave" in str(err.value) and "for activations" in str(err.value)
    # a baseline is scored as it is and reports that it does not fit
    plan = plan_graph(g, _cfg(solver="none", memory_budget="1MiB"), comm=FREE)
    assert not plan.predicted.fits_budget


def test_more_stages_than_layers() -> None:
    with pytest.raises(LynxConfigError, match="only 4 layers"):
        plan_graph(synthetic_graph(layers=4), _cfg(pp=8, microbatches=8), comm=FREE)


@pytest.fixture(scope="module")
def tiny():
    model, inputs = lynx.models.build_preset("gpt-tiny", device="meta")
    return model, inputs


def test_compile_tiny_model_and_plan_reuse(tiny, tmp_path) -> None:
    model, inputs = tiny
    compiled = lynx.compile(model, inputs, pp=2, microbatches=4, hardware="cpu-local", solver="heu")
    assert isinstance(compiled.plan, lynx.Plan) and len(compiled.plan.stages) == 2
    assert compiled.config.target == "cpu"
    sim = lynx.simulate(compiled.plan, compiled.analysis.graph)
    assert sim.step_time_s == pytest.approx(compiled.plan.predicted.step_time_s)
    with pytest.raises(LynxConfigError, match="out of range"):
        compiled.stage(2)
    path = compiled.plan.save(tmp_path / "plan.json")
    again = lynx.compile(model, inputs, pp=2, microbatches=4, hardware="cpu-local", plan=str(path))
    assert again.plan == compiled.plan
    with pytest.raises(LynxFingerprintError, match="microbatches: plan 4, now 8"):
        lynx.compile(model, inputs, pp=2, microbatches=8, hardware="cpu-local", plan=path)
    config = lynx.CompileConfig(pp=2, microbatches=4, hardware="cpu-local")
    assert lynx.compile(model, inputs, config, solver="full").plan.solver == "full"


def test_compile_analysis_plans_other_layouts_from_one_capture(tiny) -> None:
    """lynx.compiler.compile_analysis: another pp × tp from the same analysis, which stays as it
    was (the tp layout marks a copy of the graph); a different target or hardware is refused."""
    from lynx.compiler import compile_analysis

    model, inputs = tiny
    compiled = lynx.compile(model, inputs, pp=2, microbatches=4, hardware="cpu-local", solver="none")
    before = graph_fingerprint(compiled.analysis.graph)
    sharded = compile_analysis(compiled.analysis, pp=1, tp=2, microbatches=4, hardware="cpu-local", solver="none")
    assert sharded.sharding is not None and sharded.analysis.captured is compiled.analysis.captured
    assert "tp_plan" in sharded.analysis.graph.graph and "tp_plan" not in compiled.analysis.graph.graph
    assert graph_fingerprint(compiled.analysis.graph) == before and len(sharded.plan.stages) == 1
    with pytest.raises(LynxConfigError, match="analyse the model again"):
        compile_analysis(compiled.analysis, pp=2, hardware="h100-sxm")


def test_fixed_point_stops_when_a_round_gains_under_a_tenth_of_a_percent() -> None:
    from lynx.planner.loop import CONVERGED_REL, _converged

    best = (False, 1.0, 10)
    assert _converged(best, (False, 1.0 - CONVERGED_REL / 2, 10))  # a tiny gain: settled
    assert not _converged(best, (False, 1.0 - 2 * CONVERGED_REL, 10))  # a real gain: go on
    assert not _converged((True, 1.0, 10), (False, 1.0, 10))  # the best did not fit: go on
    assert not _converged(best, (True, 0.5, 10))  # this round does not fit: go on


def test_fixed_point_goes_on_while_the_replay_exposes_other_than_the_solvers_predicted() -> None:
    from types import SimpleNamespace

    from lynx.planner.loop import CONVERGED_REL, _replay_agrees

    sim = SimpleNamespace(step_time_s=1.0, exposed_per_stage=[0.0500, 0.0200, 0.0])
    predicted = [SimpleNamespace(objective_s=x) for x in (0.0500, 0.0200 + CONVERGED_REL / 2, 0.0)]
    assert _replay_agrees(predicted, sim)  # the windows stopped moving: a small gain settles it
    moved = [SimpleNamespace(objective_s=x) for x in (0.0500, 0.0050, 0.0)]  # stage 1's windows moved
    assert not _replay_agrees(moved, sim)


def test_a_stage_whose_plan_still_hides_everything_is_not_solved_again() -> None:
    from lynx.solvers import solve

    calls = []

    def spy(name, problem, **kw):
        calls.append(problem.stage)
        return solve(name, problem, **kw)

    g = synthetic_graph(layers=4)
    # 1000 MiB: stage 0 recomputes, stage 1 keeps everything; round 2 re-solves stage 0 only
    out = plan_graph_outcome(g, _cfg(max_iterations=3, memory_budget=1000 * 2**20), comm=FREE, solve=spy)
    assert out.iterations == 2 and calls == [0, 1, 0]
    assert out.results[0].assignment.recompute and not out.results[1].assignment.recompute


def test_a_plan_that_recomputes_nothing_stops_after_one_round() -> None:
    """Nothing recomputed: the replay's windows are the ones solved for, a second round is moot."""
    out = plan_graph_outcome(synthetic_graph(layers=4), _cfg(max_iterations=3), comm=FREE)  # 80 GiB
    assert out.iterations == 1 and not any(r.assignment.recompute for r in out.results)
