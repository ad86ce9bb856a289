"""An executable pipeline stage that drops the saved tensors its plan drops and recomputes them.

:class:`StageModule` runs one stage's captured graph node by node (an ``fx.Interpreter``).
While it runs, a ``saved_tensors_hooks`` pack hook looks up who owns each tensor autograd
saves (the profile's attribution, :class:`lynx.rewrite.saved.SaveTracker`): tensors owned by
kept nodes, parameters and values from outside the stage are kept; tensors owned by dropped
nodes are replaced by a small handle. :meth:`StageModule.recompute` re-runs dropped nodes of a
microbatch from the kept values, restoring the RNG state saved before each random node so
dropout draws the same mask, and caches what the re-run op saves (in the same order the
forward saved it). During backward the unpack hook reads the cache, recomputing on demand only
what was not prefetched, and frees each entry once its last reader has unpacked it.
Gradients are bitwise those of the original model.

``stage.meter`` (:class:`lynx.rewrite.saved.SavedBytesMeter`) counts, under ``"stage"``, what
the stage holds for backward, as the plan's prediction does: kept saved tensors, what
recomputation brings back (what the re-run op saves and, when a consumer saved the dropped
node's output, that output) until its last reader, and the values it sends, held until the
microbatch's backward (a later stage saves them; the plan counts them on the producer).

Example::

    >>> import torch
    >>> from lynx.rewrite import StageModule, split_graph
    >>> from torch import fx
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
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from lynx.errors import LynxPlanError, LynxRuntimeError
from lynx.rewrite.saved import SavedBytesMeter, SaveTracker, storage_key, tensor_leaves
from lynx.rewrite.split import StageGraph

__all__ = ["StageModule", "MicrobatchStats"]

# Composite ops that draw random numbers although their overload carries no seeded tag.
_RANDOM_NAMES = ("dropout", "bernoulli", "rand", "scaled_dot_product", "rrelu", "multinomial", "normal")


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return True
    return any(word in str(target) for word in _RANDOM_NAMES)


@dataclass(frozen=True)
class _Handle:
    """Stands in for a dropped saved tensor: pack ``index`` of ``node``, or a view of its output."""

    microbatch: int
    node: str
    kind: str                 # "pack": the index-th tensor node's op saved; "view": view of output leaf `index`
    index: int
    view: tuple | None = None  # (dtype, size, stride, storage_offset) for "view"


@dataclass
class MicrobatchStats:
    """What the stage measured for one microbatch."""

    prefetch_s: float = 0.0         # recompute run by the runtime in windows
    on_demand_s: float = 0.0        # recompute run from the unpack hook (critical path)
    prefetch_nodes: int = 0
    on_demand_nodes: int = 0
    dropped_handles: int = 0


@dataclass
class _MicrobatchState:
    held: dict[str, Any] = field(default_factory=dict)          # recompute inputs kept by reference
    rng: dict[str, tuple] = field(default_factory=dict)          # node -> (cpu state, cuda state | None)
    out_keys: dict[int, tuple[Any, str, int]] = field(default_factory=dict)  # storage -> (weak, node, leaf)
    outputs: dict[str, Any] = field(default_factory=dict)        # recomputed node outputs
    packs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # recomputed saved tensors
    refs: Counter = field(default_factory=Counter)               # outstanding readers per dropped node
    needed: set[str] = field(default_factory=set)                # dropped nodes something will read
    viewed: set[str] = field(default_factory=set)                # dropped nodes whose output a saved tensor views
    stats: MicrobatchStats = field(default_factory=MicrobatchStats)
    forward_done: bool = False


class _Runner(fx.Interpreter):
    """Runs the stage graph for one microbatch, telling the tracker which node is running."""

    def __init__(self, stage: "StageModule", state: _MicrobatchState) -> None:
        super().__init__(stage.gm, garbage_collect_values=True)
        self.stage, self.state = stage, state

    def run_node(self, n: fx.Node) -> Any:
        stage, name = self.stage, n.meta.get("lynx_name", n.name)
        if n.op in ("get_attr", "placeholder", "output"):
            return super().run_node(n)
        stage._begin(name)
        if name in stage.dropped and name in stage._random:
            self.state.rng[name] = _rng_state(n, self.env)
        out = super().run_node(n)
        stage._produced(self.state, name, out)
        return out


def _rng_state(n: fx.Node, env: dict) -> tuple:
    cuda = None
    devices = {t.device for a in n.all_input_nodes for t in tensor_leaves(env.get(a))}
    cuda_dev = next((d for d in devices if d.type == "cuda"), None)
    if cuda_dev is not None:
        cuda = (cuda_dev, torch.cuda.get_rng_state(cuda_dev))
    return torch.get_rng_state(), cuda


class StageModule(nn.Module):
    """Stage ``spec.index`` of a split graph, dropping the saved tensors of ``dropped`` nodes.

    ``forward(*inputs, *received, microbatch=j)`` takes the model inputs the stage reads
    (``spec.inputs``) then the values received from the previous stage (``spec.recv``) and
    returns the tuple the next stage receives (``spec.send``), or the model's output on the
    last stage. Several microbatches may be in flight; each has its own cache.
    """

    def __init__(self, part: StageGraph, dropped: Iterable[str] = (), *, producer_of: dict[str, str] | None = None,
                 out_spec: Any = None) -> None:
        super().__init__()
        self.gm = part.gm
        self.spec = part.spec
        self.index = part.spec.index
        self.dropped = frozenset(dropped)
        unknown = sorted(self.dropped - set(self.spec.nodes))
        if unknown:
            raise LynxPlanError(f"stage {self.index}: plan drops nodes that are not in this stage: {unknown[:5]}")
        self._out_spec = out_spec if out_spec is not None else part.out_spec
        self._nodes = {n.meta.get("lynx_name", n.name): n for n in self.gm.graph.nodes if n.op != "output"}
        self._random = frozenset(name for name in self.dropped if _is_random(self._nodes[name]))
        # values a dropped node reads that are not themselves dropped: held by reference
        self._hold = frozenset(
            a.meta.get("lynx_name", a.name) for name in self.dropped for a in self._nodes[name].all_input_nodes
            if a.op != "get_attr" and a.meta.get("lynx_name", a.name) not in self.dropped)
        self._producer_of = producer_of or {}
        self._stage_nodes = frozenset(self.spec.nodes)
        # parameters, buffers and constants: always available, never activation memory
        self._exclude = [_fetch_attr(self.gm, n.target) for n in self.gm.graph.nodes if n.op == "get_attr"]
        self._exclude = [t for t in self._exclude if isinstance(t, torch.Tensor)]
        self._constant_keys = frozenset(storage_key(t) for t in self._exclude)
        self._states: dict[int, _MicrobatchState] = {}
        self._tracker: Any = None
        self._running: str | None = None
        self._pack_index = 0
        self.meter = SavedBytesMeter()

    # ----------------------------------------------------------------- forward
    def forward(self, *args: Any, microbatch: int = 0) -> Any:
        expected = len(self.spec.inputs) + len(self.spec.recv)
        if len(args) != expected:
            raise LynxRuntimeError(
                f"stage {self.index} takes {expected} tensors ({self.spec.inputs + self.spec.recv}), got {len(args)}")
        if microbatch in self._states:
            raise LynxRuntimeError(f"stage {self.index}: microbatch {microbatch} is already in flight; "
                                   "run its backward (and release) before reusing the id")
        state = self._states[microbatch] = _MicrobatchState()
        self._tracker = SaveTracker(self._exclude)
        for name, value in zip(self.spec.inputs + self.spec.recv, args):
            # received values are attributed to their producer in the full graph, as in the profile
            producer = self._producer_of.get(name, name)
            self._tracker.begin(producer)
            self._tracker.produced(producer, value)
            if name in self._hold:
                state.held[name] = value
        runner = _Runner(self, state)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(state, microbatch, t), self._unpack):
            out = runner.run(*args, enable_io_processing=False)
        self._tracker = None
        state.out_keys.clear()
        for value in state.held.values():  # held for recomputation: resident like saved tensors
            for t in tensor_leaves(value):
                if storage_key(t) not in self._constant_keys:
                    self.meter.add(t, "held")
        if not self.spec.is_last:
            # What the stage sends stays referenced until this microbatch's backward (the sent
            # values are its roots); the plan counts a value a later stage saves on the stage
            # that produced it (lynx.solvers.memory.is_sent), so the meter does too.
            for name, value in zip(self.spec.send, out):
                if name in self._stage_nodes:
                    for t in tensor_leaves(value):
                        if storage_key(t) not in self._constant_keys:
                            self.meter.add(t, "stage")
        state.forward_done = True
        self._count_dependents(state)
        if self.spec.is_last and self._out_spec is not None:
            out = torch.utils._pytree.tree_unflatten(list(out), self._out_spec)
        return out

    def _begin(self, name: str) -> None:
        self._running, self._pack_index = name, 0
        self._tracker.begin(name)

    def _produced(self, state: _MicrobatchState, name: str, out: Any) -> None:
        self._tracker.produced(name, out)
        if name in self._hold:
            state.held[name] = out
        if name in self.dropped:
            for i, t in enumerate(tensor_leaves(out)):
                key = storage_key(t)
                entry = state.out_keys.get(key)
                if entry is None or entry[0]() is not t.untyped_storage():  # first producer wins
                    state.out_keys[key] = (_weak(t), name, i)

    def _pack(self, state: _MicrobatchState, microbatch: int, t: torch.Tensor) -> Any:
        index, self._pack_index = self._pack_index, self._pack_index + 1
        owner = self._tracker.owner(t)
        if owner is None or owner not in self.dropped:
            if owner is not None:
                # a received value (or model input) is owned by a node outside the stage
                self.meter.add(t, "stage" if owner in self._stage_nodes else f"boundary:{owner}")
            return t
        if owner == self._running:
            handle = _Handle(microbatch, owner, "pack", index)
        else:
            weak, node, leaf = state.out_keys[storage_key(t)]
            if node != owner or weak() is not t.untyped_storage():
                raise LynxRuntimeError(f"stage {self.index}: cannot locate saved tensor of {owner} "
                                       f"(saved while {self._running} ran)")
            handle = _Handle(microbatch, owner, "view", leaf, (t.dtype, t.size(), t.stride(), t.storage_offset()))
            state.viewed.add(owner)
        state.refs[owner] += 1
        state.stats.dropped_handles += 1
        return handle

    def _count_dependents(self, state: _MicrobatchState) -> None:
        """A dropped node is needed if something unpacks it or a needed dropped node reads it."""
        needed = {n for n, c in state.refs.items() if c > 0}
        for name in reversed(self.spec.nodes):
            if name not in needed:
                continue
            for a in self._nodes[name].all_input_nodes:
                src = a.meta.get("lynx_name", a.name)
                if src in self.dropped:
                    state.refs[src] += 1
                    needed.add(src)
        state.needed = needed

    # --------------------------------------------------------------- recompute
    def recompute(self, microbatch: int, nodes: Iterable[str], *, on_demand: bool = False) -> None:
        """Re-run dropped ``nodes`` of ``microbatch`` (and dropped inputs they need) into the cache."""
        state = self._state(microbatch)
        start = time.perf_counter()
        count = 0
        for name in nodes:
            if name not in self.dropped:
                raise LynxPlanError(f"stage {self.index}: {name} is not dropped, nothing to recompute")
            count += self._recompute_node(state, name)
        elapsed = time.perf_counter() - start
        if on_demand:
            state.stats.on_demand_s += elapsed
            state.stats.on_demand_nodes += count
        else:
            state.stats.prefetch_s += elapsed
            state.stats.prefetch_nodes += count

    def _recompute_node(self, state: _MicrobatchState, name: str) -> int:
        if name in state.outputs or name not in state.needed:
            return 0
        node = self._nodes[name]
        count = 0
        for a in node.all_input_nodes:
            src = a.meta.get("lynx_name", a.name)
            if src in self.dropped:
                count += self._recompute_node(state, src)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: self._value(state, a))
        packs: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> int:
            packs.append(t.detach())
            return len(packs) - 1

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, packs.__getitem__):
            if name in state.rng:
                out = self._run_with_rng(node, state.rng[name], args, kwargs)
            else:
                out = node.target(*args, **kwargs)
        state.outputs[name], state.packs[name] = out, packs
        # resident until the last reader unpacks them: what the re-run op saved and, when a saved
        # tensor views this node's output (a consumer saved it), the output itself; kept inputs
        # are registered already (the meter deduplicates storages) and parameters never count
        resident = packs + (tensor_leaves(out) if name in state.viewed else [])
        for t in resident:
            if storage_key(t) not in self._constant_keys:
                self.meter.add(t, "stage")
        for a in node.all_input_nodes:
            src = a.meta.get("lynx_name", a.name)
            if src in self.dropped:
                self._release(state, src)
        return count + 1

    @staticmethod
    def _run_with_rng(node: fx.Node, saved: tuple, args: Any, kwargs: Any) -> Any:
        cpu_state, cuda = saved
        devices = [cuda[0]] if cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu_state)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda[1], cuda[0])
            return node.target(*args, **kwargs)

    def _value(self, state: _MicrobatchState, a: fx.Node) -> Any:
        if a.op == "get_attr":
            return _fetch_attr(self.gm, a.target)
        name = a.meta.get("lynx_name", a.name)
        if name in self.dropped:
            return state.outputs[name]
        return state.held[name]

    # ------------------------------------------------------------------ unpack
    def _unpack(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, _Handle):
            return handle
        state = self._state(handle.microbatch)
        if handle.node not in state.outputs:
            self.recompute(handle.microbatch, [handle.node], on_demand=True)
        if handle.kind == "pack":
            t = state.packs[handle.node][handle.index]
        else:
            base = tensor_leaves(state.outputs[handle.node])[handle.index]
            dtype, size, stride, offset = handle.view
            t = torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), offset, size, stride)
        self._release(state, handle.node)
        return t

    def _release(self, state: _MicrobatchState, name: str) -> None:
        state.refs[name] -= 1
        if state.refs[name] <= 0:
            state.outputs.pop(name, None)
            state.packs.pop(name, None)

    # ---------------------------------------------------------------- lifecycle
    def _state(self, microbatch: int) -> _MicrobatchState:
        state = self._states.get(microbatch)
        if state is None or not state.forward_done:
            raise LynxRuntimeError(f"stage {self.index}: microbatch {microbatch} has no finished forward")
        return state

    def stats(self, microbatch: int) -> MicrobatchStats:
        return self._state(microbatch).stats

    def release(self, microbatch: int) -> MicrobatchStats:
        """Forget ``microbatch`` after its backward; returns what was measured for it."""
        state = self._states.pop(microbatch, None)
        if state is None:
            raise LynxRuntimeError(f"stage {self.index}: microbatch {microbatch} is not in flight")
        return state.stats

    def forward_done(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s forward ran and its backward has not been released."""
        state = self._states.get(microbatch)
        return state is not None and state.forward_done

    def in_flight(self) -> list[int]:
        return sorted(self._states)


def _weak(t: torch.Tensor) -> Any:
    return weakref.ref(t.untyped_storage())


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
