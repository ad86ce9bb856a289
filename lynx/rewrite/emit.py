"""Graph emission: a lowered stage's forward, recompute and backward graphs as fx code.

:func:`lynx.rewrite.lower.lower` decides the slot table (what is kept, held, dropped); this
module writes the graphs that fill and read it, each an ``fx.GraphModule`` copied node by node
from the joint graph:

* :func:`build_forward` — primals → stage outputs, kept and held values, and the RNG state
  saved before each random op the dropped region contains;
* :func:`build_recompute` — one set of dropped slots from the kept and held ones (and those
  already brought back), random ops replayed from their saved state;
* :func:`build_backward` — the joint graph's backward nodes in order, each dropped value not
  brought back beforehand recomputed just before its first reader (timed by a
  :class:`~lynx.rewrite.graph_calls.Clock`), parameter gradients optionally handed to a
  :class:`~lynx.rewrite.graph_calls.GradSink` as soon as they are final. For zero-bubble
  schedules the same nodes split in two (:func:`split_backward_nodes`): ``part="input"`` emits
  those the input gradients need — what the previous stage waits for — and returns, after the
  gradients, the values the rest reads (*cross* values); ``part="weight"`` emits the rest from
  them, later, handing every weight gradient to its sink. A dropped value is recomputed in
  whichever part reads it first (a value only weight gradients read, in the weight part).

A random op is copied in one place (:func:`_copy`): replayed from its saved state where the
graph takes one, else as it is.

Example::

    >>> import torch
    >>> from lynx.frontend.joint import trace_joint
    >>> from lynx.rewrite.lower import lower
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> lowered = lower(trace_joint(gm, [torch.randn(2, 4)]), dropped={"dropout"})
    >>> graph = lowered.recompute_graph(frozenset(range(lowered.first_dropped_slot, lowered.n_slots)),
    ...                                 frozenset())
    >>> "replay_rng" in graph.gm.code, sorted(graph.nodes)
    (True, ['dropout'])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from lynx.frontend.joint import JointGraph, fetch_attr, storage_nbytes, storage_root
from lynx.rewrite.graph_calls import (Clock, GradSink, accumulate_grad, clock_start, clock_stop, replay_rng,
                                      save_rng_state)
from lynx.rewrite.liveness import extra_peak_bytes
from lynx.rewrite.offload import offload_issue, offload_put, offload_wait
from lynx.rewrite.tp_windows import (TPWindowLog, backward_allreduces, tp_segment_start, tp_segment_stop,
                                     tp_wait_start, tp_wait_stop)
from lynx.torch_private import boxed_codegen

if TYPE_CHECKING:
    from lynx.rewrite.lower import LoweredStage

__all__ = ["RecomputeGraph", "BackwardGraph", "build_forward", "build_recompute", "build_backward",
           "split_backward_nodes", "compiled"]


@dataclass
class RecomputeGraph:
    """One generated recompute function and where its inputs and outputs live in the slot table."""

    gm: fx.GraphModule
    in_slots: list[int]
    out_slots: list[int]
    run: Callable[..., Any]        # what to call: the graph module, or its torch.compile'd form
    nodes: frozenset[str]          # captured nodes it recomputes (for statistics)
    out_bytes: int                 # bytes of the storages it brings back


@dataclass
class BackwardGraph:
    """The backward graph for one set of prefetched slots, with on-demand recompute inlined."""

    gm: fx.GraphModule              # boxed: ``gm(args)`` empties ``args`` (not under compile)
    run: Callable[[list], Any]      # ``run(args)``: the graph, or its torch.compile'd form
    in_slots: list[int]             # slot values it takes before the tangents
    nodes: frozenset[str]           # captured nodes it recomputes on demand
    clock: Clock                    # time spent in those recomputations
    extra_peak_bytes: int           # peak of counted storages inside the graph minus its inputs'
    sink: GradSink | None = None    # set: parameter gradients go here, the graph returns None for them
    tp_log: TPWindowLog | None = None   # recompute and wait seconds of each TP window it runs
    tp_nodes: frozenset[str] = frozenset()   # captured nodes it recomputes inside TP windows
    cross: list[str] = field(default_factory=list)   # part="input": joint values returned after the gradients
    cross_bytes: int = 0            # part="input": counted storages among them (held until the weight part)
    # offload: the slots of each prefetch group the graph issues (it then takes the microbatch's
    # lynx.rewrite.offload.OffloadedValues as its first argument)
    offload_groups: tuple[tuple[int, ...], ...] = ()


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


def _placeholder(graph: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node]) -> None:
    """An input of ``graph`` standing for joint node ``n`` (its metadata copied)."""
    env[n] = graph.placeholder(n.name)
    env[n].meta = dict(n.meta)


def _device_of(n: fx.Node) -> torch.device:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.device if isinstance(val, torch.Tensor) else torch.device("cpu")


def _copy(graph: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node], state_of: dict[fx.Node, fx.Node]) -> None:
    """Copy joint node ``n`` into ``graph``: a random op with a saved state replays it
    (:func:`~lynx.rewrite.graph_calls.replay_rng`), so it draws what the forward drew."""
    if n in state_of:
        args = fx.map_arg(n.args, lambda a: env[a])
        kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
        op: Any = n.target  # an operator: fx passes it through as a plain argument
        env[n] = graph.call_function(replay_rng, (state_of[n], _device_of(n), op, *args), kwargs)
        env[n].meta = dict(n.meta)
    else:
        env[n] = graph.node_copy(n, lambda a: env[a])


def _extract(root: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node], *,
             before: dict[fx.Node, Callable[[fx.Graph, dict], None]],
             offloaded: Mapping[fx.Node, tuple[int, int]] | None = None) -> fx.GraphModule:
    """A graph module computing ``outputs`` from ``inputs`` with the joint graph's nodes between
    them; ``before[n]`` emits its own nodes ahead of ``n``'s copy. ``offloaded`` (output → slot,
    storage): outputs handed, as soon as they are computed, to the graph's first input (the
    microbatch's :class:`~lynx.rewrite.offload.OffloadedValues`:
    :func:`~lynx.rewrite.offload.offload_put`) and returned as None, so their memory goes once
    the graph no longer reads them."""
    offloaded = dict(offloaded or {})
    needed = _ancestors([o for o in outputs if isinstance(o, fx.Node)], stop=set(inputs))
    missing = [n.name for n in needed if n.op == "placeholder"]
    if missing:
        raise AssertionError(f"lowering: graph reads {missing[:5]} which it does not take")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    handle = graph.placeholder("lynx_offload") if offloaded else None
    for n in inputs:
        _placeholder(graph, n, env)
    for n in root.graph.nodes:
        if n not in needed:
            continue
        if n in before:
            before[n](graph, env)
        env[n] = graph.node_copy(n, lambda a: env[a])
        if n in offloaded:
            graph.call_function(offload_put, (handle, *offloaded[n], env[n]))
    graph.output(tuple(None if o in offloaded else env[o] for o in outputs))
    return fx.GraphModule(root, graph)


def build_forward(joint: JointGraph, primals: list[fx.Node], fw_outs: list[fx.Node], saved: list[fx.Node],
                  rng_nodes: list[fx.Node], offloaded: Mapping[fx.Node, tuple[int, int]] | None = None
                  ) -> tuple[fx.GraphModule, list[str]]:
    """The forward graph (stage outputs, then ``saved``, then the RNG states before each of
    ``rng_nodes``) and the slot names of those states; ``offloaded`` saved values (→ slot,
    storage) go to the host as they are computed (the graph then takes the microbatch's
    offloaded values first)."""
    states: dict[fx.Node, fx.Node] = {}

    def save_state(node: fx.Node) -> Callable[[fx.Graph, dict], None]:
        def emit(graph: fx.Graph, env: dict) -> None:
            states[node] = graph.call_function(save_rng_state, (_device_of(node),))
        return emit

    before = {n: save_state(n) for n in rng_nodes}
    # the states are filled in as the graph is built, so the output is patched afterwards
    gm = _extract(joint.gm, primals, list(fw_outs) + saved, before=before, offloaded=offloaded)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0]) + tuple(states[n] for n in rng_nodes),)
    gm.recompile()
    return gm, [f"rng_state:{n.name}" for n in rng_nodes]


def _rng_slots(lowered: LoweredStage) -> dict[fx.Node, int]:
    """The random joint node behind each RNG-state slot."""
    first = len(lowered.kept) + len(lowered.held)
    return {lowered.graph_nodes[name.split(":", 1)[1]]: first + k for k, name in enumerate(lowered.rng)}


def build_recompute(lowered: LoweredStage, targets: frozenset[int], available: frozenset[int]) -> RecomputeGraph:
    """The graph bringing back dropped slots ``targets`` given the dropped slots already ``available``."""
    nodes = lowered.graph_nodes
    slot_names = lowered.slot_names
    # inputs: everything the forward left plus the dropped values already brought back
    sources = [(i, nodes[slot_names[i]]) for i in range(len(lowered.kept) + len(lowered.held))]
    sources += [(i, nodes[slot_names[i]]) for i in sorted(available)]
    rng_slot = _rng_slots(lowered)
    wanted = [nodes[slot_names[i]] for i in sorted(targets)]
    # what the targets need, stopping at sources; dropped values met on the way come back too
    needed = _ancestors(wanted, stop={n for _, n in sources})
    dropped_slot = {nodes[slot_names[i]]: i for i in range(lowered.first_dropped_slot, len(slot_names))}
    outputs = [n for n in nodes.values() if n in needed and n in dropped_slot]
    used_sources = [(i, n) for i, n in sources if any(u in needed for u in n.users)]
    state_inputs = [(rng_slot[n], n) for n in nodes.values() if n in needed and n in rng_slot]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for _i, n in used_sources:
        _placeholder(graph, n, env)
    state_of = {n: graph.placeholder(f"rng_state_{n.name}") for _i, n in state_inputs}
    for n in lowered.joint.gm.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            raise AssertionError(f"lowering: recompute reads primal {n.name} that the forward did not hold")
        _copy(graph, n, env, state_of)
    graph.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(lowered.joint.gm, graph)
    out_slots = [dropped_slot[n] for n in outputs]
    in_slots = [i for i, _ in used_sources] + [i for i, _ in state_inputs]
    recomputed = frozenset(lowered.origin[n.name] for n in needed if n.name in lowered.origin)
    return RecomputeGraph(gm=gm, in_slots=in_slots, out_slots=out_slots, run=compiled(gm, lowered.compile),
                          nodes=recomputed, out_bytes=sum(lowered.bytes_of_slot[i] for i in out_slots))


def split_backward_nodes(lowered: LoweredStage) -> tuple[set[fx.Node], set[fx.Node]]:
    """The joint graph's backward nodes the input gradients need, and the rest (what only the
    weight gradients need)."""
    forward, n_attrs = lowered.forward_nodes, len(lowered.joint.attr_names)
    backward = {n for n in lowered.joint.gm.graph.nodes if n not in forward and n.op not in ("placeholder", "output")}
    to_inputs = [g for k, g in enumerate(lowered.grads) if lowered.grad_of[k] >= n_attrs and isinstance(g, fx.Node)]
    to_weights = [g for k, g in enumerate(lowered.grads) if lowered.grad_of[k] < n_attrs and isinstance(g, fx.Node)]
    inputs = _ancestors(to_inputs, stop=forward) & backward
    return inputs, (_ancestors(to_weights, stop=forward) & backward) - inputs


def _backward_sequence(lowered: LoweredStage, sources: set[fx.Node],
                       windows: dict[fx.Node, list[fx.Node]] | None = None, only: set[fx.Node] | None = None,
                       ) -> tuple[list[tuple[str, fx.Node]], set[fx.Node]]:
    """The backward nodes in order (``"bw"``; those in ``only`` when given), each forward value
    they read that is not a source recomputed just before (``"re"``), and the set of those
    recomputed. ``windows``: after a collective, recompute these values (``"tp"``: inside its
    window, before its wait)."""
    forward = lowered.forward_nodes
    recomputed: set[fx.Node] = set()
    sequence: list[tuple[str, fx.Node]] = []

    def ensure(n: fx.Node, kind: str = "re") -> None:
        stack = [(n, False)]
        while stack:
            node, expanded = stack.pop()
            if node in sources or node in recomputed or node not in forward:
                continue
            if expanded:
                recomputed.add(node)
                sequence.append((kind, node))
                continue
            if node.op == "placeholder":
                raise AssertionError(f"lowering: backward needs primal {node.name} that the forward did not keep")
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.all_input_nodes))

    for b in lowered.joint.gm.graph.nodes:
        if b in forward or b.op in ("placeholder", "output") or (only is not None and b not in only):
            continue
        for a in b.all_input_nodes:
            ensure(a)
        sequence.append(("bw", b))
        for target in (windows or {}).get(b, ()):
            ensure(target, "tp")
    return sequence, recomputed


def build_backward(lowered: LoweredStage, available: frozenset[int], sink: bool,
                   tp_windows: tuple[tuple[int, frozenset[int]], ...] = (), part: str = "all",
                   cross: list[str] | None = None, streamed: Mapping[int, str | None] | None = None
                   ) -> BackwardGraph:
    """Joint backward nodes in order, each dropped value recomputed just before its first reader.

    ``tp_windows``: ``(k, slots)`` recomputed right after the backward's k-th collective, before
    its wait (:mod:`lynx.rewrite.tp_windows`). ``part``: ``"all"``; ``"input"`` (the input
    gradients, then the cross values); ``"weight"`` (the weight gradients, all into the sink,
    from the ``cross`` values the input part returned).

    ``streamed``: kept slots that are on the host when the backward starts (offloaded), each
    with the captured node whose backward issues its prefetch (None: the graph's start); the
    graph issues each such group there (:func:`~lynx.rewrite.offload.offload_issue`) and waits
    for it before its first reader (:func:`~lynx.rewrite.offload.offload_wait`). Under a split
    the part that reads a value first brings it back (the input part hands it on as a cross
    value when the weight part reads it too).
    """
    nodes = lowered.graph_nodes
    slot_names = lowered.slot_names
    n_kept, n_held = len(lowered.kept), len(lowered.held)
    streamed = dict(streamed or {})
    kept_slots = [i for i in range(n_kept) if i not in streamed]
    avail_slots = sorted(available)
    sources = {nodes[slot_names[i]]: i for i in kept_slots + avail_slots + list(range(n_kept, n_kept + n_held))}
    crossed = [nodes[name] for name in cross or ()]
    only = None
    if part != "all":
        inputs, weights = split_backward_nodes(lowered)
        only = inputs if part == "input" else weights
    fetched = {nodes[slot_names[i]]: i for i in streamed if nodes[slot_names[i]] not in crossed}
    rng_slot = _rng_slots(lowered)
    windows: dict[fx.Node, list[fx.Node]] = {}
    if tp_windows:
        collectives = backward_allreduces(lowered.joint.gm, lowered.forward_nodes)
        for k, slots in tp_windows:
            windows[collectives[k]] = [nodes[slot_names[i]] for i in sorted(slots)]
    sequence, recomputed = _backward_sequence(lowered, set(sources) | set(crossed) | set(fetched), windows, only)
    # only what this graph reads comes back in it (under a split, the other part brings the rest)
    read_here = {a for _kind, n in sequence for a in n.all_input_nodes}
    fetched = {n: i for n, i in fetched.items() if n in read_here}
    streamed = {i: streamed[i] for i in fetched.values()}
    slot_joint = {i: n for n, i in fetched.items()}
    in_window = {n for kind, n in sequence if kind == "tp"}
    waits = {u for c in windows for u in c.users if "wait_tensor" in str(u.target)}
    held_used = [i for i in range(n_kept, n_kept + n_held)
                 if any(u in recomputed for u in nodes[slot_names[i]].users)]
    rng_used = [(rng_slot[n], n) for n in lowered.joint.gm.graph.nodes if n in recomputed and n in rng_slot]
    read = {a for _kind, n in sequence for a in n.all_input_nodes}
    if part == "weight":   # only the slots it reads: the rest is freed after the input part
        kept_slots = [i for i in kept_slots if nodes[slot_names[i]] in read]
        avail_slots = [i for i in avail_slots if nodes[slot_names[i]] in read]
    in_slots = kept_slots + avail_slots + held_used

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    prefetch = _Prefetch(graph, streamed, lowered.joint, lowered.forward_nodes) if streamed else None
    for i in in_slots:
        _placeholder(graph, nodes[slot_names[i]], env)
    state_of = {n: graph.placeholder(f"rng_state_{n.name}") for _i, n in rng_used}
    for t in (lowered.tangents if part != "weight" else crossed):
        _placeholder(graph, t, env)
    clock = graph.get_attr("lynx_clock") if recomputed else None
    n_attrs = len(lowered.joint.attr_names)
    # the gradients this graph computes (all of them but in a split); the weight part sinks all
    mine = set(range(len(lowered.grads)))
    if only is not None:
        passed = set(lowered.tangents) if part == "input" else set()
        mine = {k for k, g in enumerate(lowered.grads) if g in only or g in passed}
    # parameter gradients handed over as soon as computed: index in grads -> attribute index
    sunk = {k: i for k, i in enumerate(lowered.grad_of)
            if k in mine and i < n_attrs and (sink or part == "weight")}
    sink_node = graph.get_attr("lynx_sink") if sunk else None
    sink_after: dict[fx.Node, list[tuple[int, int]]] = {}
    for k, i in sunk.items():
        sink_after.setdefault(lowered.grads[k], []).append((k, i))
    tp_log = graph.get_attr("lynx_tp_log") if windows else None
    in_recompute = in_tp = False
    if prefetch is not None:
        prefetch.reach(None)
    for kind, n in sequence:
        if prefetch is not None:
            if kind == "bw":
                prefetch.reach(lowered.joint.origin.get(n.name))
            for a in n.all_input_nodes:
                if a in fetched and a not in env:
                    prefetch.take(fetched[a], slot_joint, env)
        if (kind == "re") != in_recompute:
            in_recompute = kind == "re"
            graph.call_function(clock_start if in_recompute else clock_stop, (clock,))
        if (kind == "tp") != in_tp:
            in_tp = kind == "tp"
            graph.call_function(tp_segment_start if in_tp else tp_segment_stop, (tp_log,))
        if n in waits:  # how long the wait after a window blocked: was the collective still in flight?
            graph.call_function(tp_wait_start, (tp_log,))
            _copy(graph, n, env, state_of)
            graph.call_function(tp_wait_stop, (tp_log,))
        else:
            _copy(graph, n, env, state_of)
        for _k, i in sink_after.pop(n, ()):
            graph.call_function(accumulate_grad, (sink_node, i, env[n]))
    if in_recompute:
        graph.call_function(clock_stop, (clock,))
    if in_tp:
        graph.call_function(tp_segment_stop, (tp_log,))
    for g, pairs in sink_after.items():  # gradients that are inputs (a tangent passed through)
        for _k, i in pairs:
            graph.call_function(accumulate_grad, (sink_node, i, env[g]))
    outputs: list[Any] = [None if k in sunk or k not in mine else env[g] for k, g in enumerate(lowered.grads)]
    handed: list[fx.Node] = []
    if part == "input":   # what the weight part reads that only this part has
        _inputs, weights = split_backward_nodes(lowered)
        wanted = {a for w in weights for a in w.all_input_nodes if a not in weights and a in env and a not in sources}
        handed = [n for n in lowered.joint.gm.graph.nodes if n in wanted]
        outputs += [env[n] for n in handed]
    graph.output(tuple(outputs) if part != "weight" else ())
    if not lowered.compile:
        graph.set_codegen(boxed_codegen())
    attrs: dict[str, Any] = {"lynx_clock": Clock(), "lynx_sink": GradSink(), "lynx_tp_log": TPWindowLog()}
    for n in graph.nodes:
        if n.op == "get_attr" and n.target not in attrs:
            attrs[n.target] = fetch_attr(lowered.joint.gm, n.target)
    gm = fx.GraphModule(attrs, graph)
    extra = extra_peak_bytes(graph, {v: k for k, v in env.items()}, lowered.stage_roots)
    origins = frozenset(lowered.origin[n.name] for n in recomputed - in_window if n.name in lowered.origin)
    tp_origins = frozenset(lowered.origin[n.name] for n in in_window if n.name in lowered.origin)
    run: Callable[[list], Any]
    if lowered.compile:
        fn = compiled(gm, True)
        run = lambda args: fn(*args)  # noqa: E731 - Inductor manages its buffers itself
    else:
        run = gm
    roots = {storage_root(n) for n in handed} & lowered.stage_roots
    return BackwardGraph(gm=gm, run=run, in_slots=in_slots + [i for i, _ in rng_used], nodes=origins,
                         clock=attrs["lynx_clock"], extra_peak_bytes=extra,
                         sink=attrs["lynx_sink"] if sunk else None, tp_log=attrs["lynx_tp_log"],
                         tp_nodes=tp_origins, cross=[n.name for n in handed],
                         cross_bytes=sum(storage_nbytes(r) for r in roots),
                         offload_groups=prefetch.groups if prefetch is not None else ())


class _Prefetch:
    """Where a backward graph brings offloaded slots back: one group per issuing node, issued
    when the backward reaches that node — its first node from that captured node or one before
    it in forward order (a node whose backward has no op of its own is passed, not met) — or at
    the start; waited on before the group's first reader (issued there, if the reader comes first)."""

    def __init__(self, graph: fx.Graph, streamed: Mapping[int, str | None], joint: JointGraph,
                 forward: set[fx.Node]) -> None:
        self.graph = graph
        self.handle = graph.placeholder("lynx_offload")   # the microbatch's OffloadedValues
        self.position: dict[str, int] = {}   # captured node -> its place in the forward
        for n in joint.gm.graph.nodes:
            if n in forward and n.name in joint.origin:
                self.position.setdefault(joint.origin[n.name], len(self.position))
        by_issue: dict[str | None, list[int]] = {}
        for slot, at in sorted(streamed.items(), key=lambda kv: kv[0]):
            by_issue.setdefault(at if at in self.position else None, []).append(slot)
        self.order = list(by_issue)   # group id -> issuing node
        self.groups = tuple(tuple(by_issue[at]) for at in self.order)
        self.group_of = {slot: g for g, slots in enumerate(self.groups) for slot in slots}
        self.issued: dict[int, fx.Node] = {}
        self.waited: set[int] = set()

    def reach(self, origin: str | None) -> None:
        """The backward reaches captured node ``origin`` (None: the start): issue the groups whose
        issuing node it is, or is not before."""
        here = self.position.get(origin) if origin is not None else None
        for g, at in enumerate(self.order):
            if g in self.issued:
                continue
            if at is None or (here is not None and here <= self.position[at]):
                self.issued[g] = self.graph.call_function(offload_issue, (self.handle, g))

    def take(self, slot: int, joint_of: Mapping[int, fx.Node], env: dict[fx.Node, fx.Node]) -> None:
        """Make ``slot``'s value available to its first reader: the group waited on, and every
        value of it taken from the issue's result at once (the result would hold them all until
        its last piece is taken), each then freed after its own last reader."""
        g = self.group_of[slot]
        if g not in self.issued:   # its reader came before the node that issues it
            self.issued[g] = self.graph.call_function(offload_issue, (self.handle, g))
        if g in self.waited:
            return
        self.graph.call_function(offload_wait, (self.handle, g))
        self.waited.add(g)
        for k, member in enumerate(self.groups[g]):
            joint = joint_of[member]
            value = self.graph.call_function(operator.getitem, (self.issued[g], k))
            value.meta = dict(joint.meta)
            env[joint] = value


def compiled(gm: fx.GraphModule, compile: bool) -> Callable[..., Any]:
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
