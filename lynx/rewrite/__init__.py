"""Rewrite: per pipeline stage, an executable module that drops what the plan drops.

Example::

    >>> import lynx
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    >>> compiled = lynx.compile(model, inputs, pp=2, microbatches=2, solver="full")
    >>> stage0 = compiled.stage(0)          # calls build_stage_module(compiled, 0)
    >>> sorted(stage0.dropped) == sorted(compiled.plan.stage_schedule(0).dropped)
    True
"""

from lynx.rewrite.build import (build_chunk_modules, build_stage_module, build_stages, chunk_node_lists,
                                stage_node_lists)
from lynx.frontend.joint import JointGraph, trace_joint
from lynx.rewrite.lower import LoweredStage, lower
from lynx.rewrite.saved import SavedBytesMeter
from lynx.rewrite.split import StageGraph, StageSpec, split_graph
from lynx.rewrite.stage import MicrobatchStats, StageModule

__all__ = [
    "build_stage_module", "build_chunk_modules", "build_stages", "stage_node_lists", "chunk_node_lists",
    "split_graph", "StageGraph", "StageSpec",
    "StageModule", "MicrobatchStats", "SavedBytesMeter", "JointGraph", "trace_joint", "LoweredStage", "lower",
]
