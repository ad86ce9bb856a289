"""The ``torch.utils.checkpoint`` baseline of ``benchmarks/overlap_cpu.py``: a stage whose
dropped nodes run under non-reentrant checkpoint instead of Lynx's generated recompute.

:class:`CheckpointStage` re-emits a stage graph with each maximal run of consecutive dropped
nodes outlined into a submodule called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (its own RNG-state save and
re-run in backward) — for a Megatron-full drop set that is
Megatron's ``--recompute-granularity full``. Its peak saved bytes count the kept tensors,
checkpoint's held inputs and, through a dispatch mode active only during checkpoint's
re-run, every tensor the re-run produces while it is alive. Gradients are bitwise those of
keeping everything (checked in ``tests/runtime`` by the benchmark's users).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._python_dispatch
from torch import fx

from lynx.rewrite.saved import SavedBytesMeter
from lynx.rewrite.stage import MicrobatchStats

__all__ = ["CheckpointStage"]


class _RecomputeMeter(torch.utils._python_dispatch.TorchDispatchMode):
    """Registers every tensor an op produces while checkpoint recomputes (the saved ones stay
    alive until backward consumes them; the meter's weak references drop the others)."""

    def __init__(self, stage: "CheckpointStage") -> None:
        super().__init__()
        self.stage = stage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.stage.constant_ptrs:
                self.stage.meter.add(t, "stage")
        return out


class _Checkpointed(torch.nn.Module):
    """``torch.utils.checkpoint.checkpoint(sub, *args, use_reentrant=False)``, metering what it holds."""

    def __init__(self, sub: fx.GraphModule, n_out: int, meter: dict) -> None:
        super().__init__()
        self.sub, self.n_out = sub, n_out
        self.__dict__["meter"] = meter  # {"stage": CheckpointStage}, filled once the stage exists

    def forward(self, *args: torch.Tensor) -> tuple:
        from contextlib import nullcontext

        from torch.utils.checkpoint import checkpoint

        stage = self.meter["stage"]
        for a in args:  # checkpoint keeps its inputs for the re-run: resident like saved tensors
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in stage.constant_ptrs:
                stage.meter.add(a, "stage")
        out = checkpoint(self.sub, *args, use_reentrant=False,
                         context_fn=lambda: (nullcontext(), _RecomputeMeter(stage)))
        return tuple(out) if self.n_out > 1 else (out,)


class CheckpointStage(torch.nn.Module):
    """A stage that keeps everything except runs of ``dropped`` nodes, each executed under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (its own RNG-state save and
    re-run in backward). It runs eagerly (``gm(*args)``: plain PyTorch, the baseline) and offers
    what the runtime calls on a stage (``spec``, ``meter``, ``recompute`` — a no-op: checkpoint
    recomputes inside backward —, ``release``, ``forward_done``). Peak saved bytes count the kept
    tensors (a pack hook), checkpoint's held inputs and what its re-run produces until backward
    frees it, each storage once while it is alive."""

    def __init__(self, part: Any, dropped: set[str]) -> None:
        super().__init__()
        holder: dict = {}
        self.gm = _outline(part.gm, part.spec.nodes, set(dropped), holder)
        self.spec, self.index, self.dropped = part.spec, part.spec.index, frozenset()
        self._out_spec = part.out_spec
        self.meter = SavedBytesMeter()
        self.constant_ptrs = {t.untyped_storage().data_ptr() for t in (*self.gm.parameters(), *self.gm.buffers())}
        self._in_flight: dict[int, MicrobatchStats] = {}
        holder["stage"] = self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.constant_ptrs:
            self.meter.add(t, "boundary" if ptr in self._received else "stage")
        return t

    def forward(self, *args: torch.Tensor, microbatch: int = 0) -> Any:
        self._received = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        self._in_flight[microbatch] = MicrobatchStats()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            out = self.gm(*args)
        if self.spec.is_last:
            flat = list(out) if isinstance(out, (tuple, list)) else [out]
            return torch.utils._pytree.tree_unflatten(flat, self._out_spec) if self._out_spec is not None else out
        for t in out:  # what the stage sends stays referenced until its backward (as StageModule counts it)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.constant_ptrs:
                self.meter.add(t, "stage")
        return tuple(out)

    def recompute(self, microbatch: int, nodes: Any, *, on_demand: bool = False) -> None:
        """Nothing to do ahead of time: checkpoint re-runs its segments inside backward."""

    def forward_done(self, microbatch: int) -> bool:
        return microbatch in self._in_flight

    def stats(self, microbatch: int) -> MicrobatchStats:
        return self._in_flight[microbatch]

    def release(self, microbatch: int) -> MicrobatchStats:
        return self._in_flight.pop(microbatch)


def _outline(gm: fx.GraphModule, order: list[str], dropped: set[str], holder: dict) -> fx.GraphModule:
    """Copy of ``gm`` in which each maximal run of consecutive ``dropped`` op nodes is one
    checkpointed submodule (inputs: what the run reads from outside; outputs: what is read after)."""
    import operator

    runs: list[list[str]] = []
    prev = None
    for name in order:
        if name in dropped:
            if runs and runs[-1][-1] == prev:
                runs[-1].append(name)
            else:
                runs.append([name])
        prev = name
    run_of = {n: k for k, run in enumerate(runs) for n in run}
    nodes = {n.meta.get("lynx_name", n.name): n for n in gm.graph.nodes}
    root = torch.nn.Module()
    for name, mod in gm.named_children():
        root.add_module(name, mod)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, b)
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        name = node.meta.get("lynx_name", node.name)
        k = run_of.get(name)
        if k is None:
            env[node] = graph.node_copy(node, lambda a: env[a])
            continue
        if name != runs[k][-1]:
            continue  # emitted at the end of its run, when all of the run's inputs exist
        members = [nodes[n] for n in runs[k]]
        inside = set(members)
        inputs = list(dict.fromkeys(a for m in members for a in m.all_input_nodes if a not in inside))
        outputs = [m for m in members if any(u not in inside for u in m.users)]
        sub_graph, sub_env = fx.Graph(), {}
        for a in inputs:
            sub_env[a] = sub_graph.placeholder(a.name)
        for m in members:
            sub_env[m] = sub_graph.node_copy(m, lambda a: sub_env[a])
        sub_graph.output(tuple(sub_env[o] for o in outputs) if len(outputs) > 1 else sub_env[outputs[0]])
        root.add_module(f"ckpt{k}", _Checkpointed(fx.GraphModule(gm, sub_graph), len(outputs), holder))
        call = graph.call_module(f"ckpt{k}", tuple(env[a] for a in inputs))
        call.meta["lynx_name"] = f"ckpt{k}"
        for i, o in enumerate(outputs):
            env[o] = graph.call_function(operator.getitem, (call, i))
            env[o].meta = {**o.meta}
    return fx.GraphModule(root, graph)


