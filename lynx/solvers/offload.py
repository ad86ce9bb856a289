"""Offload accounting on a stage problem: when prefetches are issued, what stays pending, what is exposed.

The fourth decision beside keep, recompute in a window and recompute on demand
(:attr:`~lynx.solvers.problem.Assignment.offload`): a node's saved bytes are copied to host
memory after its forward and prefetched before its backward reads them. This module is the
one definition the memory model (:mod:`lynx.solvers.memory`), the solvers and the planner share
of

* **when a prefetch is issued** (:func:`issue_steps`): in the window the assignment names for
  the microbatch (``prefetch_of``: resident from the backward's start), else when the backward
  reaches the group (layer or edge block) above the node's *read group* — the latest group
  among its own, its savers', its consumers' and their savers' (:func:`read_groups`: whatever
  the plan recomputes, nothing in the backward reads the value earlier) — so the copy has that
  group's backward to arrive; for what the first-backpropagated group reads, at the backward's
  start (the solvers name a window for those);
* **what other microbatches' copies still hold** (:func:`pending_by_group`), from the stage's
  :class:`~lynx.solvers.copies.StageCopies`;
* **the exposed copy time** the solvers charge (:func:`copy_exposed_s`): per microbatch, a
  window prefetch's time beyond its slot's slack and each streamed group's time beyond the
  backward of the group it is issued in, and what a tensor-parallel window that reads such a
  group's value waits for it (:func:`tp_window_wait_s`); on a synchronous link (a CPU) every
  copy's time.

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=2, in_flight=2)
    >>> layout, reads = group_layout(p), read_groups(p)
    >>> layout.groups, reads["l1.fc1"], reads["l0.fc1"]     # layer 1's values are read in layer 1
    (2, 1, 0)
    >>> issue_steps(p, frozenset({"l0.fc1", "l1.fc1"})) == {"l0.fc1": layout.first_step[1], "l1.fc1": 0}
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.planner.windows import WindowId
from lynx.solvers.problem import (Assignment, StageProblem, exposed_recompute_s, group_key, group_ranks, is_sent,
                                  savers_of)

__all__ = ["GroupLayout", "group_layout", "read_groups", "issue_group", "issue_steps", "streamed_before",
           "offloadable", "slot_prefetch", "offloaded_by_group", "pending_by_group", "copy_exposed_s", "host_bytes",
           "prefetch_bytes_by_issue", "offload_overhead", "total_exposed_s", "tp_window_wait_s"]


@dataclass(frozen=True)
class GroupLayout:
    """Backward steps (node ``i`` of ``N`` at step ``N − 1 − i``) against group ranks."""

    group_of_step: tuple[int, ...]
    first_step: tuple[int, ...]   # per group rank: the step its backward starts at

    @property
    def groups(self) -> int:
        return len(self.first_step)


_LAYOUTS: dict[int, tuple[tuple, GroupLayout]] = {}


def group_layout(problem: StageProblem) -> GroupLayout:
    """The stage's groups in backward steps (cached per node tuple)."""
    key = id(problem.nodes)
    found = _LAYOUTS.get(key)
    if found is not None and found[0] is problem.nodes:
        return found[1]
    ranks = group_ranks(problem)
    last = len(problem.nodes) - 1
    of_step = [0] * len(problem.nodes)
    first = [last + 1] * len(ranks)
    for i, n in enumerate(problem.nodes):
        g = ranks[group_key(n)]
        of_step[last - i] = g
        first[g] = min(first[g], last - i)
    layout = GroupLayout(tuple(of_step), tuple(first))
    if len(_LAYOUTS) > 256:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (problem.nodes, layout)
    return layout


_READS: dict[int, tuple[tuple, dict[str, int]]] = {}


def read_groups(problem: StageProblem) -> dict[str, int]:
    """Per node, the latest group rank whose backward may read its saved values: its own, its
    savers' (every consumer's when unknown), its consumers' and their savers' (a consumer
    regenerated on demand for a later group's saver reads it there). Cached per node tuple."""
    key = id(problem.nodes)
    found = _READS.get(key)
    if found is not None and found[0] is problem.nodes:
        return found[1]
    ranks = group_ranks(problem)
    group = {n.name: ranks[group_key(n)] for n in problem.nodes}
    savers = savers_of(problem)
    consumers: dict[str, list[str]] = {n.name: [] for n in problem.nodes}
    for n in problem.nodes:
        for src in n.inputs:
            if src in consumers:
                consumers[src].append(n.name)
    out = {}
    for n in problem.nodes:
        readers = [n.name, *savers[n.name]]
        for c in consumers[n.name]:
            readers += [c, *savers[c]]
        out[n.name] = max(group[r] for r in readers if r in group)
    if len(_READS) > 256:
        _READS.clear()
    _READS[key] = (problem.nodes, out)
    return out


def issue_group(read_group: int, layout: GroupLayout) -> int:
    """The group whose backward's start issues a streamed prefetch read in ``read_group``
    (-1: none, the read group is backpropagated first: at the backward's start)."""
    above = read_group + 1
    return above if above < layout.groups else -1


def slot_prefetch(problem: StageProblem, names: frozenset[str] | set[str]) -> dict[tuple[str, int], WindowId]:
    """Per (node, microbatch) the window slot that prefetches each of ``names`` the first
    backpropagated group reads (its streamed prefetch would be issued at the backward's start)."""
    copies = problem.copies
    assert copies is not None
    layout, reads = group_layout(problem), read_groups(problem)
    return {(n, j): slot.window for n in names if issue_group(reads[n], layout) < 0
            for j, slot in enumerate(copies.slots) if slot is not None}


def issue_steps(problem: StageProblem, offload: frozenset[str] | set[str]) -> dict[str, int]:
    """The backward step each offloaded node's streamed prefetch is issued at."""
    layout, reads = group_layout(problem), read_groups(problem)
    out = {}
    for name in offload:
        g = issue_group(reads[name], layout)
        out[name] = layout.first_step[g] if g >= 0 else 0
    return out


def streamed_before(problem: StageProblem, name: str, window: WindowId) -> bool:
    """Whether offloaded ``name``'s streamed prefetch is issued before ``window`` runs: a
    tensor-parallel window of layer ``L`` runs inside ``L``'s backward, after its all-reduces,
    so what the backward issues at that group's start or earlier (a value read in the group
    below ``L`` or later) is on its way; the window's recomputation waits for it (the
    timeline's ``tp_allreduce`` window waits for the prefetches of the block below)."""
    if window.kind != "tp_allreduce" or window.layer is None:
        return False
    rank = group_ranks(problem).get(f"layer{window.layer}")
    issued = issue_group(read_groups(problem)[name], group_layout(problem))
    return rank is not None and issued >= rank


def offloadable(problem: StageProblem) -> list[str]:
    """Nodes the stage may offload: something saved, and not a value the stage sends on (held
    until the backward ends whatever the plan); none without copy lanes."""
    if problem.copies is None:
        return []
    return [n.name for n in problem.nodes if n.saved_bytes > 0 and not is_sent(n)]


def offloaded_by_group(problem: StageProblem, offload: frozenset[str] | set[str]) -> list[int]:
    """Per group rank: the bytes its forward copies to the host, per microbatch."""
    layout = group_layout(problem)
    out = [0] * layout.groups
    last = len(problem.nodes) - 1
    for i, n in enumerate(problem.nodes):
        if n.name in offload:
            out[layout.group_of_step[last - i]] += n.saved_bytes
    return out


def pending_by_group(problem: StageProblem, assignment: Assignment) -> list[int] | None:
    """Per group rank, the bytes other microbatches' device→host copies may still hold while
    the group is backpropagated (the solvers' bound; None: nothing can be pending)."""
    copies = problem.copies
    if copies is None or copies.synchronous or not assignment.offload:
        return None
    per_group = offloaded_by_group(problem, assignment.offload)
    pending = copies.pending_bytes(per_group)
    if pending <= 0:
        return None
    return [copies.pending_during(pending, g, len(per_group)) for g in range(len(per_group))]


def prefetch_bytes_by_issue(problem: StageProblem, assignment: Assignment, microbatch: int
                            ) -> tuple[int, dict[int, int]]:
    """For one microbatch: the bytes prefetched in its window, and the bytes each group's
    backward start issues (group rank ``-1``: read by the first group backpropagated, issued at
    the backward's start with no time to arrive)."""
    layout, reads = group_layout(problem), read_groups(problem)
    size = {n.name: n.saved_bytes for n in problem.nodes}
    window = 0
    streamed: dict[int, int] = {}
    for name in assignment.offload:
        if (name, microbatch) in assignment.prefetch_of:
            window += size[name]
        else:
            g = issue_group(reads[name], layout)
            streamed[g] = streamed.get(g, 0) + size[name]
    return window, streamed


def copy_exposed_s(problem: StageProblem, assignment: Assignment) -> float:
    """Copy seconds the backwards of one step wait for (the solvers' estimate; the simulator
    replays the lanes): see the module docstring."""
    copies = problem.copies
    if copies is None or not assignment.offload:
        return 0.0
    size = {n.name: n.saved_bytes for n in problem.nodes}
    total = sum(size[n] for n in assignment.offload)
    exposed = 0.0
    cache: dict[tuple, float] = {}
    prefetched: dict[int, set[str]] = {}
    for (n, j) in assignment.prefetch_of:
        prefetched.setdefault(j, set()).add(n)
    # (what prefetch_bytes_by_issue gives, the offloaded values' sizes and groups looked up once)
    layout, reads = group_layout(problem), read_groups(problem)
    values = [(name, size[name], issue_group(reads[name], layout)) for name in assignment.offload]
    for mb in range(problem.microbatches):
        slot = copies.slots[mb] if mb < len(copies.slots) else None
        slack = slot.slack_s if slot is not None else 0.0
        here_pf = prefetched.get(mb, set())
        cache_key = (frozenset(here_pf), slack)
        if cache_key in cache:
            exposed += cache[cache_key]
            continue
        window = 0
        streamed: dict[int, int] = {}
        for name, nbytes, g in values:
            if name in here_pf:
                window += nbytes
            else:
                streamed[g] = streamed.get(g, 0) + nbytes
        if copies.synchronous:
            here = copies.d2h_s(total) + copies.h2d_s(window) + sum(copies.h2d_s(b) for b in streamed.values())
        else:
            here = max(0.0, copies.h2d_s(window) - slack)
            for g, nbytes in streamed.items():
                room = copies.group_backward_s[g] if 0 <= g < len(copies.group_backward_s) else 0.0
                here += max(0.0, copies.h2d_s(nbytes) - room)
        cache[cache_key] = here
        exposed += here
    return exposed + tp_window_wait_s(problem, assignment)


def tp_window_wait_s(problem: StageProblem, assignment: Assignment) -> float:
    """Copy seconds tensor-parallel windows wait beyond what :func:`copy_exposed_s` charges
    per group: a ``tp_allreduce`` window of layer ``L`` whose recomputation reads a value
    streamed from ``L``'s backward start (:func:`streamed_before`) waits for that copy — the
    runtime waits before a value's first reader — ``late = max(0, copy − L's backward)``
    seconds, so its capacity is ``late`` less. It exposes ``max(0, load + late − capacity)``
    where the window overflow and the group's copy charge hold ``max(0, load − capacity) +
    max(0, late − capacity)``; the difference is charged here (0 on a synchronous link, where
    a copy ends before the compute that follows it)."""
    copies = problem.copies
    if copies is None or copies.synchronous or not assignment.offload or not assignment.window_of:
        return 0.0
    layout, reads = group_layout(problem), read_groups(problem)
    issued = {name: issue_group(reads[name], layout) for name in assignment.offload}
    reading = {n.name: [src for src in n.inputs if issued.get(src, -1) >= 0] for n in problem.nodes
               if n.name in assignment.recompute and any(issued.get(src, -1) >= 0 for src in n.inputs)}
    if not reading:
        return 0.0
    ranks = group_ranks(problem)
    cost = {n.name: n.recompute_s for n in problem.nodes}
    load: dict[WindowId, float] = {}
    waits: dict[WindowId, tuple[int, int]] = {}   # window -> (its group, microbatch)
    for (name, mb), wid in assignment.window_of.items():
        if wid.kind != "tp_allreduce":
            continue
        load[wid] = load.get(wid, 0.0) + cost.get(name, 0.0)
        g = ranks.get(f"layer{wid.layer}", -1)
        if any(issued[src] == g and (src, mb) not in assignment.prefetch_of for src in reading.get(name, ())):
            waits[wid] = (g, mb)
    if not waits:
        return 0.0
    size = {n.name: n.saved_bytes for n in problem.nodes}
    capacity = {w.id: w.capacity_s for w in problem.windows}
    extra = 0.0
    for wid, (g, mb) in waits.items():
        nbytes = sum(size[n] for n, at in issued.items() if at == g and (n, mb) not in assignment.prefetch_of)
        cap = capacity.get(wid, 0.0)
        backward = copies.group_backward_s[g] - cap if g < len(copies.group_backward_s) else 0.0
        late = max(0.0, copies.h2d_s(nbytes) - backward)
        used = load[wid]
        extra += max(0.0, used + late - cap) - max(0.0, used - cap) - max(0.0, late - cap)
    return extra


def host_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """Pinned host memory the stage's offloaded values need at most: every microbatch in flight's."""
    if not assignment.offload:
        return 0
    return problem.in_flight * sum(n.saved_bytes for n in problem.nodes if n.name in assignment.offload)


def offload_overhead(problem: StageProblem, offload: frozenset[str] | set[str]) -> int:
    """Device bytes offloading ``offload`` can add to a microbatch's backward at most: what
    the first group reads (prefetched in the slot, held from the backward's start), plus the
    largest, over groups, of the streamed values held while that group is backpropagated and
    the copies of other microbatches still pending then (the solvers' bound, as
    :mod:`lynx.solvers.cpsat_offload` counts it)."""
    if not offload:
        return 0
    layout, reads = group_layout(problem), read_groups(problem)
    last = len(problem.nodes) - 1
    size = {n.name: n.saved_bytes for n in problem.nodes}
    own = {n.name: layout.group_of_step[last - i] for i, n in enumerate(problem.nodes)}
    slot = 0
    change = [0] * (layout.groups + 2)   # a streamed value is held from its own group to the one above its read
    for n in offload:
        if issue_group(reads[n], layout) < 0:
            slot += size[n]
        elif own[n] <= reads[n] + 1:
            change[own[n]] += size[n]
            change[reads[n] + 2] -= size[n]
    pending = pending_by_group(problem, Assignment(frozenset(), offload=frozenset(offload))) or [0] * layout.groups
    worst = held = 0
    for q in range(layout.groups):
        held += change[q]
        worst = max(worst, held + pending[q])
    return slot + worst


def total_exposed_s(problem: StageProblem, assignment: Assignment) -> float:
    """Exposed recomputation plus exposed copy time: what the solvers minimise with offload."""
    return exposed_recompute_s(problem, assignment) + copy_exposed_s(problem, assignment)
