"""Plan files: round trip, stage_schedule, corrupt / wrong-version files, fingerprint refusal."""

from __future__ import annotations

import json

import pytest

from lynx.errors import LynxFingerprintError, LynxPlanError
from lynx.planner.windows import WindowId
from lynx.plan import (
    SCHEMA_VERSION, Decision, Plan, Predicted, StagePlan, WindowRecord, check_fingerprint, fingerprint_of,
)
from lynx.planner.problems import assignment_from_decisions, decisions_from_assignment
from lynx.solvers.problem import Assignment
from lynx.solvers.synthetic import make_uniform_problem

CONFIG = {"pp": 1, "microbatches": 3, "schedule": "1f1b", "hardware": "h100-sxm"}


def _plan() -> Plan:
    windows = [WindowRecord(id=f"s0.recv_grad.mb{j}", stage=0, kind="recv_grad", microbatch=j, capacity_s=0.1)
               for j in range(3)]
    windows.insert(1, WindowRecord(id="s0.tp.l1.b.mb0", stage=0, kind="tp_allreduce", microbatch=0,
                                   capacity_s=0.01, eligible_layers=[0]))
    decisions = [
        Decision(node="a", action="keep"),
        Decision(node="b", action="recompute", windows={0: "s0.tp.l1.b.mb0", 1: "s0.recv_grad.mb1"}),
        Decision(node="c", action="recompute", windows={0: "s0.recv_grad.mb0"}),
        Decision(node="d", action="recompute"),
    ]
    return Plan(fingerprint=fingerprint_of("g1", CONFIG), graph_fingerprint="g1", config=CONFIG, solver="heu",
                status="HEURISTIC", search_time_s=0.01,
                stages=[StagePlan(index=0, layers=[0, 1], budget_bytes=100, peak_memory_bytes=90, decisions=decisions)],
                windows=windows, predicted=Predicted(step_time_s=1.5, peak_memory_bytes=[90]))


def test_save_load_equal(tmp_path) -> None:
    plan = _plan()
    path = plan.save(tmp_path / "sub" / "plan.json")
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.to_json() == plan.to_json()


def test_stage_schedule_orders_windows_in_time_and_nodes_in_forward_order() -> None:
    sched = _plan().stage_schedule(0)
    assert sched.dropped == frozenset({"b", "c", "d"})
    # mb0: recv_grad.mb0 comes before the tp window in time; b precedes c in forward order
    # window ids come back typed, parsed from the plan's strings
    assert sched.prefetch[0] == [(WindowId.recv(0, "recv_grad", 0), ["c"]),
                                 (WindowId.tp(0, layer=1, microbatch=0), ["b"])]
    assert sched.prefetch[1] == [(WindowId.parse("s0.recv_grad.mb1"), ["b"])]
    assert sched.prefetch[2] == []
    assert sched.on_demand(2) == frozenset({"b", "c", "d"})
    assert sched.on_demand(0) == frozenset({"d"})
    with pytest.raises(LynxPlanError, match="no stage 3"):
        _plan().stage_schedule(3)


def test_corrupt_and_wrong_version_files(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(LynxPlanError, match="not valid JSON"):
        Plan.load(bad)
    data = json.loads(_plan().to_json())
    data["schema_version"] = SCHEMA_VERSION + 1
    bad.write_text(json.dumps(data))
    with pytest.raises(LynxPlanError, match="schema_version"):
        Plan.load(bad)
    data["schema_version"] = SCHEMA_VERSION
    del data["stages"][0]["decisions"]
    bad.write_text(json.dumps(data))
    with pytest.raises(LynxPlanError, match="corrupt: stages.0.decisions"):
        Plan.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(LynxPlanError, match="expected a JSON object"):
        Plan.load(bad)
    with pytest.raises(LynxPlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")
    # a hand edit that repeats a key, or writes a non-JSON number, is refused (not read as the last value)
    text = _plan().to_json()
    bad.write_text(text.replace("\"solver\": \"heu\",", "\"solver\": \"heu\", \"solver\": \"opt\",", 1))
    with pytest.raises(LynxPlanError, match="'solver' is given twice in one object"):
        Plan.load(bad)
    bad.write_text(text.replace("\"step_time_s\": 1.5", "\"step_time_s\": NaN", 1))
    with pytest.raises(LynxPlanError, match="NaN is not a JSON number"):
        Plan.load(bad)


def test_fingerprint_refusal_names_what_differs() -> None:
    plan = _plan()
    check_fingerprint(plan, "g1", CONFIG)  # the same: accepted
    with pytest.raises(LynxFingerprintError, match=r"pp: plan 1, now 2") as err:
        check_fingerprint(plan, "g1", dict(CONFIG, pp=2))
    assert plan.fingerprint in str(err.value) and fingerprint_of("g1", dict(CONFIG, pp=2)) in str(err.value)
    with pytest.raises(LynxFingerprintError, match="model graph"):
        check_fingerprint(plan, "g2", CONFIG)


def test_decisions_round_trip_assignments() -> None:
    problem = make_uniform_problem(layers=2, microbatches=3, recv_grad_capacity_s=0.5)
    names = [n.name for n in problem.nodes]
    assignment = Assignment(
        recompute=frozenset(names[:3]),
        window_of={(names[0], j): f"s0.recv_grad.mb{j}" for j in range(3)} | {(names[1], 0): "s0.recv_grad.mb0"})
    decisions = decisions_from_assignment(problem, assignment)
    assert [d.node for d in decisions] == names
    assert decisions[0].windows == {0: "s0.recv_grad.mb0", 1: "s0.recv_grad.mb1", 2: "s0.recv_grad.mb2"}
    assert decisions[2].action == "recompute" and decisions[2].windows is None
    assert assignment_from_decisions(decisions, 3) == assignment


def test_a_calibrated_spec_travels_with_the_plan_but_not_in_its_fingerprint(tmp_path) -> None:
    from lynx.plan import HardwareSource
    from lynx.planner.hardware import Calibration, get_hardware

    preset = get_hardware("cpu-local")
    assert HardwareSource.of(preset) is None
    calibration = Calibration(host="h", date="2026-12-04T00:00:00+00:00", seconds=12.5, repeats=5, threads=1,
                              cpus=2, load_before=0.6, load_after=1.4, torch="2.13", spread={"op_overhead_s": 0.05},
                              notes=["long prose the plan does not need"])
    measured = preset.model_copy(update={"source": "/cache/hw.json", "calibration": calibration})
    source = HardwareSource.of(measured)
    plan = _plan().model_copy(update={"hardware_source": source})
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.hardware_source == source and again.fingerprint == _plan().fingerprint
    spec = again.hardware_source.applied_to(preset)
    assert spec.source == "/cache/hw.json" and spec.calibration.load_before == 0.6 and spec.calibration.notes == []
    assert spec.model_dump() == preset.model_dump()   # the figures are the recorded ones
