"""Graph emission: a lowered stage's forward, recompute and backward graphs as fx code.

:func:`lynx.rewrite.lower.lower` decides the slot table (what is kept, held, dropped); this
module writes the graphs that fill and read it, each an ``fx.GraphModule`` copied node by node
from the joint graph:

* :func:`build_forward` — primals → stage outputs, kept and held values, and the RNG state
  saved before each random op the dropped region contains;
* :func:`build_recompute` — one set of dropped slots from the kept and held ones (and those
  already brought back), random ops replayed from their saved state;
* :func:`~lynx.rewrite.emit_backward.build_backward` (a module of its own) — the joint graph's
  backward nodes in order, each dropped value recomputed just before its first reader; for
  zero-bubble schedules split into an input part and a weight part.

A random op is copied in one place (:func:`copy_node`): replayed from its saved state where the
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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from lynx.frontend.joint import JointGraph
from lynx.rewrite.fast_calls import bind_calls
from lynx.rewrite.graph_calls import Clock, GradSink, replay_rng, save_rng_state
from lynx.rewrite.offload import offload_put
from lynx.rewrite.tp_windows import TPWindowLog

if TYPE_CHECKING:
    from lynx.rewrite.lower import LoweredStage

__all__ = ["RecomputeGraph", "BackwardGraph", "build_forward", "build_recompute", "compiled"]


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


def ancestors(outputs: Iterable[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
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


def copy_placeholder(graph: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node]) -> None:
    """An input of ``graph`` standing for joint node ``n`` (its metadata copied)."""
    env[n] = graph.placeholder(n.name)
    env[n].meta = dict(n.meta)


def _device_of(n: fx.Node) -> torch.device:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.device if isinstance(val, torch.Tensor) else torch.device("cpu")


def copy_node(graph: fx.Graph, n: fx.Node, env: dict[fx.Node, fx.Node], state_of: dict[fx.Node, fx.Node]) -> None:
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
    needed = ancestors([o for o in outputs if isinstance(o, fx.Node)], stop=set(inputs))
    missing = [n.name for n in needed if n.op == "placeholder"]
    if missing:
        raise AssertionError(f"lowering: graph reads {missing[:5]} which it does not take")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    handle = graph.placeholder("lynx_offload") if offloaded else None
    for n in inputs:
        copy_placeholder(graph, n, env)
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


def rng_slots(lowered: LoweredStage) -> dict[fx.Node, int]:
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
    rng_slot = rng_slots(lowered)
    wanted = [nodes[slot_names[i]] for i in sorted(targets)]
    # what the targets need, stopping at sources; dropped values met on the way come back too
    needed = ancestors(wanted, stop={n for _, n in sources})
    dropped_slot = {nodes[slot_names[i]]: i for i in range(lowered.first_dropped_slot, len(slot_names))}
    outputs = [n for n in nodes.values() if n in needed and n in dropped_slot]
    used_sources = [(i, n) for i, n in sources if any(u in needed for u in n.users)]
    state_inputs = [(rng_slot[n], n) for n in nodes.values() if n in needed and n in rng_slot]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for _i, n in used_sources:
        copy_placeholder(graph, n, env)
    state_of = {n: graph.placeholder(f"rng_state_{n.name}") for _i, n in state_inputs}
    for n in lowered.joint.gm.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            raise AssertionError(f"lowering: recompute reads primal {n.name} that the forward did not hold")
        copy_node(graph, n, env, state_of)
    graph.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(lowered.joint.gm, graph)
    out_slots = [dropped_slot[n] for n in outputs]
    in_slots = [i for i, _ in used_sources] + [i for i, _ in state_inputs]
    recomputed = frozenset(lowered.origin[n.name] for n in needed if n.name in lowered.origin)
    return RecomputeGraph(gm=gm, in_slots=in_slots, out_slots=out_slots, run=compiled(gm, lowered.compile),
                          nodes=recomputed, out_bytes=sum(lowered.bytes_of_slot[i] for i in out_slots))


def compiled(gm: fx.GraphModule, compile: bool) -> Callable[..., Any]:
    """``gm``'s code with its operator calls bound (:func:`~lynx.rewrite.fast_calls.bind_calls`),
    or ``torch.compile(gm)`` (Inductor) with a clear error where it cannot build."""
    if not compile:
        return bind_calls(gm)
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
