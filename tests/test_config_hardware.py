"""A plan made with a custom HardwareSpec reloads: its config records the spec as a dict,
and CompileConfig turns that dict back into a HardwareSpec."""

from __future__ import annotations

import pytest

import lynx
from lynx.config import FINGERPRINT_FIELDS, CompileConfig
from lynx.errors import LynxConfigError
from lynx.planner.hardware import HARDWARE_PRESETS, HardwareSpec


def _custom() -> HardwareSpec:
    base = HARDWARE_PRESETS["cpu-local"].model_dump()
    return HardwareSpec(**{**base, "name": "my-cpu", "memory_bytes": 8 * 2**30})


def test_dict_becomes_spec_and_round_trips() -> None:
    spec = _custom()
    cfg = CompileConfig(hardware=spec.model_dump(mode="json"), microbatches=2)
    assert isinstance(cfg.hardware, HardwareSpec) and cfg.hardware == spec
    assert cfg.budget_bytes() == 8 * 2**30 and cfg.target == "cpu"
    assert cfg.fingerprint_fields() == CompileConfig(hardware=spec, microbatches=2).fingerprint_fields()


def test_bad_hardware_dict_names_the_field() -> None:
    bad = {**_custom().model_dump(mode="json"), "memory_bytes": -1}
    with pytest.raises(LynxConfigError, match="hardware.*memory_bytes"):
        CompileConfig(hardware=bad)


def test_plan_with_custom_spec_saves_loads_and_is_reused(tmp_path) -> None:
    model, inputs = lynx.models.build_preset("gpt-tiny", device="meta")
    compiled = lynx.compile(model, inputs, pp=2, microbatches=2, hardware=_custom(), solver="heu")
    path = compiled.plan.save(tmp_path / "plan.json")
    plan = lynx.Plan.load(path)
    assert plan == compiled.plan
    # the settings as the runtime takes them from the plan (hardware is a dict there)
    settings = {k: plan.config[k] for k in FINGERPRINT_FIELDS if k in plan.config}
    assert isinstance(settings["hardware"], dict)
    again = lynx.compile(model, inputs, plan=path, **settings)
    assert again.plan == compiled.plan and again.config.hardware == _custom()
    assert lynx.simulate(plan, compiled.analysis.graph).step_time_s == pytest.approx(plan.predicted.step_time_s)
