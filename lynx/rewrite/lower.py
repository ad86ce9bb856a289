"""Partition a stage's joint graph along its plan: forward, per-window recompute and backward graphs.

The partition follows ``torch._functorch.partitioners.default_partition``: the forward nodes
are the joint graph's nodes up to its last forward node, and the *saved* values are the
forward values a backward node reads. Each saved value belongs to the captured node that
produced its storage (a view belongs to its base's producer; a dropout mask to the dropout),
the profile's rule. Saved values of nodes the plan drops are *dropped*; the rest are *kept*.

* **forward** (``primals`` → stage outputs, kept values, *held* values, RNG states): the
  held values are the inputs of the dropped region that are not themselves dropped (kept
  values and primals need no holding). Before every random op the dropped region contains,
  the forward graph saves the RNG state of its device.
* **recompute** (kept + held + RNG states + already recomputed values → dropped values): one
  graph per set of targets, built on first use and cached, so a window's recomputation and
  the on-demand rest each run as one generated function. Random ops replay their saved state
  (:func:`replay_rng`), so dropout draws the same mask bitwise.
* **backward** (kept + dropped values + tangents → gradients of the primals that need one).

All three are ``fx.GraphModule`` s: generated Python, one call per graph. The backward graph
uses fx's boxed calling convention (it clears its argument list), so each value is freed after
its last use inside the graph.

Example::

    >>> import torch
    >>> from lynx.frontend.joint import trace_joint
    >>> from lynx.rewrite.split import split_graph
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> part = split_graph(gm, [[n.name for n in gm.graph.nodes if n.op == "call_function"]])[0]
    >>> lowered = lower(trace_joint(part.gm, [torch.randn(2, 4)]), dropped={"linear"})
    >>> [lowered.origin[name] for name in lowered.dropped_values]
    ['linear']
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from lynx.frontend.joint import (JointGraph, classify, fetch_attr, input_saver, storage_nbytes,
                                 storage_root)
from lynx.torch_private import boxed_codegen, is_op_overload

__all__ = ["LoweredStage", "RecomputeGraph", "BackwardGraph", "lower", "save_rng_state", "replay_rng",
           "accumulate_grad", "GradSink", "Clock", "clock_start", "clock_stop"]

# random ops whose overload carries no ``nondeterministic_seeded`` tag
_RANDOM_NAMES = ("dropout", "bernoulli", "rand", "rrelu", "multinomial")


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if is_op_overload(target):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return True
        return any(k in target.name() for k in _RANDOM_NAMES)
    return False


def save_rng_state(device: torch.device) -> torch.Tensor:
    """The generator state a random op on ``device`` is about to draw from (a graph node)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def replay_rng(state: torch.Tensor, device: torch.device, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run random ``op`` from generator ``state`` and leave the generator as it was (a graph node)."""
    if device.type == "cuda":
        current = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
        try:
            return op(*args, **kwargs)
        finally:
            torch.cuda.set_rng_state(current, device)
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        torch.set_rng_state(current)


@dataclass
class RecomputeGraph:
    """One generated recompute function and where its inputs and outputs live in the slot table."""

    gm: fx.GraphModule
    in_slots: list[int]
    out_slots: list[int]
    run: Any                       # what to call: the graph module, or its torch.compile'd form
    nodes: frozenset[str]          # captured nodes it recomputes (for statistics)
    out_bytes: int                 # bytes of the storages it brings back


@dataclass
class LoweredStage:
    """A stage's generated graphs and the slot table that connects them (see module docstring).

    A microbatch's values live in a list indexed by slot: ``[kept..., held..., rng states...,
    dropped...]``; the forward graph fills all but the dropped slots, recompute graphs fill
    those, the backward graph reads kept and dropped slots.
    """

    joint: JointGraph
    forward: fx.GraphModule
    run_forward: Any               # the forward graph, or its torch.compile'd form
    compile: bool
    kept: list[str]
    held: list[str]
    rng: list[str]                 # random joint nodes whose state the forward saves
    dropped_values: list[str]
    grad_of: list[int]             # primal index of each backward output
    origin: dict[str, str]
    dropped_by_node: dict[str, list[int]]  # captured node -> its dropped slots
    bytes_of_slot: list[int]       # storage bytes each slot brings (0: shared or not activation)
    send_bytes: int                # storages of the stage's outputs not among the kept ones
    category_of_slot: list[str]    # "stage", "held" or "boundary"
    stage_roots: set = field(repr=False, default_factory=set)   # storages the plan counts
    _graph_nodes: dict[str, fx.Node] = field(repr=False, default_factory=dict)
    _recompute: dict[tuple[frozenset[int], frozenset[int]], RecomputeGraph] = field(repr=False, default_factory=dict)
    _backward: dict[tuple[frozenset[int], bool], "BackwardGraph"] = field(repr=False, default_factory=dict)

    @property
    def n_slots(self) -> int:
        return len(self.kept) + len(self.held) + len(self.rng) + len(self.dropped_values)

    @property
    def first_dropped_slot(self) -> int:
        return len(self.kept) + len(self.held) + len(self.rng)

    def recompute_graph(self, targets: frozenset[int], available: frozenset[int]) -> RecomputeGraph:
        """The graph bringing back dropped ``targets`` given the dropped slots already ``available``."""
        key = (targets, available)
        graph = self._recompute.get(key)
        if graph is None:
            graph = self._recompute[key] = _build_recompute(self, targets, available)
        return graph

    def backward_graph(self, available: frozenset[int], sink: bool = False) -> "BackwardGraph":
        """The backward graph when the dropped slots ``available`` were brought back beforehand.

        With ``sink`` the graph hands each parameter's gradient to ``graph.sink`` as soon as it
        is final (:func:`accumulate_grad`) instead of returning it.
        """
        key = (available, sink)
        graph = self._backward.get(key)
        if graph is None:
            graph = self._backward[key] = _build_backward(self, available, sink)
        return graph


def lower(joint: JointGraph, dropped: Iterable[str], *, compile: bool = False, model_inputs: int = 0) -> LoweredStage:
    """Partition ``joint`` so that the saved values of the ``dropped`` captured nodes are recomputed.

    The stage's first ``model_inputs`` inputs are model inputs (the rest are received): a saved
    model input counts, as in the profile, on the node that saved it while that node is kept.

    With ``compile`` every generated graph is passed through ``torch.compile`` (Inductor).
    """
    dropped = frozenset(dropped)
    nodes, primals, tangents, fw_outs, grads, forward, owner, saved = classify(joint)
    is_dropped = {n: owner.get(n) in dropped for n in forward}
    dropped_values = [n for n in saved if is_dropped[n]]
    kept = [n for n in saved if not is_dropped[n]]
    kept_set = set(kept)
    # the dropped region: what recomputing every dropped value runs; its other inputs are held
    region, held, stack = set(), [], list(dropped_values)
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for a in n.all_input_nodes:
            if a in region:
                continue
            if a.op != "placeholder" and is_dropped.get(a, False):
                stack.append(a)
            elif a not in kept_set and a not in held:
                held.append(a)
    order = {n: i for i, n in enumerate(nodes)}
    held.sort(key=order.__getitem__)
    rng_nodes = sorted((n for n in region if _is_random(n)), key=order.__getitem__)

    fw_gm, rng_names = _build_forward(joint, primals, fw_outs, kept + held, rng_nodes)
    grad_of = [i for i, g in enumerate(grads) if g is not None]

    slots = [n.name for n in kept + held] + rng_names + [n.name for n in dropped_values]
    slot_of = {name: i for i, name in enumerate(slots)}
    dropped_by_node: dict[str, list[int]] = {}
    for n in dropped_values:
        dropped_by_node.setdefault(owner[n], []).append(slot_of[n.name])
    n_attrs = len(joint.attr_names)
    def input_category(root: fx.Node) -> str:
        if primals.index(root) - n_attrs >= model_inputs:
            return "boundary"  # received: the sender's
        return "held" if input_saver(joint, root, forward) in dropped else "stage"

    sizes, categories = _slot_bytes(kept + held, rng_names, dropped_values, primals, n_attrs, input_category,
                                    held_set=set(held))
    kept_roots = {storage_root(n) for n in kept + held}
    out_roots = {storage_root(n) for n in fw_outs} - kept_roots
    send_bytes = sum(storage_nbytes(r) for r in out_roots if r.op != "placeholder")
    lowered = LoweredStage(joint=joint, forward=fw_gm, run_forward=_compiled(fw_gm, compile), compile=compile,
                           kept=[n.name for n in kept],
                           held=[n.name for n in held], rng=rng_names, dropped_values=[n.name for n in dropped_values],
                           grad_of=grad_of, origin={n.name: o for n, o in owner.items() if o},
                           dropped_by_node=dropped_by_node, bytes_of_slot=sizes, send_bytes=send_bytes,
                           category_of_slot=categories)
    lowered._graph_nodes = {n.name: n for n in nodes}
    lowered._forward, lowered._tangents, lowered._grads = forward, tangents, [grads[i] for i in grad_of]
    # storages the meter counts under "stage": saved values the stage produced, and saved model
    # inputs while the node that saved them is kept (the profile counts them on that node)
    lowered.stage_roots = {r for r in (storage_root(n) for n in kept + dropped_values) if r.op != "placeholder"}
    lowered.stage_roots |= {storage_root(n) for n, category in zip(kept, categories)
                            if category == "stage" and storage_root(n).op == "placeholder"}
    # what the stage sends is held by the caller until the backward ends (its roots): a kept
    # one is not freed inside the backward graph (a dropped one is recomputed: a new copy)
    lowered.stage_roots -= {storage_root(n) for n in fw_outs} & kept_roots
    return lowered


def _slot_bytes(fw_saved: list[fx.Node], rng_names: list[str], dropped_values: list[fx.Node], primals: list[fx.Node],
                n_attrs: int, input_category: Any, held_set: set) -> tuple[list[int], list[str]]:
    """Per slot the bytes of the storage it brings (once per storage) and its meter category."""
    seen: set[fx.Node] = set()
    sizes, categories = [], []
    for n in [*fw_saved, None, *dropped_values]:
        if n is None:  # RNG states: a few KiB per random op, held until the recompute ran
            sizes += [0] * len(rng_names)
            categories += ["held"] * len(rng_names)
            continue
        root = storage_root(n)
        if root.op == "placeholder":
            index = primals.index(root) if root in primals else 0
            # parameters and buffers are never activation memory; a received value is the sender's
            sizes.append(0 if index < n_attrs or root in seen else storage_nbytes(root))
            categories.append("boundary" if index < n_attrs else "held" if n in held_set else input_category(root))
        else:
            sizes.append(0 if root in seen else storage_nbytes(root))
            categories.append("held" if n in held_set and n not in dropped_values else "stage")
        seen.add(root)
    return sizes, categories


def _ancestors(outputs: Iterable[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    """``outputs`` and every node they read, transitively, not walking past a node in ``stop``."""
    needed: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in needed or n in stop:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    return needed


def _extract(root: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node], *, boxed: bool = False,
             before: dict[fx.Node, Any] | None = None, rewrite: dict[fx.Node, Any] | None = None) -> fx.GraphModule:
    """A graph module computing ``outputs`` from ``inputs`` with the joint graph's nodes between them."""
    needed = _ancestors([o for o in outputs if isinstance(o, fx.Node)], stop=set(inputs))
    missing = [n.name for n in needed if n.op == "placeholder"]
    if missing:
        raise AssertionError(f"lowering: graph reads {missing[:5]} which it does not take")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in root.graph.nodes:
        if n not in needed:
            continue
        if before and n in before:
            before[n](graph, env)
        if rewrite and n in rewrite:
            env[n] = rewrite[n](graph, env)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    if boxed:
        graph.set_codegen(boxed_codegen())
    return fx.GraphModule(root, graph)


def _device_of(n: fx.Node) -> torch.device:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.device if isinstance(val, torch.Tensor) else torch.device("cpu")


def _build_forward(joint: JointGraph, primals: list[fx.Node], fw_outs: list[fx.Node], saved: list[fx.Node],
                   rng_nodes: list[fx.Node]) -> tuple[fx.GraphModule, list[str]]:
    states: dict[fx.Node, fx.Node] = {}

    def save_state(node: fx.Node):
        def emit(graph: fx.Graph, env: dict) -> None:
            states[node] = graph.call_function(save_rng_state, (_device_of(node),))
        return emit

    before = {n: save_state(n) for n in rng_nodes}
    # the forward graph returns stage outputs, then the saved and held values, then RNG states;
    # the states are filled in as the graph is built, so the output is patched afterwards
    gm = _extract(joint.gm, primals, list(fw_outs) + saved, before=before)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0]) + tuple(states[n] for n in rng_nodes),)
    gm.recompile()
    return gm, [f"rng_state:{n.name}" for n in rng_nodes]


def _build_recompute(lowered: LoweredStage, targets: frozenset[int], available: frozenset[int]) -> RecomputeGraph:
    nodes = lowered._graph_nodes
    first = lowered.first_dropped_slot
    slot_names = lowered.kept + lowered.held + lowered.rng + lowered.dropped_values
    # inputs: everything the forward left plus the dropped values already brought back
    sources = [(i, nodes[slot_names[i]]) for i in range(len(lowered.kept) + len(lowered.held))]
    sources += [(i, nodes[slot_names[i]]) for i in sorted(available)]
    rng_slot = {nodes[name.split(":", 1)[1]]: len(lowered.kept) + len(lowered.held) + k
                for k, name in enumerate(lowered.rng)}
    wanted = [nodes[slot_names[i]] for i in sorted(targets)]
    # what the targets need, stopping at sources; dropped values met on the way come back too
    source_nodes = {n for _, n in sources}
    needed = _ancestors(wanted, stop=source_nodes)
    dropped_slot = {nodes[slot_names[i]]: i for i in range(first, len(slot_names))}
    outputs = [n for n in nodes.values() if n in needed and n in dropped_slot]
    used_sources = [(i, n) for i, n in sources if any(u in needed for u in n.users)]
    state_inputs = [(rng_slot[n], n) for n in nodes.values() if n in needed and n in rng_slot]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for _i, n in used_sources:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    state_of = {n: graph.placeholder(f"rng_state_{n.name}") for _i, n in state_inputs}
    for n in lowered.joint.gm.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            raise AssertionError(f"lowering: recompute reads primal {n.name} that the forward did not hold")
        if n in state_of:
            args = fx.map_arg(n.args, lambda a: env[a])
            kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
            env[n] = graph.call_function(replay_rng, (state_of[n], _device_of(n), n.target, *args), kwargs)
            env[n].meta = dict(n.meta)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(lowered.joint.gm, graph)
    out_slots = [dropped_slot[n] for n in outputs]
    in_slots = [i for i, _ in used_sources] + [i for i, _ in state_inputs]
    recomputed = frozenset(lowered.origin[n.name] for n in needed if n.name in lowered.origin)
    return RecomputeGraph(gm=gm, in_slots=in_slots, out_slots=out_slots, run=_compiled(gm, lowered.compile),
                          nodes=recomputed,
                          out_bytes=sum(lowered.bytes_of_slot[i] for i in out_slots))


def _compiled(gm: fx.GraphModule, compile: bool) -> Any:
    """``gm`` itself, or ``torch.compile(gm)`` (Inductor) with a clear error where it cannot build."""
    if not compile:
        return gm
    # fallback_random: random ops stay the aten ops eager runs, so dropout draws the same masks
    fn = torch.compile(gm, backend="inductor", dynamic=False, options={"fallback_random": True})

    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - Inductor's failures are many; say what to do
            from lynx.errors import LynxRuntimeError

            raise LynxRuntimeError(
                f"torch.compile (Inductor) could not build a stage graph: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}. On CPU Inductor needs a C++ compiler "
                "(gcc or clang on PATH) and the Python development headers; run with compile=False "
                "(the generated graphs as plain Python) otherwise.") from err
    return run


class Clock(torch.nn.Module):
    """Seconds spent between :func:`clock_start` and :func:`clock_stop` calls of one graph.

    A module only so that ``fx.GraphModule`` carries it as an attribute the graph reads.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total_s = 0.0
        self._since = 0.0


def clock_start(clock: Clock) -> None:
    clock._since = time.perf_counter()


def clock_stop(clock: Clock) -> None:
    clock.total_s += time.perf_counter() - clock._since


class GradSink(torch.nn.Module):
    """Where a backward graph puts parameter gradients as they become final (see :func:`accumulate_grad`)."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[torch.Tensor] = []
        self.on_grad: Any = None       # called with the parameter once its .grad holds this gradient


def accumulate_grad(sink: GradSink, index: int, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does for parameter ``index``, then tell ``sink.on_grad``."""
    param = sink.params[index]
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
    if sink.on_grad is not None:
        sink.on_grad(param)


@dataclass
class BackwardGraph:
    """The backward graph for one set of prefetched slots, with on-demand recompute inlined."""

    gm: fx.GraphModule              # boxed: ``gm(args)`` empties ``args`` (not under compile)
    run: Any                        # ``run(args)``: the graph, or its torch.compile'd form
    in_slots: list[int]             # slot values it takes before the tangents
    nodes: frozenset[str]           # captured nodes it recomputes on demand
    clock: Clock                    # time spent in those recomputations
    extra_peak_bytes: int           # peak of counted storages inside the graph minus its inputs'
    sink: GradSink | None = None    # set: parameter gradients go here, the graph returns None for them


def _build_backward(lowered: LoweredStage, available: frozenset[int], sink: bool) -> BackwardGraph:
    """Joint backward nodes in order, each dropped value recomputed just before its first reader."""
    nodes, forward = lowered._graph_nodes, lowered._forward
    slot_names = lowered.kept + lowered.held + lowered.rng + lowered.dropped_values
    n_kept, n_held = len(lowered.kept), len(lowered.held)
    kept_slots = list(range(n_kept))
    avail_slots = sorted(available)
    sources = {nodes[slot_names[i]]: i for i in kept_slots + avail_slots + list(range(n_kept, n_kept + n_held))}
    rng_slot = {nodes[name.split(":", 1)[1]]: n_kept + n_held + k for k, name in enumerate(lowered.rng)}
    joint_nodes = list(lowered.joint.gm.graph.nodes)
    backward = [n for n in joint_nodes if n not in forward and n.op not in ("placeholder", "output")]
    recomputed: set[fx.Node] = set()
    sequence: list[tuple[str, fx.Node]] = []

    def ensure(n: fx.Node) -> None:
        stack = [(n, False)]
        while stack:
            node, expanded = stack.pop()
            if node in sources or node in recomputed or node not in forward:
                continue
            if expanded:
                recomputed.add(node)
                sequence.append(("re", node))
                continue
            if node.op == "placeholder":
                raise AssertionError(f"lowering: backward needs primal {node.name} that the forward did not keep")
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.all_input_nodes))

    for b in backward:
        for a in b.all_input_nodes:
            ensure(a)
        sequence.append(("bw", b))
    held_used = [i for i in range(n_kept, n_kept + n_held)
                 if any(u in recomputed for u in nodes[slot_names[i]].users)]
    rng_used = [(rng_slot[n], n) for n in joint_nodes if n in recomputed and n in rng_slot]
    in_slots = kept_slots + avail_slots + held_used

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in in_slots:
        src = nodes[slot_names[i]]
        env[src] = graph.placeholder(src.name)
        env[src].meta = dict(src.meta)
    state_of = {n: graph.placeholder(f"rng_state_{n.name}") for _i, n in rng_used}
    for t in lowered._tangents:
        env[t] = graph.placeholder(t.name)
        env[t].meta = dict(t.meta)
    clock = graph.get_attr("lynx_clock") if recomputed else None
    n_attrs = len(lowered.joint.attr_names)
    # parameter gradients handed over as soon as computed: index in grads -> attribute index
    sunk = {k: i for k, i in enumerate(lowered.grad_of) if sink and i < n_attrs}
    sink_node = graph.get_attr("lynx_sink") if sunk else None
    sink_after: dict[fx.Node, list[tuple[int, int]]] = {}
    for k, i in sunk.items():
        sink_after.setdefault(lowered._grads[k], []).append((k, i))
    in_recompute = False
    for kind, n in sequence:
        if (kind == "re") != in_recompute:
            in_recompute = kind == "re"
            graph.call_function(clock_start if in_recompute else clock_stop, (clock,))
        if n in state_of:
            args = fx.map_arg(n.args, lambda a: env[a])
            kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
            env[n] = graph.call_function(replay_rng, (state_of[n], _device_of(n), n.target, *args), kwargs)
            env[n].meta = dict(n.meta)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
        for _k, i in sink_after.pop(n, ()):
            graph.call_function(accumulate_grad, (sink_node, i, env[n]))
    if in_recompute:
        graph.call_function(clock_stop, (clock,))
    for g, pairs in sink_after.items():  # gradients that are inputs (a tangent passed through)
        for _k, i in pairs:
            graph.call_function(accumulate_grad, (sink_node, i, env[g]))
    graph.output(tuple(None if k in sunk else env[g] for k, g in enumerate(lowered._grads)))
    if not lowered.compile:
        graph.set_codegen(boxed_codegen())
    attrs: dict[str, Any] = {"lynx_clock": Clock(), "lynx_sink": GradSink()}
    for n in graph.nodes:
        if n.op == "get_attr" and n.target not in attrs:
            attrs[n.target] = fetch_attr(lowered.joint.gm, n.target)
    gm = fx.GraphModule(attrs, graph)
    extra = _extra_peak(graph, {v: k for k, v in env.items()}, lowered.stage_roots)
    origins = frozenset(lowered.origin[n.name] for n in recomputed if n.name in lowered.origin)
    if lowered.compile:
        fn = _compiled(gm, True)
        run = lambda args: fn(*args)  # noqa: E731 - Inductor manages its buffers itself
    else:
        run = gm
    return BackwardGraph(gm=gm, run=run, in_slots=in_slots + [i for i, _ in rng_used], nodes=origins,
                         clock=attrs["lynx_clock"], extra_peak_bytes=extra,
                         sink=attrs["lynx_sink"] if sunk else None)


def _extra_peak(graph: fx.Graph, joint_of: dict[fx.Node, fx.Node], counted: set[fx.Node]) -> int:
    """How far the counted storages live in ``graph`` rise above what its inputs hold.

    A storage lives from the first node that holds it (an input or a recomputed value) until
    the last use of any node aliasing it: fx's generated code drops each value after its last
    use, and the boxed calling convention lets inputs go too. A piece of a multi-output op's
    result (``getitem``, e.g. dropout's mask or layer norm's statistics) lives from the op
    until the last use of the piece or of the op's result, whichever is later: the result
    holds every piece until its last piece is taken.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    start: dict[fx.Node, int] = {}
    end: dict[fx.Node, int] = {}
    for n in graph.nodes:
        j = joint_of.get(n)
        if j is None:
            continue
        root = storage_root(j)
        if root not in counted:
            continue
        first = 0 if n.op == "placeholder" else order[n]
        last = max((order[u] for u in n.users), default=first)
        whole = n.args[0] if n.target is operator.getitem and n.args else None
        if isinstance(whole, fx.Node) and whole.op != "placeholder":
            first = min(first, order[whole])
            last = max([last] + [order[u] for u in whole.users])
        start[root] = min(start.get(root, first), first)
        end[root] = max(end.get(root, last), last)
    events: dict[int, int] = {}
    initial = 0
    for root, t0 in start.items():
        size = storage_nbytes(root)
        if t0 == 0:
            initial += size
        else:
            events[t0] = events.get(t0, 0) + size
        events[end[root] + 1] = events.get(end[root] + 1, 0) - size
    live = peak = initial
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak - initial
