"""Issue 22, finding 4: an edited plan is refused on load, naming the stage and the field.

The probes edit a real plan's JSON as a user (or a tool) would, keeping its fingerprint, and
load it the way ``lynx.compile(plan=...)`` does: every edit is refused with the stage and the
field at fault; the plan as written is accepted, its predictions equal to the replay's bit for bit.
"""

from __future__ import annotations

import json

import pytest

import lynx
from lynx.errors import LynxFingerprintError, LynxPlanError
from lynx.plan import Plan, check_fingerprint
from lynx.planner.fingerprint import graph_fingerprint
from lynx.planner.plan_check import recheck_plan

SETTINGS = dict(pp=2, microbatches=4, hardware="cpu-local", memory_budget="12MiB", optimizer="demo")


@pytest.fixture(scope="module")
def made():
    """gpt-tiny (seq 64 × 8, meta device) under a budget that makes HEU recompute on stage 0."""
    model, inputs = lynx.models.build_preset("gpt-tiny", seq=64, microbatch=8, device="meta")
    compiled = lynx.compile(model, inputs, solver="heu", **SETTINGS)
    assert any(d.action == "recompute" for d in compiled.plan.stages[0].decisions)
    return model, inputs, compiled


def _load(compiled, data: dict) -> None:
    """What lynx.compile(plan=...) does with a plan compiled with the settings it records (as
    ``examples/train_gpt.py --plan`` and ``python -m lynx.runtime.torchrun`` do): the
    fingerprint, then the re-check."""
    from lynx.planner.simulator import config_from_record

    plan = Plan.from_json(json.dumps(data))
    fields = config_from_record(plan.config).fingerprint_fields()
    check_fingerprint(plan, graph_fingerprint(compiled.analysis.graph), fields)
    recheck_plan(plan, compiled.analysis.graph)


def _windowed(data: dict, stage: int) -> dict:
    return next(d for d in data["stages"][stage]["decisions"] if d["windows"] or d["window"])


def _edit_all(action: str):
    def edit(data: dict) -> None:
        for d in data["stages"][0]["decisions"]:
            d.update(action=action, window=None, windows=None)
    return edit


def _window_for(microbatch: int):
    def edit(data: dict) -> None:
        d = _windowed(data, 0)
        d["windows"] = {**(d["windows"] or {}), str(microbatch): "s0.recv_grad.mb0"}
    return edit


def _foreign_window(data: dict) -> None:
    d = next(d for d in data["stages"][1]["decisions"])
    d.update(action="recompute", window=None, windows={"0": "s0.recv_grad.mb0"})


def _moved_node(data: dict) -> None:
    data["stages"][1]["decisions"].append(data["stages"][0]["decisions"].pop())


def _duplicate(data: dict) -> None:
    data["stages"][0]["decisions"].append(dict(data["stages"][0]["decisions"][0]))


def _set(path: str, value):
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        target = data
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[last] = value
    return edit


@pytest.mark.parametrize("edit,message", [
    (_edit_all("keep"), "plan stage 0: activation_bytes is"),
    (_edit_all("recompute"), "plan stage 0: for microbatch 0, .* is recomputed .* before its input"),
    (_window_for(17), "plan stage 0: node '.*' has a window for microbatch 17; a step has microbatches 0..3"),
    (_window_for(-3), "plan stage 0: node '.*' has a window for microbatch -3"),
    (_foreign_window, "plan stage 1: node '.*' is placed in window 's0.recv_grad.mb0' of stage 0"),
    (_moved_node, "plan stage 0: no decision for 1 node"),
    (_duplicate, "plan stage 0: node '.*' is decided twice"),
    (_set("stages.0.layers", [0]), r"plan stage 0: layers is \[0\] but its config and graph give \[0, 1\]"),
    (_set("stages.1.chunks.0.nodes", 3), r"plan stage 1: chunks is \[ChunkRecord\(index=1, blocks=.*nodes=3\)\] but"),
    (_set("stages.0.peak_memory_bytes", 1), "plan stage 0: peak_memory_bytes is 1 but its decisions replay to"),
    (_set("predicted.peak_memory_bytes", [1, 1]), "plan predicted.peak_memory_bytes / fits_budget"),
    (_set("predicted.step_time_s", 1e-9), "plan: predicted.step_time_s is 1e-09 but its decisions replay to"),
    (_set("stages.1.hidden_recompute_s", 5.0), "plan stage 1: hidden_recompute_s is 5.0"),
    (_set("config.memory_budget", 10 ** 9), r"differs in config.memory_budget \(the plan file records 1000000000"),
])
def test_an_edited_plan_is_refused_naming_stage_and_field(made, edit, message) -> None:
    _, _, compiled = made
    data = json.loads(compiled.plan.to_json())
    edit(data)
    with pytest.raises(LynxPlanError, match=message):
        _load(compiled, data)


def test_the_plan_as_written_is_accepted_and_loads_through_compile(made, tmp_path) -> None:
    model, inputs, compiled = made
    path = compiled.plan.save(tmp_path / "plan.json")
    sim = recheck_plan(Plan.load(path), compiled.analysis.graph)
    assert sim.step_time_s == compiled.plan.predicted.step_time_s
    assert sim.peak_memory_bytes == compiled.plan.predicted.peak_memory_bytes
    again = lynx.compile(model, inputs, plan=path, **SETTINGS)
    assert again.plan == compiled.plan and "simulate" in again.phases
    data = json.loads(path.read_text())
    data["stages"][0]["peak_memory_bytes"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(LynxPlanError, match="plan stage 0: peak_memory_bytes is 1"):
        lynx.compile(model, inputs, plan=path, **SETTINGS)
    data["config"]["optimizer"] = "adamw"   # and a config edit, loaded with the settings it now records
    path.write_text(json.dumps(data))
    with pytest.raises(LynxFingerprintError, match=r"differs in config\.optimizer \(the plan file records 'adamw'"):
        lynx.compile(model, inputs, plan=path, **dict(SETTINGS, optimizer="adamw"))


def test_a_plan_over_its_budget_is_refused(made) -> None:
    model, inputs, _ = made
    # solver none keeps everything and says honestly that it does not fit: its records agree
    keep = lynx.compile(model, inputs, solver="none", **SETTINGS)
    assert not keep.plan.predicted.fits_budget
    with pytest.raises(LynxPlanError, match=r"plan stage 0: its decisions need 1\d\.\d\d MiB .* over the budget"):
        _load(keep, json.loads(keep.plan.to_json()))
