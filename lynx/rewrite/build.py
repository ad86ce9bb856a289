"""Build the executable stage modules of a compiled model from its plan.

``build_stage_module(compiled, i)`` is what ``Compiled.stage(i)`` calls: it splits the
captured graph along the plan's stages (once per compiled model; the split is cached on the
graph module) and returns stage ``i`` as a :class:`~lynx.rewrite.stage.StageModule` that
drops ``plan.stage_schedule(i).dropped``. Under interleaved schedules a device runs several
model chunks: :func:`build_chunk_modules` returns them (one ``StageModule`` per chunk, cut where
the plan's chunk records say, :func:`chunk_node_lists`). :func:`build_stages` does the same from
plain data (a graph module, node lists, dropped sets) for callers without a plan.

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

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import fx

from lynx.errors import LynxConfigError, LynxPlanError
from lynx.frontend.joint_reuse import link_whole
from lynx.rewrite.split import StageGraph, split_graph
from lynx.rewrite.stage import StageModule
from lynx.torch_private import out_spec_of

if TYPE_CHECKING:
    from lynx.compiler import Compiled

__all__ = ["build_stage_module", "build_chunk_modules", "build_stages", "stage_node_lists", "chunk_node_lists",
           "split_cached"]


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


def chunk_node_lists(plan: Any, graph: Any = None) -> list[list[str]]:
    """Each model chunk's nodes, in pipeline order: every device's nodes cut where its chunk
    records say (a device without records runs one chunk)."""
    chunks: dict[int, list[str]] = {}
    ordered = sorted(plan.stages, key=lambda s: s.index)
    for stage, names in zip(ordered, stage_node_lists(plan, graph)):
        if len(stage.chunks) <= 1:
            chunks[stage.index if not stage.chunks else stage.chunks[0].index] = names
            continue
        if sum(c.nodes for c in stage.chunks) != len(names):
            raise LynxPlanError(f"plan stage {stage.index}: its chunks hold {sum(c.nodes for c in stage.chunks)} "
                                f"nodes but it has {len(names)} decisions; re-create the plan (`lynx plan`)")
        start = 0
        for record in stage.chunks:
            chunks[record.index] = names[start:start + record.nodes]
            start += record.nodes
    if sorted(chunks) != list(range(len(chunks))):
        raise LynxPlanError(f"plan chunks {sorted(chunks)} are not 0..{len(chunks) - 1}; re-create the plan")
    return [chunks[c] for c in range(len(chunks))]


def split_cached(gm: fx.GraphModule, stage_nodes: Sequence[Sequence[str]]) -> list[StageGraph]:
    """:func:`split_graph`, computed once per graph module and assignment."""
    cache = gm.meta.setdefault("lynx_stage_split", {})
    key = tuple(tuple(names) for names in stage_nodes)
    if key not in cache:
        cache[key] = split_graph(gm, stage_nodes)
        if len(cache[key]) == 1:   # the whole graph: it may take the profile's joint trace
            link_whole(cache[key][0].gm, gm)
    return cache[key]


def build_stages(gm: fx.GraphModule, stage_nodes: Sequence[Sequence[str]],
                 dropped: Sequence[frozenset[str] | set[str]] | None = None, *,
                 compile: bool = False, offload: Sequence[Mapping[str, str | None]] | None = None
                 ) -> list[StageModule]:
    """All stage modules of ``gm`` split as ``stage_nodes``, stage s dropping ``dropped[s]``
    and offloading ``offload[s]`` (node → the node whose backward issues its prefetch, None: the
    backward's start; :meth:`StageModule.prefetch` brings them back earlier).

    ``compile``: pass the generated graphs through ``torch.compile`` (Inductor)."""
    parts = split_cached(gm, stage_nodes)
    dropped = dropped if dropped is not None else [frozenset()] * len(parts)
    offload = offload if offload is not None else [{}] * len(parts)
    out_spec = out_spec_of(gm)
    return [StageModule(part, drop, out_spec=out_spec, compile=compile, offload=off)
            for part, drop, off in zip(parts, dropped, offload)]


def build_chunk_modules(compiled: Compiled, device: int, tp_mesh: Any = None) -> dict[int, StageModule]:
    """The model chunks device ``device`` runs, by chunk index, each dropping what the plan drops
    among its nodes (one chunk, the device's stage, unless the schedule is interleaved); with
    ``tp_mesh`` and a sharding plan (tp > 1), this TP rank's shard of each
    (:func:`lynx.rewrite.shard.shard_stage`), run tensor-parallel."""
    plan = compiled.plan
    _check_stage(plan, device)
    gm = compiled.analysis.captured.gm
    parts = split_cached(gm, chunk_node_lists(plan, getattr(compiled.analysis, "graph", None)))
    schedule = plan.stage_schedule(device)
    dropped = schedule.dropped
    mine = range(device, len(parts), len(plan.stages))
    unknown = sorted(dropped - {n for c in mine for n in parts[c].spec.nodes})
    if unknown:
        raise LynxPlanError(f"stage {device}: plan drops nodes that are not in this stage: {unknown[:5]}")
    use_compile = bool(getattr(compiled.config, "compile", False))
    offload = schedule.prefetch_at   # offloaded node -> where its prefetch is issued

    def offload_of(c: int) -> dict[str, str | None]:
        return {n: at for n, at in offload.items() if n in set(parts[c].spec.nodes)}

    sharding = getattr(compiled, "sharding", None)
    if tp_mesh is None or sharding is None:
        return {c: StageModule(parts[c], dropped & set(parts[c].spec.nodes), out_spec=out_spec_of(gm),
                               compile=use_compile, offload=offload_of(c))
                for c in mine}
    from lynx.frontend.joint_tp import TPContext
    from lynx.rewrite.shard import shard_stage

    if int(tp_mesh.size()) != sharding.tp:
        raise LynxConfigError(f"the tensor-parallel mesh has {int(tp_mesh.size())} ranks but the model was "
                              f"compiled for tp={sharding.tp}")
    tp = TPContext(tp_mesh, sharding)
    # which layer each node is in: which all-reduces a TP window's recompute runs inside
    graph = getattr(compiled.analysis, "graph", None)
    layer_of = ({n: a["layer"] for n, a in graph.nodes(data=True) if a.get("layer") is not None}
                if graph is not None else dict(getattr(compiled.analysis, "layer_of", {})))
    chunks = {}
    for c in mine:
        stage = StageModule(shard_stage(parts[c], sharding, tp.rank), dropped & set(parts[c].spec.nodes),
                            out_spec=out_spec_of(gm), compile=use_compile, tp=tp, offload=offload_of(c))
        stage.layer_of = layer_of
        if sharding.collectives:  # what the plan priced for this chunk's layers: the traced graph must issue it
            layers = {layer_of[n] for n in parts[c].spec.nodes if n in layer_of}
            stage.expected_collectives = {layer: v for layer, v in sharding.collectives.items()
                                          if layer is None or layer in layers}
        chunks[c] = stage
    return chunks


def build_stage_module(compiled: Compiled, index: int, tp_mesh: Any = None) -> StageModule:
    """Stage ``index`` of ``compiled`` (a :class:`lynx.Compiled`) with its plan applied (with
    ``tp_mesh``: this TP rank's shard of it, see :func:`build_chunk_modules`)."""
    plan = compiled.plan
    _check_stage(plan, index)
    if len(plan.stage(index).chunks) > 1:
        raise LynxConfigError(f"stage {index} runs {len(plan.stage(index).chunks)} model chunks (interleaved "
                              "schedule): build them with lynx.rewrite.build_chunk_modules(compiled, stage)")
    (chunk,) = build_chunk_modules(compiled, index, tp_mesh=tp_mesh).values()
    return chunk


def _check_stage(plan: Any, index: Any) -> None:
    n_stages = len(plan.stages)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n_stages:
        raise LynxConfigError(
            f"stage index {index!r} is out of range: this plan has {n_stages} stage(s), 0..{n_stages - 1}")
