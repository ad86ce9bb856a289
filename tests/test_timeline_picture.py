"""The plan's detailed timeline (what `lynx show` draws): microbatch labels, forward and backward
apart, recomputation hidden vs exposed, communication where a stage waits for it."""

from __future__ import annotations

import pytest

import lynx
from lynx.planner.comm import CommModel
from lynx.planner.loop import plan_graph
from lynx.planner.synthetic import synthetic_graph
from lynx.viz import draw_timeline, timeline_detail  # noqa: F401 - timeline_detail is what the plan holds


def _plan(comm: CommModel, budget: str = "80GiB", solver: str = "none"):
    config = lynx.CompileConfig(pp=2, microbatches=4, solver=solver, memory_budget=budget)
    return plan_graph(synthetic_graph(layers=4), config, comm=comm)


def test_every_forward_and_backward_is_labelled_with_its_microbatch():
    plan = _plan(CommModel.free())
    for stage in range(2):
        labels = [label for s, kind, _, _, label in plan.timeline_detail if s == stage and kind == "forward"]
        assert sorted(set(labels)) == ["F0", "F1", "F2", "F3"]
        labels = [label for s, kind, _, _, label in plan.timeline_detail if s == stage and kind == "backward"]
        assert sorted(set(labels)) == ["B0", "B1", "B2", "B3"]
    assert not any(kind == "comm" for _, kind, *_ in plan.timeline_detail)   # free links: nothing waited for


def test_a_slow_link_is_drawn_where_the_next_stage_waits_for_it():
    slow = CommModel(p2p=lambda n: 2e-3, tp_allreduce=lambda n: 0.0, dp_gradients=lambda n: 0.0)
    plan = _plan(slow)
    comm = [(s, label) for s, kind, _, _, label in plan.timeline_detail if kind == "comm"]
    assert (1, "a0") in comm          # stage 1 waits for microbatch 0's activation
    assert any(s == 0 and label.startswith("g") for s, label in comm)   # stage 0 for gradients
    for s, kind, start, end, _ in plan.timeline_detail:    # inside the step, never overlapping its lane
        assert 0 <= start < end <= plan.predicted.step_time_s + 1e-12


def test_recomputation_is_split_into_hidden_and_exposed(tmp_path):
    slow = CommModel(p2p=lambda n: 2e-3, tp_allreduce=lambda n: 0.0, dp_gradients=lambda n: 0.0)
    keep_all = _plan(slow)
    budget = int(keep_all.predicted.peak_memory_bytes[0] * 0.8)
    plan = _plan(slow, budget=budget, solver="heu")
    kinds = {kind for _, kind, *_ in plan.timeline_detail}
    assert "recompute hidden" in kinds
    hidden = sum(e - s for st, kind, s, e, _ in plan.timeline_detail if kind == "recompute hidden")
    exposed = sum(e - s for st, kind, s, e, _ in plan.timeline_detail if kind == "recompute exposed")
    mismatch = abs(hidden - plan.predicted.hidden_recompute_s) + abs(exposed - plan.predicted.exposed_recompute_s)
    assert mismatch < 1e-9, (hidden, exposed, plan.predicted)
    labels = {label for _, kind, _, _, label in plan.timeline_detail if kind.startswith("recompute")}
    assert labels and all(label.startswith("R") and label[1:].isdigit() for label in labels)
    written = draw_timeline(plan.timeline, plan.predicted.step_time_s, tmp_path / "t", detail=plan.timeline_detail)
    assert all(p.stat().st_size > 0 for p in written)


def test_the_runtime_cost_is_its_own_bar_kind(tmp_path):
    from lynx.planner.hardware import get_hardware
    from lynx.viz import stage_totals

    spec = get_hardware("cpu-local").model_copy(update={"runtime_action_s": 1e-4})
    config = lynx.CompileConfig(pp=2, microbatches=4, solver="none", memory_budget="80GiB", hardware=spec)
    plan = plan_graph(synthetic_graph(layers=4), config)
    runtime = [(s, label) for s, kind, _, _, label in plan.timeline_detail if kind == "runtime"]
    # labelled by the compute action they belong to (its own share, and the posts before it)
    assert {label for s, label in runtime if s == 0} == {f"F{j}" for j in range(4)} | {f"B{j}" for j in range(4)}
    totals = stage_totals(plan.timeline, plan.predicted.step_time_s)
    for stage in (0, 1):   # 4 F, 4 B and 8 sends and receives per stage
        assert totals[stage]["runtime"] == pytest.approx(16 * 1e-4)
    written = draw_timeline(plan.timeline, plan.predicted.step_time_s, tmp_path / "t", detail=plan.timeline_detail)
    assert all(p.stat().st_size > 0 for p in written)
