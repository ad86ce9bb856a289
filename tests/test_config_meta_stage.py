"""Compiled.stage refuses a model compiled on the meta device with a clear message."""

import pytest

import lynx
from lynx.errors import LynxConfigError


def test_meta_model_stage_refused_and_plan_reusable_on_cpu(tmp_path) -> None:
    model, inputs = lynx.models.build_preset("gpt-tiny", device="meta")
    settings = dict(pp=2, microbatches=2, hardware="cpu-local", solver="full")
    compiled = lynx.compile(model, inputs, **settings)
    with pytest.raises(LynxConfigError, match=r"stage 1: .*meta device.*cpu or cuda"):
        compiled.stage(1)
    # what the message advises works: the same model on cpu, reusing the saved plan
    path = compiled.plan.save(tmp_path / "plan.json")
    model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    again = lynx.compile(model, inputs, plan=path, **settings)
    assert again.plan == compiled.plan
    assert sorted(again.stage(1).dropped) == sorted(again.plan.stage_schedule(1).dropped)
