"""The stage problem in solver form: items, microbatch classes, and back to an assignment.

A :class:`StageModel` is a :class:`~lynx.solvers.problem.StageProblem` shrunk for CP-SAT
(:mod:`lynx.solvers.cpsat`) and HEU: *items* (one per node, or a bundle of a node and
the zero-byte helpers recomputed with it, or — in HEU's reduced model — one per family of
identical nodes replicated over ``mult`` layers), *microbatch classes* (microbatches with
identical windows, decided once), the microbatches in flight and the budget.
:func:`model_from_problem` builds it; :func:`expand_solution` turns a
:class:`ModelSolution` back into a per-node :class:`~lynx.solvers.problem.Assignment`.

Example::

    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, recv_grad_capacity_s=1.0, views=True)
    >>> m = model_from_problem(p)
    >>> len(p.nodes) > len(m.items), [c.count for c in m.classes]
    (True, [4])
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.planner.windows import WindowId
from lynx.solvers.copies import StageCopies
from lynx.solvers.memory import is_sent, savers_of
from lynx.solvers.memory_replay import bound_counts
from lynx.solvers.memory_weights import handed_bytes, rerun_counts
from lynx.solvers.offload import offloadable, read_groups
from lynx.solvers.problem import (Assignment, MicrobatchClass, StageProblem, defers_weights, group_key, group_ranks,
                                  microbatch_classes)
from lynx.solvers.validate import required_recompute_closure

__all__ = [
    "OffloadItems",
    "offload_items",
    "ModelItem",
    "ModelClass",
    "StageModel",
    "ModelSolution",
    "model_from_problem",
    "expand_solution",
    "hint_from_assignment",
]


@dataclass(frozen=True)
class ModelItem:
    nodes: tuple[str, ...]  # stage nodes decided together (bundled helpers, replicated layers)
    mult: int  # identical replicas (layers) the item stands for
    saved_bytes: int  # per replica
    recompute_s: float  # per replica
    inputs: tuple[tuple[int, bool], ...]  # (item index, input is in an earlier group)
    output_saved: bool
    group: int  # transient group (one layer or edge block, regenerated at once)
    # the latest later group whose backward reads the item's output (it is then regenerated
    # there when on demand); None when no later group does
    saved_until: int | None = None
    # its output is saved only by a later stage: the runtime holds it until the backward ends
    sent: bool = False
    # zero bubble: bytes of what it saves that the deferred weight-gradient part reads (what its
    # input-gradient part hands over when it regenerated them: lynx.solvers.memory_weights)
    weight_bytes: int = 0
    chunk: int = 0   # the model chunk its nodes run in
    # zero bubble: seconds its regeneration costs per replica when on demand — each node once per
    # part that may re-run it (``W`` re-runs what it reads that ``I`` does not hand over, though
    # ``I`` re-ran it: lynx.solvers.memory_weights.rerun_counts); None: recompute_s
    on_demand_s: float | None = None


@dataclass(frozen=True)
class ModelClass:
    count: int  # microbatches in the class
    capacities: tuple[float, ...]  # per window position, in time order
    eligible: tuple[frozenset[int] | None, ...]  # items allowed in each window (None: all)
    # per window position, the group a tensor-parallel window runs after: inside that layer's
    # backward, after the on-demand regeneration of it and every later group; None (or
    # missing): before every on-demand group
    after: tuple[int | None, ...] = ()

    def before_on_demand(self, k: int, group: int) -> bool:
        """Whether window ``k`` runs before ``group``'s on-demand regeneration."""
        after = self.after[k] if k < len(self.after) else None
        return after is None or group < after


def windows_after(problem: StageProblem, mc: MicrobatchClass) -> tuple[int | None, ...]:
    """:attr:`ModelClass.after` of a microbatch class (see :func:`lynx.solvers.validate.validate`)."""
    ranks = group_ranks(problem)
    kinds = {w.id: w for w in problem.windows}
    out = []
    for ids in mc.window_ids:
        wid = ids[0]
        out.append(ranks.get(f"layer{wid.layer}") if kinds[wid].kind == "tp_allreduce" else None)
    return tuple(out)


@dataclass(frozen=True)
class OffloadItems:
    """The offload side of a :class:`~lynx.solvers.stage_model.StageModel`."""

    allowed: tuple[bool, ...]     # per item: may be offloaded
    read_group: tuple[int, ...]   # per item: the latest group reading it
    groups: int
    copies: StageCopies
    microbatches: int

    def streamed(self, i: int) -> bool:
        """Item ``i`` is prefetched during the backward (not in the slot)."""
        return self.read_group[i] + 1 < self.groups


def offload_items(problem: StageProblem, items: tuple[ModelItem, ...]) -> OffloadItems | None:
    """Per model item what offloading it means (None: the stage has no copy lanes, or holds one
    microbatch: there only the early layers' copies to the host end by the backward's start —
    HEU picks those node by node, :class:`lynx.solvers.heu.offload._Drain` — while this model
    decides identical layers as one item)."""
    if problem.copies is None or problem.in_flight < 2:
        return None
    can = set(offloadable(problem))
    reads = read_groups(problem)
    allowed, read = [], []
    for item in items:
        saving = [n for n in item.nodes if n in can]
        allowed.append(bool(saving) and not item.sent)
        read.append(max((reads[n] for n in item.nodes), default=item.group))
    groups = 1 + max((it.group for it in items), default=0)
    return OffloadItems(tuple(allowed), tuple(read), groups, problem.copies, problem.microbatches)


@dataclass(frozen=True)
class StageModel:
    items: tuple[ModelItem, ...]
    classes: tuple[ModelClass, ...]
    in_flight: int
    budget_bytes: int
    offload: OffloadItems | None = None   # the stage's copy lanes (offload=True)
    # several chunks or deferred weight gradients (lynx.solvers.memory_replay.bound_counts): per
    # chunk, the most of its microbatches in flight (empty: ``in_flight``), the most other
    # microbatches that may hold prefetched values, and the most that hold handed-over ones
    chunk_in_flight: tuple[tuple[int, int], ...] = ()
    held_over: int = 0
    handing: int = 0   # the most other microbatches waiting for their W


@dataclass(frozen=True)
class ModelSolution:
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    recompute: tuple[bool, ...]  # per item
    placement: tuple[tuple[int | None, ...], ...]  # per class, per item: window position or None
    objective_s: float  # exposed seconds (or peak bytes when minimising memory)
    bound_s: float
    search_time_s: float
    offload: tuple[bool, ...] = ()  # per item: offloaded (models with offload)


def _contract(problem: StageProblem) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Shrink the model without changing what it can express (up to rounding).

    Zero-byte nodes that do not keep their output are recomputed exactly when a consumer
    is. Those too cheap to register in the objective (views, transposes) become transparent:
    their consumers read their inputs directly. One with a single consumer in its own group
    is bundled with that consumer (recomputed in the same window). Returns node → bundle
    head, and transparent node → its (resolved) inputs.
    """
    total = sum(n.recompute_s for n in problem.nodes) or 1.0
    consumers: dict[str, list[str]] = {n.name: [] for n in problem.nodes}
    by_name = {n.name: n for n in problem.nodes}
    for n in problem.nodes:
        for src in n.inputs:
            if src in consumers:
                consumers[src].append(n.name)
    head = {n.name: n.name for n in problem.nodes}
    transparent: dict[str, tuple[str, ...]] = {}
    candidates = []
    for n in problem.nodes:
        outs = consumers[n.name]
        if n.saved_bytes or n.output_saved or not outs:
            continue
        if any(by_name[c].layer != n.layer or by_name[c].layer_class != n.layer_class for c in outs):
            continue  # (same group_key, compared without formatting strings)
        if n.recompute_s < 1e-4 * total:  # a view or transpose: negligible next to the stage
            transparent[n.name] = n.inputs
        else:
            candidates.append(n)
    for n in candidates:
        outs = consumers[n.name]
        if len(outs) == 1 and outs[0] not in transparent:
            head[n.name] = outs[0]
    for name in reversed([n.name for n in problem.nodes]):  # chains: follow to the last head
        if head[name] != name:
            head[name] = head[head[name]]
    return head, transparent


def model_from_problem(problem: StageProblem) -> StageModel:
    """Items from contracted nodes; microbatches grouped into classes of identical windows."""
    head, transparent = _contract(problem)
    ranks = group_ranks(problem)
    by_name = {n.name: n for n in problem.nodes}
    savers = savers_of(problem)
    heads = [n.name for n in problem.nodes if head[n.name] == n.name and n.name not in transparent]
    index = {h: i for i, h in enumerate(heads)}
    members: dict[str, list[str]] = {h: [] for h in heads}
    for n in problem.nodes:
        if n.name not in transparent:
            members[head[n.name]].append(n.name)

    def resolve(src: str) -> set[str]:  # in-stage producers seen through transparent nodes
        if src not in by_name:
            return set()
        if src in transparent:
            return set().union(*(resolve(s) for s in transparent[src])) if transparent[src] else set()
        return {head[src]}

    may_hand = handed_bytes(problem)
    reruns = rerun_counts(problem) if defers_weights(problem) else None
    items = []
    for h in heads:
        nodes = members[h]
        inner = set(nodes)
        srcs: set[str] = set()
        for name in nodes:
            for src in by_name[name].inputs:
                srcs |= resolve(src)
        srcs -= {h}
        srcs = {s for s in srcs if s not in inner}
        g = ranks[group_key(by_name[h])]
        inputs = tuple(sorted((index[s], ranks[group_key(by_name[s])] != g) for s in srcs))
        latest = max((ranks[group_key(by_name[s])] for x in nodes for s in savers[x]), default=g)
        items.append(
            ModelItem(
                nodes=tuple(nodes),
                mult=1,
                saved_bytes=sum(by_name[x].saved_bytes for x in nodes),
                recompute_s=sum(by_name[x].recompute_s for x in nodes),
                inputs=inputs,
                output_saved=by_name[h].output_saved,
                group=g,
                saved_until=latest if latest > g else None,
                sent=is_sent(by_name[h]),
                weight_bytes=sum(may_hand[x] for x in nodes),
                chunk=by_name[h].chunk,
                on_demand_s=None if reruns is None else sum(by_name[x].recompute_s * reruns[x] for x in nodes),
            )
        )
    layer_of = [by_name[h].layer for h in heads]
    classes = []
    for mc in microbatch_classes(problem):
        eligible = tuple(
            None if layers is None else frozenset(i for i, layer in enumerate(layer_of) if layer in layers)
            for layers in mc.eligible_layers
        )
        classes.append(ModelClass(len(mc.members), mc.capacities, eligible, windows_after(problem, mc)))
    items_t = tuple(items)
    chunk_in_flight, held_over, handing = bound_counts(problem)
    return StageModel(items_t, tuple(classes), problem.in_flight, problem.activation_budget_bytes,
                      offload_items(problem, items_t), chunk_in_flight=tuple(sorted(chunk_in_flight.items())),
                      held_over=held_over, handing=handing)


def expand_solution(problem: StageProblem, model: StageModel, sol: ModelSolution) -> Assignment:
    """Per-node assignment from a solution of ``model_from_problem(problem)``.

    Transparent nodes (see :func:`_contract`) are recomputed when a consumer is, placed with
    their earliest consumer: in the earliest window any recomputed consumer uses, on demand
    only when every recomputed consumer is. (A view such as ``split`` feeding one consumer
    prefetched in a window and another regenerated on demand must run in that window; it
    saves no bytes, so running early costs nothing.)
    """
    recompute = {name for item, dropped in zip(model.items, sol.recompute) if dropped for name in item.nodes}
    window_of: dict[tuple[str, int], WindowId] = {}
    classes = microbatch_classes(problem)
    for mc, where in zip(classes, sol.placement):
        per_position = [tuple(zip(mc.members, ids)) for ids in mc.window_ids]  # k -> ((mb, window id), ...)
        for item, k in zip(model.items, where):
            if k is not None:
                placed = per_position[k]
                for name in item.nodes:
                    for mb, wid in placed:
                        window_of[name, mb] = wid
    extra = required_recompute_closure(problem, recompute) - recompute
    if extra:
        position = {wid: k for mc in classes for k, ids in enumerate(mc.window_ids) for wid in ids}
        consumers: dict[str, list[str]] = {}
        for n in problem.nodes:
            for src in n.inputs:
                consumers.setdefault(src, []).append(n.name)
        for n in reversed(problem.nodes):
            if n.name not in extra:
                continue
            recompute.add(n.name)
            for mc in classes:
                for m_i, mb in enumerate(mc.members):
                    ks = [position[w] for c in consumers.get(n.name, ()) if c in recompute
                          and (w := window_of.get((c, mb))) is not None]
                    if ks:
                        window_of[n.name, mb] = mc.window_ids[min(ks)][m_i]
    offload: set[str] = set()
    prefetch_of: dict[tuple[str, int], WindowId] = {}
    if sol.offload and model.offload is not None and problem.copies is not None:
        can = set(offloadable(problem))
        for i, (item, moved) in enumerate(zip(model.items, sol.offload)):
            if not moved:
                continue
            names = [n for n in item.nodes if n in can]
            offload.update(names)
            if not model.offload.streamed(i):   # read by the first group: prefetched in each slot
                for j, slot in enumerate(problem.copies.slots):
                    if slot is not None:
                        prefetch_of.update({(n, j): slot.window for n in names})
    return Assignment(frozenset(recompute), window_of, frozenset(offload), prefetch_of)


def hint_from_assignment(problem: StageProblem, model: StageModel, assignment: Assignment):
    """Item values from an assignment (an item takes its bundle head's decision)."""
    rec = tuple(item.nodes[-1] in assignment.recompute for item in model.items)
    placement = []
    for mc in microbatch_classes(problem):
        first = mc.members[0]
        position = {ids[0]: k for k, ids in enumerate(mc.window_ids)}
        where = tuple(position.get(w) if (w := assignment.window_of.get((item.nodes[-1], first))) is not None else None
                      for item in model.items)
        placement.append(where)
    if model.offload is not None:
        moved = tuple(any(n in assignment.offload for n in item.nodes) for item in model.items)
        return rec, tuple(placement), moved
    return rec, tuple(placement)
