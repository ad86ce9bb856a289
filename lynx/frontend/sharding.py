"""Tensor-parallel sharding plans: which linear layers are column- and which row-parallel.

A plan follows torchtitan's convention: module paths (``fnmatch`` patterns, ``*`` for a layer
index) to ``torch.distributed.tensor.parallel`` styles — ``ColwiseParallel()`` or
``RowwiseParallel()`` (or the strings ``"colwise"`` / ``"rowwise"``). Lynx shards the
``nn.Linear`` layers it names in the *captured* graph (Megatron's layout): a column-parallel
linear keeps rows ``[r·o/tp, (r+1)·o/tp)`` of its weight and bias on TP rank ``r`` and
produces that slice of the output features; a row-parallel one keeps the matching columns of
its weight, produces a partial sum that one all-reduce completes, and adds its bias (kept
whole) after it. Everything else — embeddings, norms, the head, the loss — is **replicated**:
each TP rank holds it whole and computes it on the whole (replicated) activation. Vocab-parallel
embeddings and heads and ``SequenceParallel`` are not supported (a clear error says so).

**The default** is found from the repeated layer's structure, per layer: walking back from a
linear's input (inside the layer) to the first linears met, a linear that meets none, or only
row-parallel ones, is column-parallel (attention's q/k/v, the MLP's up and gate); one that
meets only column-parallel ones is row-parallel (attention's output, the MLP's down). A fused
column-parallel output that the model splits into ``k`` equal parts along the features
(GPT's ``qkv(x).split(C, dim=2)``) is sharded part by part (``parts = k``), so each rank holds
its slice of q, of k and of v. Head counts are checked: the first view that splits a sharded
feature dimension into ``(heads, head_dim)`` needs ``heads`` divisible by ``tp``.

The linear layers the captured graph calls, with their fused parts and heads
(:func:`linear_sites`, re-exported here): :mod:`lynx.frontend.linear_sites`.

Example::

    >>> import lynx
    >>> from lynx.frontend.analyze import analyze
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="meta")
    >>> a = analyze(model, inputs, hardware="cpu-local")
    >>> plan = resolve_sharding(a.captured.gm, a.graph.graph["blocks"], tp=2)
    >>> plan.record()["layers.*.attn.qkv"], plan.record()["layers.*.mlp.fc2"]
    ('colwise:3', 'rowwise')
    >>> plan.shard_of("layers.1.attn.qkv.weight").parts
    3
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import fx

from lynx.errors import LynxConfigError
from lynx.frontend.linear_sites import LinearSite, linear_sites

__all__ = ["LinearShard", "LinearSite", "ShardingPlan", "linear_sites", "default_sharding", "resolve_sharding",
           "shard_tensor", "style_name", "DOCS_HINT"]

DOCS_HINT = "see docs/tensor_parallel.md"
Style = Literal["colwise", "rowwise"]


@dataclass(frozen=True)
class LinearShard:
    """How one linear layer is sharded: ``colwise`` (output features) or ``rowwise`` (input
    features); ``parts``: a fused column-parallel output split into that many equal parts."""

    style: Style
    parts: int = 1

    def record(self) -> str:
        return self.style if self.parts == 1 else f"{self.style}:{self.parts}"


@dataclass
class ShardingPlan:
    """A resolved plan: module path -> :class:`LinearShard`, for a ``tp``-way group."""

    tp: int
    shards: dict[str, LinearShard]                 # concrete module paths
    patterns: dict[str, str] = field(default_factory=dict)   # the recorded form (see record())
    # per layer, the bytes of each all-reduce the forward and the backward issue (what the
    # planner prices; lynx.frontend.tp_profile.annotate_tp fills it, the runtime checks it)
    collectives: dict[Any, dict[str, list[int]]] = field(default_factory=dict)

    def record(self) -> dict[str, str]:
        """JSON-ready form (pattern -> ``"colwise"``, ``"colwise:3"`` or ``"rowwise"``), as a plan saves it."""
        return dict(self.patterns) if self.patterns else {p: s.record() for p, s in self.shards.items()}

    def shard_of(self, param: str) -> LinearShard | None:
        """The shard of the linear layer owning parameter ``param`` (``None``: replicated)."""
        return self.shards.get(param.rsplit(".", 1)[0]) if "." in param else None

    def sharded_params(self, names: Sequence[str]) -> dict[str, tuple[LinearShard, str]]:
        """Of ``names``, those held as shards: name -> (shard, ``"weight"`` or ``"bias"``). A
        row-parallel bias is replicated (added once, after the all-reduce)."""
        out = {}
        for name in names:
            shard = self.shard_of(name)
            kind = name.rsplit(".", 1)[-1]
            if shard is not None and (kind == "weight" or shard.style == "colwise"):
                out[name] = (shard, kind)
        return out


def style_name(style: Any) -> str:
    """``"colwise"`` / ``"rowwise"`` for a style object or string; a clear error otherwise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if isinstance(style, str):
        name = style.split(":", 1)[0]
        if name in ("colwise", "rowwise"):
            return name
        raise LynxConfigError(f"unknown tensor-parallel style {style!r}: use 'colwise' or 'rowwise' "
                              f"(or ColwiseParallel() / RowwiseParallel()); {DOCS_HINT}")
    if isinstance(style, ColwiseParallel):
        if tuple(style.input_layouts) != (Replicate(),) or tuple(style.output_layouts) != (Shard(-1),):
            raise LynxConfigError(
                f"ColwiseParallel with input_layouts={style.input_layouts}, output_layouts={style.output_layouts} "
                "is not supported: Lynx keeps activations replicated outside the sharded linears (no sequence "
                f"parallelism, no gathered outputs); use ColwiseParallel(); {DOCS_HINT}")
        return "colwise"
    if isinstance(style, RowwiseParallel):
        if tuple(style.input_layouts) != (Shard(-1),) or tuple(style.output_layouts) != (Replicate(),):
            raise LynxConfigError(
                f"RowwiseParallel with input_layouts={style.input_layouts}, output_layouts={style.output_layouts} "
                "is not supported (vocab-parallel embeddings and sequence parallelism are not): use "
                f"RowwiseParallel() on a linear layer; {DOCS_HINT}")
        return "rowwise"
    if isinstance(style, SequenceParallel):
        raise LynxConfigError("SequenceParallel is not supported: Lynx's tensor parallelism keeps the activations "
                              "between layers replicated (Megatron's layout without sequence parallelism); "
                              f"{DOCS_HINT}")
    raise LynxConfigError(f"tensor-parallel style {type(style).__name__} is not supported: use ColwiseParallel() or "
                          f"RowwiseParallel() (or 'colwise' / 'rowwise'); {DOCS_HINT}")


def _upstream(gm: fx.GraphModule, site: LinearSite, layer: set[str], by_node: dict[str, LinearSite]) -> set[str]:
    """Module paths of the first linears met walking back from ``site``'s input inside ``layer``."""
    nodes = {n.name: n for n in gm.graph.nodes}
    start = nodes[site.node].args[0]
    found, stack, seen = set(), [start], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n.name in seen or n.name not in layer:
            continue
        seen.add(n.name)
        if n.name in by_node:
            found.add(by_node[n.name].path)
            continue
        stack.extend(a for a in n.all_input_nodes if a.op == "call_function")
    return found


def _pattern(path: str, layer_path: str) -> tuple[str, str]:
    """``(layer pattern, relative path)``: ``layers.3.attn.qkv`` in ``layers.3`` -> ``("layers.*", "attn.qkv")``."""
    relative = path[len(layer_path) + 1:] if layer_path and path.startswith(layer_path + ".") else path
    generic = re.sub(r"\.\d+$", ".*", layer_path) if re.search(r"\.\d+$", layer_path) else layer_path
    return generic, relative


def default_sharding(gm: fx.GraphModule, blocks: Sequence[Mapping[str, Any]], tp: int) -> ShardingPlan:
    """The default plan for ``tp`` ranks from the repeated layers' structure (module docstring)."""
    sites = linear_sites(gm)
    by_node = {s.node: s for s in sites}
    captured = {n.name for n in gm.graph.nodes}
    # a folded capture (a deep meta model) holds two layers; the rest are clones of the second
    layers = [b for b in blocks if b.get("kind") == "layer" and any(n in captured for n in b["nodes"])]
    if not layers:
        raise LynxConfigError("tensor parallelism needs repeated layers to shard, and this model has none that "
                              f"Lynx recognises: give tp_plan= naming the linear layers to shard; {DOCS_HINT}")
    shards: dict[str, LinearShard] = {}
    patterns: dict[str, str] = {}
    for block in layers:
        members = set(block["nodes"])
        mine = [s for s in sites if s.node in members]
        if not mine:
            raise LynxConfigError(f"the default tensor-parallel plan cannot shard layer {block['name']!r}: it calls no "
                                  f"nn.Linear (torch.ops.aten.linear) Lynx can shard; give tp_plan=; {DOCS_HINT}")
        styles: dict[str, str] = {}
        for site in mine:
            up = _upstream(gm, site, members, by_node)
            kinds = {styles[p] for p in up}
            if not up or kinds == {"rowwise"}:
                styles[site.path] = "colwise"
            elif kinds == {"colwise"}:
                styles[site.path] = "rowwise"
            else:
                raise LynxConfigError(
                    f"the default tensor-parallel plan cannot shard layer {block['name']!r}: linear {site.path!r} "
                    f"reads both column- and row-parallel linears ({sorted(up)}); give tp_plan= for this "
                    f"model; {DOCS_HINT}")
        fed = {p for site in mine if styles[site.path] == "rowwise"
               for p in _upstream(gm, site, members, by_node)}
        for site in mine:
            if styles[site.path] == "colwise" and site.path not in fed:
                raise LynxConfigError(
                    f"the default tensor-parallel plan cannot shard layer {block['name']!r}: column-parallel "
                    f"linear {site.path!r} feeds no row-parallel linear in the layer, so its sharded output would "
                    f"have to be gathered; give tp_plan= for this model; {DOCS_HINT}")
            style = cast(Style, styles[site.path])
            shard = LinearShard(style, site.parts if style == "colwise" else 1)
            shards[site.path] = shard
            layer_pattern, relative = _pattern(site.path, block["module_path"])
            patterns[f"{layer_pattern}.{relative}" if relative != site.path else site.path] = shard.record()
    plan = ShardingPlan(tp=tp, shards=shards, patterns=_consistent(patterns, shards, sites))
    check_divisible(plan, sites)
    return plan


def _consistent(patterns: dict[str, str], shards: dict[str, LinearShard], sites: list[LinearSite]) -> dict[str, str]:
    """``patterns`` when they reproduce ``shards`` exactly on ``sites``; else the concrete paths."""
    again = _match(patterns, sites)
    if again == {p: s.record() for p, s in shards.items()}:
        return patterns
    return {p: s.record() for p, s in shards.items()}


def _match(patterns: Mapping[str, str], sites: list[LinearSite]) -> dict[str, str]:
    out: dict[str, str] = {}
    for site in sites:
        for pattern, style in patterns.items():
            if fnmatch.fnmatchcase(site.path, pattern):
                out[site.path] = style
    return out


def resolve_sharding(gm: fx.GraphModule, blocks: Sequence[Mapping[str, Any]], tp: int,
                     tp_plan: Mapping[str, Any] | None = None) -> ShardingPlan:
    """The sharding for ``tp`` ranks: ``tp_plan`` (module path pattern -> style) when given,
    else :func:`default_sharding`; checked against the captured graph (clear errors naming the
    module: not a linear layer, features or heads not divisible by ``tp``)."""
    if tp_plan is None:
        return default_sharding(gm, blocks, tp)
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise LynxConfigError(f"tp_plan must be a non-empty dict of module paths to ColwiseParallel() / "
                              f"RowwiseParallel() (or 'colwise' / 'rowwise'), got {tp_plan!r}; {DOCS_HINT}")
    sites = linear_sites(gm)
    modules = {name for name, _ in gm.named_modules() if name}
    modules |= {n.target.rsplit(".", 1)[0] for n in gm.graph.nodes if n.op == "get_attr" and "." in n.target}
    shards: dict[str, LinearShard] = {}
    patterns: dict[str, str] = {}
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str):
            raise LynxConfigError(f"tp_plan keys are module paths (strings), got {pattern!r}; {DOCS_HINT}")
        name = cast(Style, style_name(style))
        matched = [s for s in sites if fnmatch.fnmatchcase(s.path, pattern)]
        if not matched:
            hits = sorted(m for m in modules if fnmatch.fnmatchcase(m, pattern))
            if hits:
                raise LynxConfigError(
                    f"tp_plan: {pattern!r} names {hits[0]!r}, which is not a linear layer the captured graph "
                    f"calls: Lynx shards nn.Linear layers, name those inside it (e.g. "
                    f"{next((s.path for s in sites if s.path.startswith(hits[0] + '.')), 'its q/k/v projections')!r}); "
                    f"{DOCS_HINT}")
            raise LynxConfigError(f"tp_plan: {pattern!r} matches no module of this model (linear layers are e.g. "
                                  f"{[s.path for s in sites[:4]]}); {DOCS_HINT}")
        for site in matched:
            parts = site.parts if name == "colwise" else 1
            if isinstance(style, str) and ":" in style:
                parts = int(style.split(":", 1)[1])
            shards[site.path] = LinearShard(name, parts)
        patterns[pattern] = LinearShard(name, matched[0].parts if name == "colwise" else 1).record()
        if isinstance(style, str):
            patterns[pattern] = style
    plan = ShardingPlan(tp=tp, shards=shards, patterns=_consistent(patterns, shards, sites))
    check_divisible(plan, sites)
    return plan


def check_divisible(plan: ShardingPlan, sites: Sequence[LinearSite]) -> None:
    """Features and heads of every sharded linear divide by ``tp`` (an error naming the module)."""
    tp = plan.tp
    users: dict[str, list[str]] = {}
    for site in sites:
        users.setdefault(site.weight, []).append(site.node)
    for site in sites:
        shard = plan.shards.get(site.path)
        if shard is None:
            continue
        if len(users[site.weight]) > 1:
            raise LynxConfigError(f"{site.path}: its weight is used by {len(users[site.weight])} linear calls "
                                  f"({users[site.weight]}, e.g. tied embeddings); a shared weight cannot be "
                                  f"sharded: leave {site.path!r} out of tp_plan; {DOCS_HINT}")
        if shard.style == "colwise":
            per_part = site.out_features // shard.parts
            if site.out_features % shard.parts or per_part % tp:
                what = f"{shard.parts} parts of {per_part}" if shard.parts > 1 else f"{site.out_features}"
                raise LynxConfigError(f"{site.path}: {what} output features are not divisible by tp={tp}; "
                                      f"choose a tp that divides them; {DOCS_HINT}")
            for heads in site.heads:
                if heads and heads % tp:
                    raise LynxConfigError(f"{site.path}: its output is viewed as {heads} attention heads, not "
                                          f"divisible by tp={tp}; choose a tp that divides the heads (key/value "
                                          f"heads too, with grouped-query attention); {DOCS_HINT}")
        elif site.in_features % tp:
            raise LynxConfigError(f"{site.path}: {site.in_features} input features are not divisible by tp={tp}; "
                                  f"{DOCS_HINT}")


def shard_tensor(full: torch.Tensor, shard: LinearShard, kind: str, rank: int, tp: int) -> torch.Tensor:
    """TP rank ``rank``'s piece of a sharded linear's ``weight`` or ``bias`` (a new contiguous tensor)."""
    full = full.detach()
    if shard.style == "colwise":
        parts = full.reshape(shard.parts, full.shape[0] // shard.parts, *full.shape[1:])
        size = parts.shape[1] // tp
        return parts[:, rank * size:(rank + 1) * size].reshape(-1, *full.shape[1:]).contiguous()
    if kind != "weight":
        return full.clone()
    size = full.shape[1] // tp
    return full[:, rank * size:(rank + 1) * size].contiguous()
