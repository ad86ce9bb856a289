"""Offload between the planner and the solvers: the copy lanes a stage problem sees, and back.

* :func:`stage_copies` — one stage's :class:`~lynx.solvers.copies.StageCopies` from a replayed
  timeline: the host link's bandwidth per device (shared links: each sharer's part), every
  microbatch's first prefetch slot (the earliest ``R`` position serving its backward — the one
  before the forward that precedes it in 1F1B, with that forward's time to copy; on the first
  stage, which has no ``R`` there, the forward's start, :func:`prefetch_slot_id` — and the
  seconds from there to the backward's start), each group's backward seconds, and the terms
  bounding what earlier forwards' device→host copies still hold when a backward starts
  (Reich's formula for a queue: bytes offloaded since ``t`` minus what the lane moved since).
* :func:`copy_loads` — what per-stage assignments put on the copy lanes
  (:class:`~lynx.planner.copy_lanes.CopyLoads`), for the timeline's replay.
* :func:`offload_decision_fields` — what a plan records per offloaded node for the runtime:
  the window of its prefetch per microbatch, or the node whose backward issues it.

Offload is planned for one model chunk per device (``1f1b``, ``gpipe``).

Example::

    >>> from lynx.planner.synthetic import synthetic_graph
    >>> from lynx.planner.problems import build_pipeline, build_problems
    >>> from lynx.planner.comm import CommModel
    >>> from lynx.planner.copy_lanes import HostCopies
    >>> from lynx.planner.host_link import PCIE4_X16
    >>> from lynx.planner.timeline import run_timeline
    >>> g = synthetic_graph(layers=4)
    >>> host = HostCopies(link=PCIE4_X16, lane_of_device=(0, 1), share=1)
    >>> pipe = build_pipeline(g, pp=2, microbatches=4, comm=CommModel.free(), host=host)
    >>> p = build_problems(g, pipe, run_timeline(pipe), budget_bytes=2**40, static=[0, 0], offload=True)
    >>> [str(slot.window) for slot in p[0].copies.slots][:2]   # B0 follows F1, B1 follows F2
    ['s0.recv_act.mb1', 's0.recv_act.mb2']
"""

from __future__ import annotations

from typing import Any, Optional

import networkx as nx

from lynx.errors import LynxConfigError
from lynx.planner.copy_lanes import CopyLoads
from lynx.planner.timeline import PipelineCosts, Timeline
from lynx.planner.windows import WindowId
from lynx.solvers.copies import PrefetchSlot, StageCopies
from lynx.solvers.offload import group_layout, issue_group, read_groups
from lynx.solvers.problem import Assignment, ProblemNode, StageProblem, group_key, group_ranks, is_sent

__all__ = ["stage_copies", "copy_loads", "offload_decision_fields", "check_offload_schedule", "OFFLOAD_SCHEDULES",
           "prefetch_slot_id"]

OFFLOAD_SCHEDULES = ("1f1b", "gpipe")


def prefetch_slot_id(device: int, microbatch: int) -> WindowId:
    """The slot before forward ``microbatch`` on ``device``: its ``recv_act`` window's id (on the
    first stage, which receives nothing, the forward's start)."""
    return WindowId.recv(device, "recv_act", microbatch)


def check_offload_schedule(schedule: str, virtual: int) -> None:
    if schedule not in OFFLOAD_SCHEDULES or virtual != 1:
        raise LynxConfigError(f"offload is planned for one model chunk per device (schedule "
                              f"{' or '.join(OFFLOAD_SCHEDULES)}), not {schedule!r}; use schedule='1f1b' or "
                              "'gpipe', or offload=False")


def stage_copies(graph: nx.DiGraph, pipe: PipelineCosts, timeline: Timeline, stage: int,
                 nodes: tuple[ProblemNode, ...], host_budget_bytes: int) -> StageCopies:
    """Stage ``stage``'s copy lanes as the solvers see them (see the module docstring)."""
    host = pipe.host
    assert host is not None, "build the pipeline with a host link (offload=True)"
    check_offload_schedule(pipe.schedule, pipe.virtual)
    sharing = sum(1 for lane in host.lane_of_device if lane == host.lane_of_device[stage])
    d2h, h2d = host.rate("d2h") / sharing, host.rate("h2d") / sharing
    probe = StageProblem(stage=stage, nodes=nodes, windows=(), microbatches=pipe.microbatches, in_flight=1,
                         activation_budget_bytes=0)
    ranks = group_ranks(probe)
    block_of_group = _block_of_group(graph, nodes, ranks)
    backward = tuple(pipe.costs[b].backward_s + pipe.costs[b].tp_backward_s for b in block_of_group)
    forward = tuple(pipe.costs[b].forward_s + pipe.costs[b].tp_forward_s for b in block_of_group)
    actions = timeline.actions[stage]
    slots = _slots(actions, pipe.microbatches)
    most = [0] * len(block_of_group)   # per group rank: the most a microbatch can offload
    for n in nodes:
        if n.saved_bytes > 0 and not is_sent(n):   # (solvers.offload.offloadable's rule)
            most[ranks[group_key(n)]] += n.saved_bytes
    # (a stage holding one microbatch: its own copies end by its forward's end, which HEU checks
    # per node — lynx.solvers.heu.offload._Drain — and OPT does not offload there)
    own = timeline.in_flight[stage] > 1
    pending = () if host.link.synchronous else _pending_terms(pipe, actions, block_of_group, d2h, host.link.alpha_s,
                                                               most, own)
    return StageCopies(d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, alpha_s=host.link.alpha_s,
                       synchronous=host.link.synchronous, host_budget_bytes=host_budget_bytes, slots=slots,
                       group_backward_s=backward, pending=pending, group_forward_s=forward)


def _block_of_group(graph: nx.DiGraph, nodes: tuple[ProblemNode, ...], ranks: dict[str, int]) -> list[int]:
    out = [-1] * len(ranks)
    for n in nodes:
        g = ranks[group_key(n)]
        if out[g] < 0:
            out[g] = int(graph.nodes[n.name]["block"])
    return out


def _slots(actions: list[Any], microbatches: int) -> tuple[Optional[PrefetchSlot], ...]:
    """Per microbatch: the earliest ``R`` position serving its backward, and the seconds from
    it to the backward's start."""
    fwd_pos = {a.microbatch: i for i, a in enumerate(actions) if a.kind == "F"}
    slots: list[Optional[PrefetchSlot]] = [None] * microbatches
    for i, a in enumerate(actions):
        if a.kind not in ("B", "I") or a.window is None:
            continue
        best = (a.window, a.ready)
        before = actions[i - 1] if i > 0 else None
        # the forward right before this backward, once its own forward ran: the copy takes that
        # forward's time too (the first stage receives nothing, so it has no R there: the slot is
        # the forward's start, named like the recv_act window it would have)
        if before is not None and before.kind == "F" and fwd_pos.get(a.microbatch, i) < i - 1:
            best = (before.window or prefetch_slot_id(a.device, before.microbatch), before.ready)
        slots[a.microbatch] = PrefetchSlot(window=best[0], slack_s=max(0.0, a.start - best[1]))
    return tuple(slots)


def _pending_terms(pipe: PipelineCosts, actions: list[Any], block_of_group: list[int], rate: float,
                   alpha_s: float, most: list[int], own: bool) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Terms bounding the bytes still queued for the D2H lane when a backward starts: for each
    backward start ``T`` and each block end ``s`` before it, the blocks of microbatches not yet
    backpropagated whose forwards ended in ``[s, T]`` — the one backpropagated included where
    ``own`` (its copies are on the device until they end) — and the bytes the lane moved since.
    A term that cannot be positive whatever is offloaded (``most``: per group rank, what a
    microbatch can offload) is left out."""
    group_of_block = {b: g for g, b in enumerate(block_of_group)}
    ends = []   # (time a block's forward ended, microbatch, group rank)
    for a in actions:
        if a.kind != "F":
            continue
        t = a.start
        chunk = next(c for c in pipe.chunks if c.index == a.chunk)
        for b in chunk.blocks:
            t += pipe.costs[b].forward_s
            if b in group_of_block:
                ends.append((t, a.microbatch, group_of_block[b]))
            t += pipe.costs[b].tp_forward_s
    ends.sort()
    done: set[int] = set()
    best: dict[tuple[int, ...], float] = {}
    groups = len(block_of_group)
    for a in actions:
        if a.kind not in ("B", "I"):
            continue
        T = a.start
        counts = [0] * groups
        ceiling = 0   # the most the blocks ended since s can have offloaded
        live = [(t, g) for t, mb, g in ends if t <= T and mb not in done and (own or mb != a.microbatch)]
        done.add(a.microbatch)
        for t, g in reversed(live):   # s = each block end, latest first: the counts grow
            counts[g] += 1
            ceiling += most[g]
            drained = rate * (T - t) - alpha_s * rate * sum(counts)
            if drained >= ceiling:
                continue   # (never positive)
            key = tuple(counts)
            if drained < best.get(key, float("inf")):
                best[key] = drained
    return tuple(sorted(best.items()))


def copy_loads(graph: nx.DiGraph, pipe: PipelineCosts, problems: list[StageProblem],
               assignments: list[Assignment]) -> CopyLoads:
    """What the assignments' offload decisions put on the copy lanes."""
    chunk_of_block = {b: c.index for c in pipe.chunks for b in c.blocks}
    loads = CopyLoads()
    for problem, assignment in zip(problems, assignments):
        if not assignment.offload:
            continue
        layout, reads = group_layout(problem), read_groups(problem)
        block_of_group = _block_of_group(graph, problem.nodes, group_ranks(problem))
        for node in problem.nodes:
            if node.name not in assignment.offload:
                continue
            block = int(graph.nodes[node.name]["block"])
            chunk = chunk_of_block[block]
            g = issue_group(reads[node.name], layout)
            issue = block_of_group[g] if g >= 0 else None
            reader = block_of_group[reads[node.name]]
            for mb in range(problem.microbatches):
                key = (chunk, mb, block)
                loads.offload[key] = loads.offload.get(key, 0) + node.saved_bytes
                wid = assignment.prefetch_of.get((node.name, mb))
                if wid is not None:
                    _add(loads.window.setdefault(wid, []), (chunk, mb), node.saved_bytes)
                else:
                    _add_streamed(loads.streamed.setdefault((chunk, mb), []), issue, reader, node.saved_bytes)
                # (the prefetch waits for this block's copy-out only: copy_lanes.CopyReplay.out_at)
                at = (chunk, mb, None if wid is not None else reader)
                loads.sources[at] = loads.sources.get(at, frozenset()) | {block}
        _window_reads(problem, assignment, {n: block_of_group[g] for n, g in reads.items()}, loads.window_reads)
    return loads


def _window_reads(problem: StageProblem, assignment: Assignment, block_of: dict[str, int],
                  into: dict[WindowId, frozenset[int]]) -> None:
    """Per tensor-parallel window of the assignment, the reading blocks of the streamed values
    its recomputation reads (a node placed there whose input is offloaded and not prefetched in
    a window for the microbatch; ``block_of``: per node, the block that reads it): what the
    runtime waits for in it (``CopyLoads.window_reads``)."""
    inputs = {n.name: n.inputs for n in problem.nodes}
    for (name, mb), wid in assignment.window_of.items():
        if wid.kind != "tp_allreduce":
            continue
        blocks = {block_of[src] for src in inputs.get(name, ())
                  if src in assignment.offload and (src, mb) not in assignment.prefetch_of}
        if blocks:
            into[wid] = into.get(wid, frozenset()) | blocks


def _add(entries: list, key: tuple[int, int], nbytes: int) -> None:
    for i, (chunk, mb, have) in enumerate(entries):
        if (chunk, mb) == key:
            entries[i] = (chunk, mb, have + nbytes)
            return
    entries.append((*key, nbytes))


def _add_streamed(entries: list, issue: Optional[int], reader: int, nbytes: int) -> None:
    for i, (at, rd, have) in enumerate(entries):
        if (at, rd) == (issue, reader):
            entries[i] = (at, rd, have + nbytes)
            return
    entries.append((issue, reader, nbytes))


def offload_decision_fields(problem: StageProblem, assignment: Assignment, name: str) -> dict[str, Any]:
    """A plan decision's fields for offloaded ``name``: ``window`` (every microbatch prefetches
    in the same one) or ``windows`` (per microbatch), and ``prefetch_at``: the node whose
    backward issues the prefetch where no window is named (None: at the backward's start)."""
    layout, reads = group_layout(problem), read_groups(problem)
    per_mb = {j: str(w) for (n, j), w in assignment.prefetch_of.items() if n == name}
    fields: dict[str, Any] = {}
    if len(per_mb) == problem.microbatches and len(set(per_mb.values())) == 1:
        fields["window"] = next(iter(per_mb.values()))
    elif per_mb:
        fields["windows"] = dict(sorted(per_mb.items()))
    g = issue_group(reads[name], layout)
    if g >= 0:
        fields["prefetch_at"] = problem.nodes[len(problem.nodes) - 1 - layout.first_step[g]].name
    return fields
