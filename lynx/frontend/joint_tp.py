"""The joint graph of a tensor-parallel stage: local shards in, functional collectives inside.

:func:`lynx.frontend.joint.trace_joint` with ``tp=TPContext(mesh, plan)`` runs the captured
stage graph through :class:`TPRunner` while AOTAutograd traces it. The primals are this
rank's tensors — the local shards of the linear layers the
:class:`~lynx.frontend.sharding.ShardingPlan` shards, the others whole — and the runner makes
``DTensor`` s of them inside the traced function (``DTensor.from_local``), so DTensor's own
sharding propagation and redistribution, and their autograd, produce the collectives: the
joint graph holds ``_c10d_functional.all_reduce`` / ``wait_tensor`` pairs and nothing
hand-written.

What the runner decides itself is where the collectives go (DTensor's propagation alone
picks by a local cost and gathered small weights in a trial): at each sharded linear of the
captured graph it runs the layer as ``ColwiseParallel`` / ``RowwiseParallel`` do —

* **column-parallel**: the input, replicated, is made local once per value with a partial
  gradient (``x.redistribute(Replicate).to_local(grad_placements=[Partial()])``), shared by
  every column-parallel linear reading it, so the gradients of q, k and v (or gate and up)
  are summed locally and all-reduced **once** when autograd leaves the shared conversion —
  Megatron's two backward all-reduces per layer without fusing q/k/v or gate/up (fusing would
  not halve anything more). A fused output split into equal parts (GPT's ``qkv``) is split
  locally, one shard per part.
* **row-parallel**: the sharded input's local shard times the local weight is a partial sum,
  all-reduced (``DTensor.from_local(.., [Partial()]).redistribute(Replicate)``), then the
  bias is added: one forward all-reduce per row-parallel linear.

Between them DTensor propagates the sharding through views, attention and activations
(``scaled_dot_product_attention``'s CPU kernel gets a heads-sharded strategy here, which
DTensor lacks). Everything outside stays replicated; the stage's outputs are replicated
(``to_local``). Random ops draw from each rank's own generator: ranks of one TP group are
seeded alike, so a replicated dropout draws the same mask everywhere (a sharded one draws
the same mask for each rank's local heads — not the unsharded model's; Megatron seeds its
TP regions apart).

Example (two processes; see ``tests/runtime/test_tp_pipeline.py``)::

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    joint = trace_joint(stage_gm, inputs, attrs=local_shards(stage_gm, plan, mesh), tp=TPContext(mesh, plan))
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from lynx.errors import LynxConfigError
from lynx.frontend.joint import GraphRunner, fetch_attr
from lynx.frontend.sharding import DOCS_HINT, LinearShard, ShardingPlan
from lynx.torch_private import tree_flatten, tree_map

__all__ = ["TPContext", "TPRunner", "local_shards", "is_collective", "collective_kind", "register_strategies",
           "collective_origin", "issued_collectives", "check_collectives"]

_LINEAR = torch.ops.aten.linear.default
_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default)


_CAT = torch.ops.aten.cat.default


def _legacy_empty(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == 0


def _with_args(n: fx.Node, args: tuple) -> fx.Node:
    """A stand-in for ``n`` with other arguments, for the interpreter only (the graph is left as it is)."""
    stand_in = fx.Graph().create_node(n.op, n.target, (), dict(n.kwargs), name=n.name)
    stand_in.args, stand_in.meta = args, n.meta
    return stand_in


def is_collective(node: fx.Node) -> bool:
    """Whether joint node ``node`` is a functional collective or its ``wait_tensor``."""
    return node.op == "call_function" and "_c10d_functional" in str(node.target)


def collective_kind(node: fx.Node) -> str | None:
    """``"all_reduce"``, ``"wait_tensor"``, ... for a functional collective node, else ``None``."""
    if not is_collective(node):
        return None
    return str(node.target).split(".")[-2]


@dataclass(frozen=True)
class TPContext:
    """A stage's tensor-parallel group (``mesh``: 1-D) and its sharding plan."""

    mesh: Any
    plan: ShardingPlan

    @property
    def rank(self) -> int:
        return int(self.mesh.get_local_rank())

    @property
    def size(self) -> int:
        return int(self.mesh.size())

    @property
    def key(self) -> tuple:
        return ("tp", self.size, self.rank, tuple(sorted((p, s.record()) for p, s in self.plan.shards.items())))

    def runner(self, gm: fx.GraphModule, env: dict[str, Any], clone: frozenset[int]) -> "TPRunner":
        return TPRunner(gm, env, clone, self)


def local_shards(gm: fx.GraphModule, plan: ShardingPlan, rank: int) -> dict[str, torch.Tensor]:
    """This TP rank's tensors for the parameters and buffers ``gm`` reads: sharded linears'
    local pieces (:func:`~lynx.frontend.sharding.shard_tensor`), the rest as they are."""
    from lynx.frontend.sharding import shard_tensor

    names = list(dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "get_attr"
                               and isinstance(fetch_attr(gm, n.target), torch.Tensor)))
    sharded = plan.sharded_params(names)
    out = {}
    for name in names:
        full = fetch_attr(gm, name)
        if name in sharded:
            shard, kind = sharded[name]
            out[name] = shard_tensor(full, shard, kind, rank, plan.tp)
        else:
            out[name] = full
    return out


class _Fused:
    """A fused column-parallel output awaiting its split (local pieces, one per part)."""

    def __init__(self, local: torch.Tensor, shard: LinearShard, path: str) -> None:
        self.local, self.shard, self.path = local, shard, path


class TPRunner(GraphRunner):
    """Runs a captured stage graph tensor-parallel on DTensors (see module docstring)."""

    def __init__(self, gm: fx.GraphModule, attrs: dict[str, Any], clone: frozenset[int], ctx: TPContext) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        register_strategies()
        self.ctx, self.mesh = ctx, ctx.mesh
        self.sharded = ctx.plan.sharded_params(list(attrs))
        wrapped = {name: value if name in self.sharded or not isinstance(value, torch.Tensor)
                   else DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
                   for name, value in attrs.items()}
        super().__init__(gm, wrapped, clone, False)
        self.linears: dict[str, tuple[LinearShard, str]] = {}
        for n in gm.graph.nodes:
            weight: Any = n.args[1] if len(n.args) > 1 else None
            if n.op == "call_function" and n.target is _LINEAR and isinstance(weight, fx.Node) \
                    and weight.op == "get_attr":
                shard = ctx.plan.shard_of(str(weight.target))
                if shard is not None:
                    self.linears[n.name] = (shard, str(weight.target).rsplit(".", 1)[0])
        self._col_inputs: dict[fx.Node, torch.Tensor] = {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        wrapped = [DTensor.from_local(a, self.mesh, [Replicate()], run_check=False) if isinstance(a, torch.Tensor)
                   else a for a in args]
        return super().run(*wrapped, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        if n.op == "call_function":
            if n.name in self.linears:
                with fx.traceback.set_current_meta(n):
                    return self._linear(n)
            first: Any = n.args[0] if n.args else None
            if n.target in _SPLITS and isinstance(self.env.get(first), _Fused):
                with fx.traceback.set_current_meta(n):
                    return self._split(self.env[first])
            fused = next((self.env[a] for a in n.all_input_nodes if isinstance(self.env.get(a), _Fused)), None)
            if fused is not None:
                raise LynxConfigError(f"{fused.path}: its output, sharded in {fused.shard.parts} parts, is read by "
                                      f"{n.name} ({n.target}) and not only split into those parts; shard it without "
                                      f"parts or leave it out of tp_plan; {DOCS_HINT}")
        parts: Any = n.args[0] if n.target is _CAT else None
        if isinstance(parts, (list, tuple)) and any(_legacy_empty(self.env.get(a)) for a in parts):
            # torch.cat skips 1-D empty tensors (a fresh KV cache's); DTensor's rule would not
            kept = [a for a in parts if not _legacy_empty(self.env.get(a))]
            n = _with_args(n, (kept, *n.args[1:]))
        try:
            out = super().run_node(n)
        except NotImplementedError as err:  # DTensor has no sharding rule for the op
            out = self._run_replicated(n)
            if out is None:  # ... and it reads sharded values
                raise LynxConfigError(f"node {n.name} ({n.target}) cannot run tensor-parallel under this sharding "
                                      f"plan: {str(err).splitlines()[0]}; keep the layers around it replicated "
                                      f"(tp_plan=) or use tp=1; {DOCS_HINT}") from err
        if n.op == "call_function":  # factory ops (arange, ...) make plain tensors: replicated
            out = tree_map(lambda v: DTensor.from_local(v, self.mesh, [Replicate()], run_check=False)
                           if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v, out)
        return out

    def _run_replicated(self, n: fx.Node) -> Any:
        """An op DTensor has no rule for, on replicated values only (a lifted constant's
        ``lift_fresh_copy``, a cache's bookkeeping): every rank holds the same inputs, so it runs
        on the local tensors and its outputs are replicated. ``None`` if it reads a sharded value."""
        from torch.distributed.tensor import DTensor, Replicate

        if n.op != "call_function" or not callable(n.target):
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        leaves, _ = tree_flatten((args, kwargs))
        if any(isinstance(v, _Fused) or isinstance(v, DTensor) and any(not isinstance(p, Replicate)
                                                                       for p in v.placements) for v in leaves):
            return None
        local = tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, (args, kwargs))
        with fx.traceback.set_current_meta(n):
            return n.target(*local[0], **local[1])

    def _linear(self, n: fx.Node) -> Any:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        shard, path = self.linears[n.name]
        x_node: Any = n.args[0]
        weight_node: Any = n.args[1]
        x = self.env[x_node]
        weight = self.attrs[str(weight_node.target)]
        bias_node = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        bias = self.attrs[str(bias_node.target)] if isinstance(bias_node, fx.Node) else None
        if shard.style == "colwise":
            local_in = self._col_inputs.get(x_node)
            if local_in is None:
                # one conversion per input value: its gradient sums every reader's partial
                # gradient locally, then one all-reduce (Megatron's "f")
                local_in = x.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
                self._col_inputs[x_node] = local_in
            local = _LINEAR(local_in, weight, bias)
            if shard.parts > 1:
                return _Fused(local, shard, path)
            return DTensor.from_local(local, self.mesh, [Shard(local.ndim - 1)], run_check=False)
        local_in = x.redistribute(self.mesh, [Shard(x.ndim - 1)]).to_local()
        partial = DTensor.from_local(_LINEAR(local_in, weight), self.mesh, [Partial()], run_check=False)
        out = partial.redistribute(self.mesh, [Replicate()])   # the all-reduce (Megatron's "g")
        return out + bias if bias is not None else out

    def _split(self, fused: _Fused) -> list[Any]:
        from torch.distributed.tensor import DTensor, Shard

        pieces = fused.local.chunk(fused.shard.parts, dim=-1)
        return [DTensor.from_local(p, self.mesh, [Shard(p.ndim - 1)], run_check=False) for p in pieces]

    def output(self, target: Any, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        flat, _ = tree_flatten(args[0])
        out = []
        for i, v in enumerate(flat):
            if isinstance(v, DTensor):
                if any(p != Replicate() for p in v.placements):
                    v = v.redistribute(self.mesh, [Replicate()])
                v = v.to_local()
            out.append(v.clone() if i in self.clone else v)
        return tuple(out)


@functools.lru_cache(maxsize=1)
def register_strategies() -> None:
    """Heads-sharded strategies for the CPU flash-attention kernel ``scaled_dot_product_attention``
    dispatches to (DTensor registers them for the CUDA kernels only), via DTensor's
    ``register_sharding``: q, k, v, output and logsumexp sharded on the heads (dim 1), a
    mask replicated when it broadcasts over heads; or everything replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    # the CPU kernel scaled_dot_product_attention dispatches to, and its backward
    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def mask_placements(attn_mask: Any) -> tuple[Any, Any]:
        if attn_mask is None:
            return None, None
        heads = Shard(1) if len(attn_mask.shape) == 4 and attn_mask.shape[1] != 1 else Replicate()
        return Replicate(), heads

    @register_sharding(forward_op)
    def _forward(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, *,
                 attn_mask: Any = None, scale: Any = None) -> list:
        rep, heads = Replicate(), Shard(1)
        m_rep, m_heads = mask_placements(attn_mask)
        return [([rep, rep], [rep, rep, rep, None, None, m_rep, None]),
                ([heads, heads], [heads, heads, heads, None, None, m_heads, None])]

    @register_sharding(backward_op)
    def _backward(grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float, is_causal: bool, *,
                  attn_mask: Any = None, scale: Any = None) -> list:
        rep, heads = Replicate(), Shard(1)
        m_rep, m_heads = mask_placements(attn_mask)
        return [([rep, rep, rep], [rep] * 6 + [None, None, m_rep, None]),
                ([heads, heads, heads], [heads] * 6 + [None, None, m_heads, None])]


def collective_origin(n: fx.Node, origin: Mapping[str, str]) -> str:
    """The captured node a collective comes from: its own tag, else that of the value it reduces
    (a backward all-reduce made by autograd leaving a redistribution carries no tag itself)."""
    stack, seen = [n], set()
    while stack:
        m = stack.pop(0)
        if m.name in origin:
            return origin[m.name]
        seen.add(m)
        stack.extend(a for a in m.all_input_nodes if a not in seen)
    return ""


def issued_collectives(joint: Any, forward: set[fx.Node], layer_of: dict[str, Any]) -> dict[Any, dict[str, list]]:
    """Per layer, ``{"forward": [...], "backward": [...]}`` of ``(kind, bytes)`` for each collective
    the joint graph issues (``wait_tensor`` left out), in graph order."""
    out: dict[Any, dict[str, list]] = {}
    for n in joint.gm.graph.nodes:
        kind = collective_kind(n)
        if kind is None or kind == "wait_tensor":
            continue
        layer = layer_of.get(collective_origin(n, joint.origin))
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        nbytes = int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0
        out.setdefault(layer, {"forward": [], "backward": []})["forward" if n in forward else "backward"].append(
            (kind, nbytes))
    return out


def check_collectives(issued: dict[Any, dict[str, list]], expected: dict[Any, dict[str, list[int]]],
                      stage: int) -> None:
    """Refuse a stage whose traced graph issues other collectives than the plan priced (the
    profile's all-reduces per layer, :func:`lynx.frontend.tp_profile.expected_collectives`): the
    plan's TP windows and step time would not be the ones that run."""
    for layer in sorted(set(issued) | set(expected), key=lambda v: (v is None, v if v is not None else 0)):
        for phase in ("forward", "backward"):
            got = issued.get(layer, {}).get(phase, [])
            want = [("all_reduce", b) for b in expected.get(layer, {}).get(phase, [])]
            if sorted(got) != sorted(want):
                where = f"layer {layer}" if layer is not None else "outside the layers"
                raise LynxConfigError(
                    f"stage {stage}: the tensor-parallel graph issues {got} in the {phase} {where}, but the plan "
                    f"priced {want}: DTensor had to redistribute where the sharding plan does not say how (an op "
                    f"between a column- and a row-parallel linear that has no sharded rule, or a sharded value "
                    f"read outside them); adjust tp_plan or keep those layers replicated; {DOCS_HINT}")
