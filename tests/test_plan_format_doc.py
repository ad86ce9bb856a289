"""docs/plan_format.md documents every field a freshly made plan has (so the page cannot drift)."""

from __future__ import annotations

import json
from pathlib import Path

import lynx
from lynx.planner.loop import plan_graph
from lynx.planner.comm import CommModel
from lynx.plan import ChunkRecord, Decision, Predicted, StagePlan, WindowRecord
from lynx.planner.synthetic import synthetic_graph

DOC = Path(__file__).resolve().parents[1] / "docs" / "plan_format.md"


def _documented(text: str, key: str) -> bool:
    return f"| `{key}` |" in text  # a row of one of the page's field tables


def test_every_top_level_key_of_a_fresh_plan_is_documented() -> None:
    config = lynx.CompileConfig(pp=2, microbatches=4, solver="heu", memory_budget="80GiB")
    plan = plan_graph(synthetic_graph(layers=4), config, comm=CommModel.free())
    data = json.loads(plan.to_json())
    text = DOC.read_text()
    missing = [key for key in data if not _documented(text, key)]
    assert not missing, f"docs/plan_format.md does not document plan field(s) {missing}; add a row for each"


def test_every_nested_field_is_documented() -> None:
    text = DOC.read_text()
    for model in (StagePlan, ChunkRecord, Decision, WindowRecord, Predicted):
        missing = [name for name in model.model_fields if not _documented(text, name)]
        assert not missing, f"docs/plan_format.md does not document {model.__name__} field(s) {missing}"
    for name in lynx.CompileConfig.model_fields:
        if name != "plan":  # not recorded in plans
            assert f"`{name}`" in text, f"docs/plan_format.md does not mention config setting {name!r}"
