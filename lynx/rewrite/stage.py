"""An executable pipeline stage running the generated graphs its plan lowers to.

:class:`StageModule` traces its stage's joint forward/backward graph with AOTAutograd on the
first call (:mod:`lynx.frontend.joint`; cached per input signature) and partitions it along
the plan (:mod:`lynx.rewrite.lower`): a forward graph that returns the stage's outputs and
exactly the values the plan keeps, recompute graphs that bring back the dropped ones, and a
backward graph. One ``torch.autograd.Function`` call per microbatch runs them, so the stage
stays an ordinary module: ``stage(*inputs, microbatch=j)`` then ``loss.backward()`` (or
``torch.autograd.backward`` on the sent values) works as with any module, and gradients land
in the user's parameters' ``.grad`` — bitwise those of the original model, because the graphs
are the joint graph's own ops in the joint graph's order and random ops replay their RNG state.

:meth:`StageModule.recompute` runs the recompute graph for a set of dropped nodes of an
in-flight microbatch (the runtime calls it inside communication windows); whatever is still
missing when backward starts is recomputed on demand inside the backward graph, each value
just before its first reader (the backward graph is built per set of prefetched values).

``stage.meter`` (:class:`lynx.rewrite.saved.SavedBytesMeter`) counts, under ``"stage"``, what
the plan predicts: kept saved values, recomputed values and the values the stage sends, from
the storage sizes the lowering computed.

What the stage holds per microbatch in flight, and the ``torch.autograd.Function`` running its
graphs: :mod:`lynx.rewrite.microbatch`.

Example::

    >>> import torch
    >>> from lynx.rewrite import StageModule, split_graph
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> part = split_graph(gm, [[n.name for n in gm.graph.nodes if n.op == "call_function"]])[0]
    >>> stage = StageModule(part, dropped={"linear"})
    >>> out = stage(torch.randn(2, 4), microbatch=0)
    >>> out.sum().backward()   # the linear output GELU saved is recomputed on demand here
    >>> stage.stats(0).on_demand_nodes
    1
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lynx.errors import LynxConfigError, LynxPlanError, LynxRuntimeError
from lynx.frontend.joint import classify, signature_of, trace_joint
from lynx.frontend.joint_reuse import reusable
from lynx.frontend.joint_tp import check_collectives, issued_collectives
from lynx.rewrite.lower import LoweredStage, lower
from lynx.rewrite.microbatch import MicrobatchState, MicrobatchStats, RunStage, count_backward_recompute
from lynx.rewrite.offload import HostStore
from lynx.rewrite.saved import SavedBytesMeter
from lynx.rewrite.split import StageGraph
from lynx.rewrite.tp_windows import backward_allreduces, window_targets
from lynx.torch_private import tree_unflatten

__all__ = ["StageModule", "MicrobatchStats"]



class StageModule(nn.Module):
    """Stage ``spec.index`` of a split graph whose ``dropped`` nodes' saved values are recomputed.

    ``forward(*inputs, *received, microbatch=j)`` takes the model inputs the stage reads
    (``spec.inputs``) then the values received from the previous stage (``spec.recv``) and
    returns the tuple the next stage receives (``spec.send``), or the model's output on the
    last stage. Several microbatches may be in flight; each keeps its own values.
    """

    def __init__(self, part: StageGraph, dropped: Iterable[str] = (), *, producer_of: dict[str, str] | None = None,
                 out_spec: Any = None, compile: bool = False, tp: Any = None,
                 offload: Mapping[str, str | None] | None = None) -> None:
        super().__init__()
        self.gm = part.gm
        # a lynx.frontend.joint_tp.TPContext: the stage runs tensor-parallel (part holds its shards)
        self.tp = tp
        # set by the runtime: microbatch -> [(layer L, nodes)] of the plan's TP windows, and each
        # captured node's layer (which layer's all-reduces a window's recompute runs inside)
        self.tp_windows: dict[int, list[tuple[int, list[str]]]] = {}
        self.layer_of: dict[str, int] = {}
        # per layer, the all-reduces the plan priced (lynx.frontend.tp_profile.expected_collectives):
        # a traced graph issuing others is refused
        self.expected_collectives: dict[Any, dict[str, list[int]]] | None = None
        self._collectives: dict[int, list] = {}
        self.spec = part.spec
        self.index = part.spec.index
        self.dropped = frozenset(dropped)
        unknown = sorted(self.dropped - set(self.spec.nodes))
        if unknown:
            raise LynxPlanError(f"stage {self.index}: plan drops nodes that are not in this stage: {unknown[:5]}")
        # offloaded node -> the node whose backward issues its prefetch (None: the backward's start)
        self.offload = dict(offload or {})
        self._check_offload(compile)
        self._store: HostStore | None = None
        self._out_spec = out_spec if out_spec is not None else part.out_spec
        self.compile_graphs = compile  # (not `compile`: nn.Module.compile is a method)
        self._lowered: dict[tuple, LoweredStage] = {}
        self._attrs: dict[tuple, list] = {}
        self._forward_bytes: dict[tuple, dict[str, int]] = {}
        self._states: dict[int, MicrobatchState] = {}
        self.meter = SavedBytesMeter()
        # set (e.g. by the data-parallel runtime): parameter gradients are accumulated inside the
        # backward graph as soon as each is final, then this is called with the parameter
        self.on_param_grad: Any = None

    def _check_offload(self, compile: bool) -> None:
        nodes = set(self.spec.nodes)
        unknown = sorted(set(self.offload) - nodes) + sorted(a for a in self.offload.values() if a and a not in nodes)
        if unknown:
            raise LynxPlanError(f"stage {self.index}: plan offloads (or prefetches at) nodes that are not in this "
                                f"stage: {unknown[:5]}")
        both = sorted(self.dropped & set(self.offload))
        if both:
            raise LynxPlanError(f"stage {self.index}: {both[0]!r} is both recomputed and offloaded")
        if self.offload and compile:
            raise LynxConfigError(f"stage {self.index}: offload runs its copies from the generated graphs, which "
                                  "torch.compile would trace through; run offload plans with compile=False")

    def lowered(self, *args: Any) -> LoweredStage:
        """The graphs this stage runs for inputs like ``args`` (traced and partitioned once)."""
        key = signature_of(args)
        found = self._lowered.get(key)
        if found is None and self.tp is not None and self.expected_collectives is not None:
            joint = trace_joint(self.gm, list(args), tp=self.tp)
            check_collectives(issued_collectives(joint, classify(joint).forward, self.layer_of),
                              self.expected_collectives, self.index)
        if found is None:
            joint = trace_joint(self.gm, list(args), tp=self.tp, reuse=reusable)
            found = self._lowered[key] = lower(joint, self.dropped,
                                               compile=self.compile_graphs, model_inputs=len(self.spec.inputs),
                                               offload=self.offload)
        return found

    # ----------------------------------------------------------------- forward
    def forward(self, *args: Any, microbatch: int = 0) -> Any:
        expected = len(self.spec.inputs) + len(self.spec.recv)
        if len(args) != expected:
            raise LynxRuntimeError(
                f"stage {self.index} takes {expected} tensors ({self.spec.inputs + self.spec.recv}), got {len(args)}")
        if microbatch in self._states:
            raise LynxRuntimeError(f"stage {self.index}: microbatch {microbatch} is already in flight; "
                                   "run its backward (and release) before reusing the id")
        key = signature_of(args)
        lowered = self._lowered.get(key) or self.lowered(*args)
        state = MicrobatchState(lowered, None)
        attrs = self._attrs.get(key)
        if attrs is None:  # the parameter and buffer objects (updated in place by optimizers)
            attrs = self._attrs[key] = [_fetch_attr(self.gm, name) for name in lowered.joint.attr_names]
        self._states[microbatch] = state
        try:
            out = RunStage.apply(self, state, *attrs, *args)
        except BaseException:
            del self._states[microbatch]
            raise
        state.stats.dropped_handles = len(lowered.dropped_values)
        held = self._forward_bytes.get(key)
        if held is None:  # per category, what one forward leaves behind (static per lowering)
            held = {}
            for i in range(lowered.first_dropped_slot):
                if i in lowered.offload_slots:
                    continue   # on the host from the forward graph on
                category = lowered.category_of_slot[i]
                held[category] = held.get(category, 0) + lowered.bytes_of_slot[i]
            if not self.spec.is_last:
                # what the stage sends stays referenced until this microbatch's backward; the plan
                # counts a value a later stage saves on the stage that produced it
                held["stage"] = held.get("stage", 0) + lowered.send_bytes
            self._forward_bytes[key] = held
        for category, nbytes in held.items():
            self.meter.hold(category, nbytes)
        state.held = dict(held)
        if state.offloaded is not None:
            state.offload_slots = {i: self.offload[node] for i, node in lowered.offload_slots.items()}
            state.stats.offloaded_bytes = sum(lowered.bytes_of_slot[i] for i in lowered.offload_slots)
        out = tuple(out)
        if self.spec.is_last:
            if self._out_spec is not None:
                return tree_unflatten(list(out), self._out_spec)
            return out[0] if len(out) == 1 else out
        return out

    def backward_graphs(self) -> list[Any]:
        """The backward graphs generated so far (:class:`~lynx.rewrite.emit.BackwardGraph`), for
        inspecting their code (e.g. where a TP window's recompute sits)."""
        return [g for lowered in self._lowered.values() for g in lowered.backward_graphs()]

    def tp_targets(self, state: MicrobatchState) -> tuple[tuple[int, frozenset[int]], ...]:
        """The dropped slots to recompute inside this microbatch's TP windows (see
        :func:`lynx.rewrite.tp_windows.window_targets`); ``()`` without TP windows."""
        microbatch = next((j for j, s in self._states.items() if s is state), None)
        windows = self.tp_windows.get(microbatch) if microbatch is not None else None
        if not windows:
            return ()
        lowered = state.lowered
        collectives = self._collectives.get(id(lowered))
        if collectives is None:
            collectives = self._collectives[id(lowered)] = backward_allreduces(lowered.joint.gm,
                                                                               lowered.forward_nodes)
        return window_targets(collectives, lowered.joint.origin, self.layer_of, windows, lowered.dropped_by_node,
                              frozenset(state.available))

    # --------------------------------------------------------------- recompute
    def recompute(self, microbatch: int, nodes: Iterable[str], *, on_demand: bool = False) -> None:
        """Bring back the dropped saved values of ``nodes`` for ``microbatch`` (one generated graph)."""
        state = self._state(microbatch)
        names = list(nodes)
        bad = [n for n in names if n not in self.dropped]
        if bad:
            raise LynxPlanError(f"stage {self.index}: {bad[0]} is not dropped, nothing to recompute")
        lowered = state.lowered
        targets = frozenset(i for n in names for i in lowered.dropped_by_node.get(n, ()) if i not in state.available)
        if targets:
            self._run_recompute(state, targets, on_demand)

    def _run_recompute(self, state: MicrobatchState, targets: frozenset[int], on_demand: bool) -> None:
        if state.slots is None:
            raise LynxRuntimeError(f"stage {self.index}: this microbatch's backward already ran")
        start = time.perf_counter()
        graph = state.lowered.recompute_graph(targets, frozenset(state.available))
        slots = state.slots
        args = [slots[i] for i in graph.in_slots]
        host = [k for k, i in enumerate(graph.in_slots) if args[k] is None and i in state.offload_slots]
        if host:   # offloaded inputs the window has not brought back: fetched for this graph only
            assert state.offloaded is not None
            for k, value in zip(host, state.offloaded.restore([graph.in_slots[k] for k in host])):
                args[k] = value
            state.offloaded.wait_pending()
        with torch.no_grad():
            values = graph.run(*args)
        del args
        for i, value in zip(graph.out_slots, values):
            slots[i] = value
        state.available.update(graph.out_slots)
        fresh = graph.nodes - state.recomputed
        state.recomputed |= fresh
        if graph.out_bytes:
            self.meter.hold("stage", graph.out_bytes)
            state.held["stage"] = state.held.get("stage", 0) + graph.out_bytes
        elapsed = time.perf_counter() - start
        if on_demand:
            state.stats.on_demand_s += elapsed
            state.stats.on_demand_nodes += len(fresh)
        else:
            state.stats.prefetch_s += elapsed
            state.stats.prefetch_nodes += len(fresh)

    # -------------------------------------------------------------- zero bubble
    def defer_weights(self, microbatch: int, *, unless_held: bool = False) -> None:
        """Make ``microbatch``'s next backward compute only the input gradients (and the weight
        gradients the same kernels give); :meth:`backward_weight` computes the rest later.

        ``unless_held``: only where the input-gradient part hands the weight part no activation
        (nothing recomputed or offloaded crosses over) and the parts' peak is the whole
        backward's, so the split holds the saved bytes the whole backward does (what plans
        count); else the backward runs whole (:meth:`weights_pending` says which)."""
        state = self._state(microbatch)
        if unless_held and self.tp is not None:
            return   # a tensor-parallel backward runs whole (its all-reduces and windows in order)
        state.defer = "unless_held" if unless_held else True

    def weights_pending(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s weight gradients wait for :meth:`backward_weight`."""
        state = self._states.get(microbatch)
        return state is not None and state.weights is not None

    def backward_weight(self, microbatch: int) -> None:
        """The deferred weight gradients of ``microbatch``, accumulated into the parameters'
        ``.grad`` (``on_param_grad`` told of each as it is final)."""
        state = self._states.get(microbatch)
        if state is None or state.weights is None:
            raise LynxRuntimeError(f"stage {self.index}: microbatch {microbatch} has no input-gradient backward "
                                   "waiting for its weight gradients (defer_weights, then backward, first)")
        graph, args = state.weights, state.weight_args or []
        state.weights, state.weight_args = None, None
        if graph.offload_groups:   # offloaded values only the weight gradients read come back here
            assert state.offloaded is not None
            state.offloaded.begin(graph.offload_groups)
            args.insert(0, state.offloaded)
        if graph.sink is not None:
            graph.sink.params = state.attrs
            graph.sink.on_grad = self.on_param_grad
        extra = graph.extra_peak_bytes
        if extra:
            self.meter.hold("stage", extra)
        graph.clock.total_s = 0.0
        try:
            # as autograd's engine runs the whole backward graph: nothing recorded, and a gradient
            # summed in place into a .grad that is a view (a data-parallel bucket's) is allowed
            with torch.no_grad():
                graph.run(args)   # boxed: it empties ``args`` as it goes
        finally:
            if extra:
                self.meter.free("stage", extra)
            self.meter.free("stage", state.cross_bytes)
            state.cross_bytes = 0
        count_backward_recompute(state, graph)
        state.backward_done = True

    # ----------------------------------------------------------------- offload
    def prefetch(self, microbatch: int, nodes: Iterable[str]) -> None:
        """Bring the offloaded values of ``nodes`` back for ``microbatch`` (a window's prefetch;
        on CUDA asynchronously, waited on when the backward starts)."""
        state = self._state(microbatch)
        bad = [n for n in nodes if n not in self.offload]
        if bad:
            raise LynxPlanError(f"stage {self.index}: {bad[0]} is not offloaded, nothing to prefetch")
        if state.offloaded is None or state.slots is None:
            return
        names, lowered = set(nodes), state.lowered
        slots = [i for i in state.offload_slots if i not in state.prefetched and lowered.offload_slots[i] in names]
        for i, value in zip(slots, state.offloaded.restore(slots) if slots else ()):
            state.slots[i] = value
        state.prefetched.update(slots)
        nbytes = sum(lowered.bytes_of_slot[i] for i in slots)
        self.meter.hold("stage", nbytes)
        state.held["stage"] = state.held.get("stage", 0) + nbytes

    # ---------------------------------------------------------------- lifecycle
    def _state(self, microbatch: int) -> MicrobatchState:
        state = self._states.get(microbatch)
        if state is None or state.slots is None and not state.backward_done:
            raise LynxRuntimeError(f"stage {self.index}: microbatch {microbatch} has no finished forward")
        return state

    def stats(self, microbatch: int) -> MicrobatchStats:
        return self._state(microbatch).stats

    def release(self, microbatch: int) -> MicrobatchStats:
        """Forget ``microbatch`` after its backward; returns what was measured for it."""
        state = self._states.pop(microbatch, None)
        if state is None:
            raise LynxRuntimeError(f"stage {self.index}: microbatch {microbatch} is not in flight")
        for category, nbytes in state.held.items():
            self.meter.free(category, nbytes)
        state.held, state.slots = {}, None
        if state.offloaded is not None:
            state.offloaded.release()
            state.offloaded = None
        return state.stats

    def forward_done(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s forward ran and its backward has not been released."""
        state = self._states.get(microbatch)
        return state is not None and state.slots is not None

    def in_flight(self) -> list[int]:
        return sorted(self._states)


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
