"""One in-flight microbatch of a :class:`~lynx.rewrite.stage.StageModule`, and the call running its graphs.

:class:`MicrobatchState` is what the stage holds for a microbatch between its forward and its
release (the slot table, the dropped values brought back, the deferred weight-gradient graph,
the values on the host); :class:`MicrobatchStats` what recomputation cost it. :class:`RunStage`
is the ``torch.autograd.Function`` whose ``forward`` runs the stage's forward graph and whose
``backward`` runs the backward graph (on-demand recomputation inside it, or its input-gradient
part alone under zero bubble), so the stage stays an ordinary module to autograd.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lynx.errors import LynxRuntimeError
from lynx.rewrite.lower import LoweredStage
from lynx.rewrite.offload import HostStore, OffloadedValues

if TYPE_CHECKING:
    from lynx.rewrite.stage import StageModule

__all__ = ["MicrobatchStats", "MicrobatchState", "RunStage", "split_backward_peak", "count_backward_recompute"]


@dataclass
class MicrobatchStats:
    """What recomputation cost one microbatch on one stage."""

    prefetch_s: float = 0.0
    prefetch_nodes: int = 0
    on_demand_s: float = 0.0
    on_demand_nodes: int = 0
    dropped_handles: int = 0      # dropped saved values (each recomputed once)
    tp_hidden_s: float = 0.0      # recompute inside TP windows whose all-reduce was still in flight
    tp_exposed_s: float = 0.0     # ... whose all-reduce had completed (the wait did not block)
    tp_nodes: int = 0
    offloaded_bytes: int = 0      # copied to host memory after the forward (and back before the backward)


@dataclass
class MicrobatchState:
    """What a :class:`~lynx.rewrite.stage.StageModule` holds for one microbatch in flight."""

    lowered: LoweredStage
    slots: list[Any] | None                      # the slot table (see LoweredStage)
    available: set[int] = field(default_factory=set)   # dropped slots brought back
    recomputed: set[str] = field(default_factory=set)  # captured nodes already re-run
    held: dict[str, int] = field(default_factory=dict)  # meter bytes this microbatch added
    stats: MicrobatchStats = field(default_factory=MicrobatchStats)
    backward_done: bool = False
    attrs: tuple = ()                            # the parameter and buffer objects the graphs read
    # zero bubble: the backward runs its input-gradient part; the weight part waits here
    # ("unless_held": only if that part hands over no activation, else the whole backward runs)
    defer: bool | str = False
    weights: Any = None                          # the weight-gradient graph, until it runs
    weight_args: list[Any] | None = None         # its inputs: slots it reads, then the cross values
    cross_bytes: int = 0
    # offload: the values on the host, kept slot -> node issuing its prefetch, slots brought back
    offloaded: OffloadedValues | None = None
    offload_slots: dict[int, str | None] = field(default_factory=dict)
    prefetched: set[int] = field(default_factory=set)


class RunStage(torch.autograd.Function):
    """Forward graph in ``forward``; on-demand recompute and the backward graph in ``backward``."""

    @staticmethod
    def forward(ctx: Any, stage: "StageModule", state: MicrobatchState, *primals: torch.Tensor) -> Any:
        lowered = state.lowered
        if lowered.offload_slots:   # the forward graph hands the offloaded values to the host
            if stage._store is None:
                stage._store = HostStore(primals[0].device if primals else torch.device("cpu"))
            state.offloaded = OffloadedValues(stage._store)
            values = lowered.run_forward(state.offloaded, *primals)
        else:
            values = lowered.run_forward(*primals)
        n_out = lowered.joint.n_outputs
        state.slots = [*values[n_out:], *([None] * len(lowered.dropped_values))]
        ctx.stage, ctx.state = stage, state
        ctx.attrs = state.attrs = primals[:len(lowered.joint.attr_names)]
        outs = values[:n_out]
        ctx.mark_non_differentiable(*[o for o, g in zip(outs, lowered.joint.out_requires_grad) if not g])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        stage, state = ctx.stage, ctx.state
        if state.slots is None:
            raise LynxRuntimeError(f"stage {stage.index}: backward ran twice for one forward (retain_graph is "
                                   "not supported by compiled stages)")
        lowered = state.lowered
        sink = stage.on_param_grad is not None
        streamed = frozenset((i, at) for i, at in state.offload_slots.items() if i not in state.prefetched)
        graph = None
        if state.defer:   # zero bubble (not run with TP: lynx.runtime.executable.TP_SCHEDULES)
            graph, weights = lowered.split_backward_graphs(frozenset(state.available), sink, streamed)
            if state.defer == "unless_held" and (graph.cross_bytes or graph.offload_groups or weights.offload_groups
                                                 or split_backward_peak(graph, weights) != lowered.backward_graph(
                                                     frozenset(state.available), sink, stage.tp_targets(state),
                                                     streamed).extra_peak_bytes):
                # handing activations over, or each part regenerating on demand what it reads (both
                # may re-run a value the whole backward re-runs once), would hold other than the
                # plan counts for a backward (lynx.solvers.memory_microbatch): run it whole
                graph, state.defer = None, False
            else:
                state.weights = weights
        if graph is None:
            graph = lowered.backward_graph(frozenset(state.available), sink, stage.tp_targets(state), streamed)
        if graph.sink is not None:
            graph.sink.params = ctx.attrs
            graph.sink.on_grad = stage.on_param_grad
        slots, state.slots = state.slots, None
        args: list[Any] = []
        if state.offloaded is not None:   # window prefetches waited on; the rest the graph brings back
            state.offloaded.wait_pending()
            if graph.offload_groups:
                state.offloaded.begin(graph.offload_groups)
                args.append(state.offloaded)
        args += [slots[i] for i in graph.in_slots]
        if state.weights is not None:
            state.weight_args = [slots[i] for i in state.weights.in_slots]
        del slots
        args += [g for g, needs in zip(grads, lowered.joint.out_requires_grad) if needs]
        extra = graph.extra_peak_bytes
        if extra:  # what on-demand recomputation brings back above what the microbatch holds
            stage.meter.hold("stage", extra)
        graph.clock.total_s = 0.0
        if graph.tp_log is not None:
            graph.tp_log.reset()
        try:
            computed = graph.run(args)  # boxed: it empties ``args`` as it goes
        finally:
            if extra:
                stage.meter.free("stage", extra)
        count_backward_recompute(state, graph)
        if state.weights is not None:   # the cross values wait, with what they hold, for the weight part
            state.weight_args += list(computed[len(lowered.grad_of):])
            state.cross_bytes = graph.cross_bytes
            stage.meter.hold("stage", state.cross_bytes)
        else:
            state.backward_done = True
        result: list[Any] = [None] * (len(lowered.joint.attr_names) + lowered.joint.n_inputs)
        for index, grad in zip(lowered.grad_of, computed):
            result[index] = grad
        return (None, None, *result)


def split_backward_peak(first: Any, weights: Any) -> int:
    """What a split backward's meter rises to above the microbatch's held bytes: the larger of
    its input part's and its weight part's peaks (the values handed from one to the other in
    between)."""
    return max(first.extra_peak_bytes, first.cross_bytes + weights.extra_peak_bytes)


def count_backward_recompute(state: MicrobatchState, graph: Any) -> None:
    """What a backward graph recomputed: on demand, and inside TP windows."""
    if graph.nodes:
        fresh = graph.nodes - state.recomputed
        state.recomputed |= fresh
        state.stats.on_demand_s += graph.clock.total_s
        state.stats.on_demand_nodes += len(fresh)
    if graph.tp_nodes and graph.tp_log is not None:
        state.recomputed |= graph.tp_nodes
        state.stats.tp_hidden_s += graph.tp_log.hidden_s()
        state.stats.tp_exposed_s += graph.tp_log.exposed_s()
        state.stats.tp_nodes += len(graph.tp_nodes)
