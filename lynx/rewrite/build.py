"""Build the executable stage modules of a compiled model from its plan.

``build_stage_module(compiled, i)`` is what ``Compiled.stage(i)`` calls: it splits the
captured graph along the plan's stages (once per compiled model; the split is cached on the
graph module) and returns stage ``i`` as a :class:`~lynx.rewrite.stage.StageModule` that
drops ``plan.stage_schedule(i).dropped``. :func:`build_stages` does the same from plain data
(a graph module, node lists, dropped sets) for callers without a plan.

Example::

    >>> import lynx
    >>> from lynx.rewrite import build_stage_module
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    >>> compiled = lynx.compile(model, inputs, pp=2, microbatches=2, solver="full")
    >>> stage = build_stage_module(compiled, 1)
    >>> stage.spec.is_last
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import fx

from lynx.errors import LynxConfigError
from lynx.rewrite.split import StageGraph, split_graph
from lynx.rewrite.stage import StageModule
from lynx.torch_private import out_spec_of

if TYPE_CHECKING:
    from lynx.compiler import Compiled

__all__ = ["build_stage_module", "build_stages", "stage_node_lists", "split_cached"]


def stage_node_lists(plan: Any, graph: Any = None) -> list[list[str]]:
    """Each stage's nodes: the plan's decisions (one per node), else its blocks' nodes."""
    lists = []
    for stage in sorted(plan.stages, key=lambda s: s.index):
        names = [d.node for d in stage.decisions]
        if not names and graph is not None:
            blocks = graph.graph["blocks"]
            names = [n for b in stage.layers for n in blocks[b]["nodes"]]
        lists.append(names)
    return lists


def split_cached(gm: fx.GraphModule, stage_nodes: Sequence[Sequence[str]]) -> list[StageGraph]:
    """:func:`split_graph`, computed once per graph module and assignment."""
    cache = gm.meta.setdefault("lynx_stage_split", {})
    key = tuple(tuple(names) for names in stage_nodes)
    if key not in cache:
        cache[key] = split_graph(gm, stage_nodes)
    return cache[key]


def build_stages(gm: fx.GraphModule, stage_nodes: Sequence[Sequence[str]],
                 dropped: Sequence[frozenset[str] | set[str]] | None = None, *,
                 compile: bool = False) -> list[StageModule]:
    """All stage modules of ``gm`` split as ``stage_nodes``, stage s dropping ``dropped[s]``.

    ``compile``: pass the generated graphs through ``torch.compile`` (Inductor)."""
    parts = split_cached(gm, stage_nodes)
    dropped = dropped if dropped is not None else [frozenset()] * len(parts)
    out_spec = out_spec_of(gm)
    return [StageModule(part, drop, out_spec=out_spec, compile=compile) for part, drop in zip(parts, dropped)]


def build_stage_module(compiled: Compiled, index: int) -> StageModule:
    """Stage ``index`` of ``compiled`` (a :class:`lynx.Compiled`) with its plan applied."""
    plan = compiled.plan
    n_stages = len(plan.stages)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n_stages:
        raise LynxConfigError(
            f"stage index {index!r} is out of range: this plan has {n_stages} stage(s), 0..{n_stages - 1}")
    gm = compiled.analysis.captured.gm
    parts = split_cached(gm, stage_node_lists(plan, getattr(compiled.analysis, "graph", None)))
    schedule = plan.stage_schedule(index)
    return StageModule(parts[index], schedule.dropped, out_spec=out_spec_of(gm),
                       compile=bool(getattr(compiled.config, "compile", False)))

