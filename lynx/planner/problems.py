"""From a contract graph and a config to the planning inputs: the :class:`~lynx.planner.timeline.PipelineCosts`,
static memory per stage, and one :class:`~lynx.solvers.problem.StageProblem` per stage built
from a replayed timeline; and back from solver assignments to plan decisions.

Example::

    >>> from lynx.planner.problems import build_pipeline, build_problems, static_bytes
    >>> from lynx.planner.synthetic import synthetic_graph
    >>> from lynx.planner.comm import CommModel
    >>> from lynx.planner.timeline import run_timeline
    >>> g = synthetic_graph(layers=4)          # a small graph that follows the graph contract
    >>> pipe = build_pipeline(g, pp=2, microbatches=4, comm=CommModel.free())
    >>> problems = build_problems(g, pipe, run_timeline(pipe), budget_bytes=2**40,
    ...                           static=static_bytes(g, pipe, optimizer="adamw"))
    >>> [p.in_flight for p in problems]
    [2, 1]
"""

from __future__ import annotations

from typing import Any, Optional

import networkx as nx

from lynx.planner.tp_costs import bytes_per_rank, marked, rank_seconds
from lynx.planner.comm import CommModel
from lynx.planner.copy_lanes import HostCopies
from lynx.planner.core_sharing import CoreSharing
from lynx.planner.offload_costs import check_offload_schedule, copy_loads, offload_decision_fields, stage_copies
from lynx.planner.partition import block_costs, partition_graph, static_bytes_per_param
from lynx.units import dtype_bytes
from lynx.plan import ChunkRecord, Decision
from lynx.solvers.problem import Assignment, ProblemNode, ProblemWindow, StageProblem, defers_weights
from lynx.planner.schedule import rank_actions
from lynx.planner.timeline import Loads, PipelineCosts, Timeline
from lynx.planner.windows import WindowId

__all__ = [
    "build_pipeline",
    "static_bytes",
    "static_breakdown",
    "stage_nodes",
    "build_problems",
    "loads_from_assignments",
    "decisions_from_assignment",
    "assignment_from_decisions",
    "stage_layout",
]


def build_pipeline(graph: nx.DiGraph, *, pp: int, microbatches: int, schedule: str = "1f1b",
                   virtual: int = 1, tp: int = 1, optimizer: str = "adamw",
                   comm: Optional[CommModel] = None, hardware: Any = None, dp: int = 1,
                   offload: bool = False, host: Optional[HostCopies] = None) -> PipelineCosts:
    """Partition ``graph`` into balanced chunks and cost every block and boundary; with
    ``offload`` (or a ``host`` given), the hardware's host link as copy lanes."""
    if offload and host is None:
        if hardware is None:
            raise ValueError("build_pipeline(offload=True) needs hardware= (its host link) or host=")
        check_offload_schedule(schedule, virtual)
        host = HostCopies.from_hardware(hardware, pp=pp, tp=tp, dp=dp)
    if comm is None:
        if hardware is None:
            raise ValueError("build_pipeline needs comm= or hardware=")
        comm = CommModel.from_hardware(hardware, tp=tp, dp=dp, optimizer=optimizer)
    chunks = partition_graph(graph, pp=pp, virtual=virtual)
    costs = block_costs(graph, comm, tp=tp, optimizer=optimizer)
    blocks = graph.graph["blocks"]
    chunk_of_node = {n: c.index for c in chunks for b in c.blocks for n in blocks[b]["nodes"]}
    boundary, boundary_bytes = [], []
    for c in chunks[:-1]:
        sent: set[str] = set()
        for b in c.blocks:
            for n in blocks[b]["nodes"]:
                if any(chunk_of_node.get(v, -1) > c.index for v in graph.successors(n)):
                    sent.add(n)
        nbytes = sum(bytes_per_rank(graph.nodes[n].get("output_bytes", 0), graph.nodes[n], tp) for n in sent)
        boundary.append(comm.p2p(nbytes))
        boundary_bytes.append(int(nbytes))
    optimizer_s: tuple[float, ...] = ()
    if hardware is not None:  # each device's optimizer step over its parameters (lynx.planner.cost.optimizer_step_s)
        from lynx.planner.cost import optimizer_step_s

        size = dtype_bytes(graph.graph.get("dims", {}).get("dtype"))
        optimizer_s = tuple(optimizer_step_s(sum(costs[b].param_bytes for c in chunks if c.device == s
                                                 for b in c.blocks) // size, optimizer, hardware)
                            for s in range(pp))
    action_s = hardware.runtime_action_s if hardware is not None else 0.0  # the runtime's own, per action
    return PipelineCosts(pp=pp, microbatches=microbatches, schedule=schedule, chunks=tuple(chunks),
                         costs=tuple(costs), boundary_s=tuple(boundary), virtual=virtual, optimizer_s=optimizer_s,
                         host=host, action_s=action_s, grads_first=tp == 1,   # as the runtime: TP runs B whole
                         link_host_s_per_byte=hardware.links["pp"].host_s_per_byte if hardware is not None else 0.0,
                         boundary_bytes=tuple(boundary_bytes),
                         link_burst_s=hardware.links["pp"].burst_s if hardware is not None else 0.0,
                         cores=CoreSharing.from_hardware(hardware, pp=pp, tp=tp, dp=dp))


def static_breakdown(graph: nx.DiGraph, pipe: PipelineCosts, *, optimizer: str) -> list[dict[str, int]]:
    """Per device: bytes of weights, gradients and optimizer state (mixed precision, ÷ tp)."""
    size = dtype_bytes(graph.graph.get("dims", {}).get("dtype"))
    per_param = static_bytes_per_param(optimizer, size)
    out = []
    for s in range(pipe.pp):
        weight_bytes = sum(pipe.costs[b].param_bytes for c in pipe.device_chunks(s) for b in c.blocks)
        params = weight_bytes // size
        out.append({"weights": params * size, "gradients": params * size,
                    "optimizer": params * (per_param - 2 * size)})
    return out


def static_bytes(graph: nx.DiGraph, pipe: PipelineCosts, *, optimizer: str) -> list[int]:
    """Per device: static memory (weights + gradients + optimizer state)."""
    return [sum(parts.values()) for parts in static_breakdown(graph, pipe, optimizer=optimizer)]


def stage_nodes(graph: nx.DiGraph, pipe: PipelineCosts, device: int) -> list[str]:
    """The device's nodes in forward order (its chunks in pipeline order)."""
    blocks = graph.graph["blocks"]
    return [n for c in pipe.device_chunks(device) for b in c.blocks for n in blocks[b]["nodes"]]


def build_problems(graph: nx.DiGraph, pipe: PipelineCosts, timeline: Timeline, *, budget_bytes: int,
                   static: list[int], tp: int = 1, previous: Optional[list[StageProblem]] = None,
                   offload: bool = False, host_budget_bytes: Optional[int] = None) -> list[StageProblem]:
    """One StageProblem per device from the graph and a replayed timeline's windows.

    ``previous``: the problems of an earlier round on the same graph, pipeline and ``tp`` (the
    planning loop's): their node tuples are reused as they are — only windows and
    microbatches in flight change from round to round, and a solver can then recognise a stage
    it has seen by identity instead of comparing hundreds of nodes. ``offload``: each problem
    carries its copy lanes (:func:`lynx.planner.offload_costs.stage_copies`; the pipeline needs
    a host link) and ``host_budget_bytes`` of pinned host memory (None: unlimited)."""
    if offload and pipe.host is None:
        raise ValueError("build_problems(offload=True) needs a pipeline built with a host link (offload=True)")
    problems = []
    lists = rank_actions(pipe.schedule, pipe.pp, pipe.microbatches, pipe.virtual)
    for s in range(pipe.pp):
        if previous is not None:
            nodes, sent_bytes = previous[s].nodes, previous[s].sent_bytes
        else:
            nodes, sent_bytes = _stage_nodes(graph, pipe, s, tp)
        in_flight = timeline.in_flight[s]
        copies = None
        if offload:
            copies = stage_copies(graph, pipe, timeline, s, nodes,
                                  host_budget_bytes if host_budget_bytes is not None else 2**62)
        problems.append(StageProblem(
            stage=s, nodes=nodes, windows=_windows(timeline, s), microbatches=pipe.microbatches,
            in_flight=in_flight, activation_budget_bytes=max(0, budget_bytes - static[s] - in_flight * sent_bytes),
            sent_bytes=sent_bytes, copies=copies,
            backward_in_order=pipe.schedule in ("1f1b", "gpipe") and pipe.virtual == 1,
            actions=tuple(lists[s])))
    return problems


def _stage_nodes(graph: nx.DiGraph, pipe: PipelineCosts, s: int, tp: int) -> tuple[tuple[ProblemNode, ...], int]:
    """Stage ``s``'s nodes as the solvers see them (bytes per tp rank), and what its sends hold
    that no stage saves (per microbatch)."""
    names = stage_nodes(graph, pipe, s)
    members = set(names)
    blocks = graph.graph["blocks"]
    chunk_of = {n: c.index for c in pipe.device_chunks(s) for b in c.blocks for n in blocks[b]["nodes"]}
    position = {n: i for i, n in enumerate(graph.nodes)}
    position[""] = -1   # a model input's gradient (lynx.frontend.joint_weights)
    start = {c.index: min(position[n] for b in c.blocks for n in blocks[b]["nodes"]) for c in pipe.device_chunks(s)}
    # what each chunk sends (several chunks per device: each sends to the next chunk's device)
    sent, sent_bytes = set(), 0
    for c in pipe.device_chunks(s):
        mine, nbytes = _sent_storages(graph, [n for b in c.blocks for n in blocks[b]["nodes"]])
        sent |= mine
        sent_bytes += nbytes
    # who saves each output: the profile's names hold only in an unfolded graph
    savers_known = not graph.graph.get("folded")
    # a row-parallel linear's output is all-reduced, and a collective is never recomputed: the
    # runtime holds it from the forward (lynx.rewrite.lower), so its consumers never re-run it
    reduced = {n for n in names if tp > 1 and graph.nodes[n].get("tp_allreduce", (0, 0))[0]}
    nodes = []
    for n in names:
        attrs = graph.nodes[n]
        saved_by = attrs.get("output_saved_by") if savers_known else None
        output_bytes = attrs.get("output_saved_bytes")  # absent from graphs built before the profile had it
        nodes.append(ProblemNode(
            name=n,
            saved_bytes=bytes_per_rank(attrs.get("saved_bytes", 0), attrs, tp),
            output_saved=bool(attrs.get("output_saved", False)),
            recompute_s=rank_seconds(attrs, "forward_s", tp),
            inputs=tuple(p for p in graph.predecessors(n) if p in members and p not in reduced),
            layer=attrs.get("layer"),
            layer_class=str(attrs.get("layer_class", "")),
            core_attention=bool(attrs.get("core_attention", False)),
            saved_by=None if saved_by is None else tuple(v for v in saved_by if v in members),
            output_bytes=None if output_bytes is None else bytes_per_rank(output_bytes, attrs, tp),
            sent=n in sent or n in reduced,   # held whatever the plan says, as what a stage sends
            tp_collective=bool(tp > 1 and attrs.get("tp_allreduce", (0, 0))[1]),
            chunk=chunk_of[n],
            output_reads=_reads(attrs, "output", start[chunk_of[n]], position),
            rest_reads=_reads(attrs, "rest", start[chunk_of[n]], position),
            view_of=_view_of(graph, n, members, chunk_of),
        ))
    return tuple(nodes), sent_bytes if any(marked(graph.nodes[n]) for n in names) else _per_rank(sent_bytes, tp)


def _view_of(graph: nx.DiGraph, n: str, members: set[str], chunk_of: dict[str, int]) -> str | None:
    """For a view, the node in its chunk whose output storage it is (else None)."""
    base = _storage_owner(graph, n, members)
    return base if base is not None and base != n and chunk_of.get(base) == chunk_of[n] else None


def _reads(attrs: dict, part: str, start: int, position: dict[str, int]) -> Optional[tuple[bool, bool]]:
    """Whether a chunk starting at graph position ``start`` reads ``part`` of a node's saved values
    in its input-gradient part and in its weight-gradient part (None: the profile does not say)."""
    reach = attrs.get("backward_reach")
    if reach is None:
        return None
    if part not in reach:
        return (False, False)
    earliest, latest = reach[part]
    if (earliest is not None and earliest not in position) or (latest is not None and latest not in position):
        return None
    return (earliest is not None and position[earliest] < start, latest is None or position[latest] >= start)


def _per_rank(nbytes: Any, tp: int) -> int:
    """A node's bytes on one of ``tp`` ranks (rounded up: never optimistic)."""
    return -(-int(nbytes) // tp)


def _sent_storages(graph: nx.DiGraph, names: list[str]) -> tuple[set[str], int]:
    """What a stage's sends hold: the nodes owning a sent storage that a stage saves, and the
    bytes of sent storages nobody saves (each storage once). A sent view is its base's
    storage; a view of a value the stage did not produce (a model input, a received value)
    is not the stage's."""
    members = set(names)
    saved: set[str] = set()
    owners: set[str] = set()
    for n in names:
        if all(v in members for v in graph.successors(n)):
            continue
        base = _storage_owner(graph, n, members)
        if base is None:
            continue
        (saved if graph.nodes[base].get("output_saved") else owners).add(base)
    return saved, sum(int(graph.nodes[b].get("output_bytes", 0)) for b in owners)


def _storage_owner(graph: nx.DiGraph, n: str, members: set[str]) -> str | None:
    """The node whose output storage ``n``'s output is (``n`` itself unless a view; through
    views of views), or None where that storage is not the stage's (a view of a model input or
    of a received value)."""
    base = n
    while graph.nodes[base].get("is_view"):
        inputs = list(graph.predecessors(base))
        if not inputs or inputs[0] not in members:
            return None
        base = inputs[0]
    return base


def _windows(timeline: Timeline, stage: int) -> tuple[ProblemWindow, ...]:
    """The stage's windows a solver can use (open, and serving some layer)."""
    return tuple(ProblemWindow(id=w.id, kind=w.kind, microbatch=w.microbatch, capacity_s=w.capacity_s,
                               eligible_layers=w.eligible_layers)
                 for w in timeline.windows if w.device == stage and w.capacity_s > 1e-12 and w.eligible_layers != ())


def loads_from_assignments(graph: nx.DiGraph, pipe: PipelineCosts, problems: list[StageProblem],
                           assignments: list[Assignment]) -> Loads:
    """The recomputation seconds each assignment places in windows and on demand. Where a
    device's backward is split (zero bubble), each part is charged what its generated graph
    re-runs (:func:`_split_on_demand`): ``W`` re-runs what it reads that ``I`` does not hand over."""
    chunk_of_block = {b: c.index for c in pipe.chunks for b in c.blocks}
    window: dict[WindowId, float] = {}
    on_demand: dict[tuple[int, int, int], float] = {}
    on_demand_weight: dict[tuple[int, int, int], float] = {}
    for problem, assignment in zip(problems, assignments):
        split = defers_weights(problem)
        for node in problem.nodes:
            if node.name not in assignment.recompute:
                continue
            if node.recompute_s <= 0:   # (a view placed in a window: the window is still the plan's)
                for j in range(problem.microbatches):
                    wid = assignment.window_of.get((node.name, j))
                    if wid is not None:
                        window.setdefault(wid, 0.0)
                continue
            block = graph.nodes[node.name]["block"]
            for j in range(problem.microbatches):
                wid = assignment.window_of.get((node.name, j))
                if wid is None:
                    if not split:
                        key = (chunk_of_block[block], j, block)
                        on_demand[key] = on_demand.get(key, 0.0) + node.recompute_s
                else:
                    window[wid] = window.get(wid, 0.0) + node.recompute_s
        if split:
            _split_on_demand(graph, problem, assignment, chunk_of_block, on_demand, on_demand_weight)
    copies = copy_loads(graph, pipe, problems, assignments) if any(a.offload for a in assignments) else None
    return Loads(window=window, on_demand=on_demand, on_demand_weight=on_demand_weight, copies=copies)


def _split_on_demand(graph: nx.DiGraph, problem: StageProblem, assignment: Assignment,
                     chunk_of_block: dict[int, int], on_demand: dict[tuple[int, int, int], float],
                     on_demand_weight: dict[tuple[int, int, int], float]) -> None:
    """A split backward's on-demand seconds per part, per (chunk, microbatch, block): each node
    ``I`` re-runs for the microbatch into ``on_demand``, each ``W`` re-runs into
    ``on_demand_weight`` — a node in both costs twice (:func:`~lynx.solvers.memory_weights.regenerated_nodes`:
    what the generated graphs re-run, given what was prefetched for the microbatch)."""
    from lynx.solvers.exposed import split_reruns

    seconds = {n.name: n.recompute_s for n in problem.nodes}
    for j, in_i, in_w in split_reruns(problem, assignment):
        for part, into in ((in_i, on_demand), (in_w, on_demand_weight)):
            for name in part:
                if seconds[name] > 0:
                    block = graph.nodes[name]["block"]
                    key = (chunk_of_block[block], j, block)
                    into[key] = into.get(key, 0.0) + seconds[name]


def decisions_from_assignment(problem: StageProblem, assignment: Assignment) -> list[Decision]:
    """Plan decisions (forward order): one per node; a shared window is stored once."""
    decisions = []
    for node in problem.nodes:
        if node.name in assignment.offload:
            decisions.append(Decision(node=node.name, action="offload",
                                      **offload_decision_fields(problem, assignment, node.name)))
            continue
        if node.name not in assignment.recompute:
            decisions.append(Decision(node=node.name, action="keep"))
            continue
        per_mb = {j: assignment.window_of[(node.name, j)] for j in range(problem.microbatches)
                  if (node.name, j) in assignment.window_of}
        ids = {str(w) for w in per_mb.values()}   # the plan's JSON holds window ids as strings
        if len(per_mb) == problem.microbatches and len(ids) == 1:
            decisions.append(Decision(node=node.name, action="recompute", window=ids.pop()))
        else:
            decisions.append(Decision(node=node.name, action="recompute",
                                      windows={j: str(w) for j, w in per_mb.items()} or None))
    return decisions


def assignment_from_decisions(decisions: list[Decision], microbatches: int) -> Assignment:
    """The inverse of :func:`decisions_from_assignment`."""
    recompute = frozenset(d.node for d in decisions if d.action == "recompute")
    offload = frozenset(d.node for d in decisions if d.action == "offload")
    window_of: dict[tuple[str, int], WindowId] = {}
    prefetch_of: dict[tuple[str, int], WindowId] = {}
    for d in decisions:
        for j in range(microbatches):
            wid = d.window_for(j)
            if wid is not None:
                (prefetch_of if d.action == "offload" else window_of)[(d.node, j)] = WindowId.parse(wid)
    return Assignment(recompute=recompute, window_of=window_of, offload=offload, prefetch_of=prefetch_of)


def stage_layout(graph: nx.DiGraph, pipe: PipelineCosts, stage: int) -> tuple[list[int], list[str], list[ChunkRecord]]:
    """What a plan records of ``stage``'s place in the pipeline: its layers, its blocks' names in
    order and its chunks (what :func:`lynx.planner.loop.plan_graph` writes and
    :func:`lynx.planner.plan_check.recheck_plan` checks)."""
    blocks = graph.graph["blocks"]
    chunks = pipe.device_chunks(stage)
    return (sorted(layer for c in chunks for layer in c.layers),
            [blocks[b]["name"] for c in chunks for b in c.blocks],
            [ChunkRecord(index=c.index, blocks=[blocks[b]["name"] for b in c.blocks],
                         nodes=sum(len(blocks[b]["nodes"]) for b in c.blocks)) for c in chunks])
