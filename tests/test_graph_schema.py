"""The graph contract between frontend and planner (lynx.planner.graph_schema)."""

from __future__ import annotations

import typing

import pytest

import lynx
from lynx.errors import LynxConfigError
from lynx.planner.graph_schema import Block, GraphAttrs, NodeAttrs, check_graph
from lynx.planner.loop import plan_graph
from lynx.planner.synthetic import synthetic_graph


def test_the_frontend_writes_every_field_of_the_schema() -> None:
    model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    graph = lynx.analyze(model, inputs, target="cpu", hardware="cpu-local").graph
    check_graph(graph)
    for _, attrs in graph.nodes(data=True):
        assert set(typing.get_type_hints(NodeAttrs)) <= set(attrs)
    assert set(typing.get_type_hints(GraphAttrs)) <= set(graph.graph)
    for block in graph.graph["blocks"]:
        assert set(typing.get_type_hints(Block)) <= set(block)


def test_the_synthetic_fixture_follows_the_schema() -> None:
    check_graph(synthetic_graph(layers=2))


def test_a_graph_missing_an_attribute_is_refused_before_planning() -> None:
    graph = synthetic_graph(layers=2)
    del graph.nodes["l1_qkv"]["saved_bytes"]
    with pytest.raises(LynxConfigError, match=r"'l1_qkv' lacks attribute\(s\) \['saved_bytes'\]"):
        plan_graph(graph, lynx.CompileConfig(pp=2, microbatches=2, memory_budget="80GiB", solver="none"))
