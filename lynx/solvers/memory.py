"""Peak saved-activation bytes of a stage under an assignment: what the compiled stage holds.

A stage runs generated graphs (:mod:`lynx.rewrite.lower`): the forward graph returns the
values the plan keeps, a window's recompute graph brings dropped values back before a
microbatch's backward, and the backward graph re-runs what is still missing just before its
first reader and drops every value after its last reader. The backward runs the captured
nodes' gradients in reverse forward order, so with the stage's nodes in forward order, node
``i`` of ``N`` is back-propagated at *backward step* ``N − 1 − i``. A node's saved bytes
(``ProblemNode.saved_bytes``) are two parts: its output's storage (``output_bytes``), read by
the backward of the nodes that saved it (``saved_by``: its consumers, itself when its own
backward reads it, as softmax's does) and by the re-run of a dropped consumer; and the rest
(e.g. a dropout mask, layer norm's statistics, a saved model input), read by its own
backward. For one microbatch j, each part is held:

* from step 0 when the node is kept or recomputed in a window for j (a tensor-parallel
  window of layer L: from the backward step of the all-reduce it runs after, inside layer
  L's backward); when it is recomputed on demand, from the first step that needs it: a
  saver's step, its own step when it has a rest, or the re-run of an on-demand consumer
  (re-running a node first re-runs its dropped inputs). A re-run brings both parts back at
  once (a multi-output op's result holds every piece until the last is taken);
* the output until its last reader, the rest until the node's own step. A saved output
  the stage sends on (:func:`is_sent`) is held to the end of the backward, kept or not:
  the stage holds what it sent as a root of the backward (values it sends that no stage
  saves, ``StageProblem.sent_bytes``, are outside the plan's reach: the problem's budget
  leaves them out and the simulator adds them to the plan's peak).

Where the profile does not say (``saved_by`` None: every consumer may read the output, and
the node itself; ``output_bytes`` None: all of the bytes are held as long as any are needed,
until the node's own step) the model takes the side that holds longer.

With the device's action list in the problem (``StageProblem.actions``: what the planner
builds), :func:`peak_activation_bytes` replays it (:mod:`lynx.solvers.memory_replay`: chunks
of their own, zero bubble's deferred weight gradients); the closed form below is what that
replay gives for one chunk with backwards in microbatch order, and what it uses without a list.

:func:`peak_activation_bytes` is the largest, over microbatches j and backward steps, of
``others(j) · held + what j holds at that step``, where ``held`` (:func:`held_bytes`)
is what a microbatch holds between its forward and its backward and ``others(j)`` is
``in_flight − 1`` — at most ``m − 1 − j`` where backwards run in microbatch order (1F1B,
GPipe: the cool-down's last microbatches have fewer others in flight). At step 0, j holds all it
kept and everything prefetched for it, so the state just before its backward is covered.
This is what the simulator reports and what the runtime's saved-bytes meter measures
(``tests/test_peak_prediction.py``: equal to the byte for every solver's plan of the tiny
GPT; see ``docs/memory.md``).

:func:`peak_upper_bound_bytes` is the coarser bound the solvers enforce (linear in the
decisions): ``in_flight · kept + max_j prefetched(j) + max_j (largest on-demand group of j +
early(j))``, where ``early(j)`` counts each on-demand node whose output a later group saves
(it comes back during that group's backward) with its on-demand ancestors in its group. It
is never below :func:`peak_activation_bytes` (at any step, what microbatch j holds is at most
its kept bytes, its prefetched bytes, one group's on-demand bytes and the early ones); the
difference is memory the solvers leave unused.

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=2, in_flight=2)
    >>> keep_all = Assignment(recompute=frozenset())
    >>> peak_activation_bytes(p, keep_all) == 2 * kept_bytes(p, keep_all)
    True
    >>> drop_all = Assignment(recompute=frozenset(n.name for n in p.nodes if n.name != "l1.add2"))
    >>> peak_activation_bytes(p, drop_all) <= peak_upper_bound_bytes(p, drop_all)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

from lynx.solvers.memory_microbatch import (arrivals_by_microbatch, held_bytes, microbatch_peak_bytes)
from lynx.solvers.memory_replay import bound_counts, replay_peak_bytes
from lynx.solvers.memory_weights import handed_bytes
from lynx.solvers.offload import pending_by_group
from lynx.solvers.problem import (Assignment, StageProblem, group_key, group_ranks, is_sent,
                                  savers_of)

__all__ = [
    "peak_activation_bytes",
    "peak_upper_bound_bytes",
    "microbatch_peak_bytes",
    "kept_bytes",
    "held_bytes",
    "prefetched_bytes",
    "on_demand_transient_bytes",
    "savers_of",
    "is_sent",
]

def kept_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """Bytes one microbatch keeps on the device from forward to backward (a stage output's, even
    if dropped; an offloaded node's are on the host)."""
    dropped = assignment.dropped
    return sum(n.saved_bytes for n in problem.nodes if n.name not in dropped or is_sent(n))


def prefetched_bytes(problem: StageProblem, assignment: Assignment) -> dict[int, int]:
    """Per microbatch j: bytes recomputed in windows for j (alive from the window to B(j))."""
    size = {n.name: n.saved_bytes for n in problem.nodes}
    out: dict[int, int] = {}
    for (name, mb), _window in assignment.window_of.items():
        out[mb] = out.get(mb, 0) + size.get(name, 0)
    return out


def on_demand_transient_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """Largest per-layer (or edge block) set of on-demand regenerated bytes, any microbatch."""
    best = 0
    for mb in range(problem.microbatches):
        per_group: dict[str, int] = {}
        for n in problem.nodes:
            if n.name in assignment.recompute and (n.name, mb) not in assignment.window_of:
                key = group_key(n)
                per_group[key] = per_group.get(key, 0) + n.saved_bytes
        if per_group:
            best = max(best, max(per_group.values()))
    return best


def _signatures(problem: StageProblem, assignment: Assignment) -> dict[frozenset[str], int]:
    """Distinct sets of prefetched nodes (recomputed in a window, or offloaded and prefetched in
    one), each with its first microbatch."""
    out: dict[frozenset[str], int] = {}
    by_mb: dict[int, set[str]] = {}
    for (name, mb) in assignment.window_of:
        by_mb.setdefault(mb, set()).add(name)
    for (name, mb) in assignment.prefetch_of:
        by_mb.setdefault(mb, set()).add(name)
    for mb in range(problem.microbatches):
        out.setdefault(frozenset(by_mb.get(mb, ())), mb)
    return out


def _arrival_signatures(problem: StageProblem, assignment: Assignment) -> dict[frozenset[tuple[str, int]], int]:
    """Distinct sets of (prefetched node, backward step it is there from), each with its first
    microbatch: step 0 but for recomputation in a tensor-parallel window
    (:func:`~lynx.solvers.memory_microbatch.window_steps`)."""
    out: dict[frozenset[tuple[str, int]], int] = {}
    for mb, arrivals in arrivals_by_microbatch(problem, assignment).items():
        out.setdefault(arrivals, mb)
    return out


def peak_activation_bytes(problem: StageProblem, assignment: Assignment,
                          pending: Sequence[int] | None = None) -> int:
    """others(j) · held + the most microbatch j holds during its backward, the largest over j (see
    above: with backwards in microbatch order, j's backward has at most m − 1 − j others in flight).

    With offloaded nodes, ``pending`` (per group rank: bytes other microbatches' device→host
    copies still hold while that group is backpropagated) defaults to the solvers' bound from
    ``problem.copies`` (:func:`lynx.solvers.offload.pending_by_group`); the simulator passes
    the replay's own."""
    if pending is None and assignment.offload:
        pending = pending_by_group(problem, assignment)
    if problem.actions:   # the device's action list: replayed per chunk and microbatch
        return replay_peak_bytes(problem, assignment, pending)
    held = held_bytes(problem, assignment)
    best = 0
    for pf, mb in _arrival_signatures(problem, assignment).items():
        others = problem.in_flight - 1
        if problem.backward_in_order:
            others = min(others, problem.microbatches - 1 - mb)
        own = microbatch_peak_bytes(problem, assignment, frozenset(name for name, _ in pf), pending, dict(pf))
        best = max(best, others * held + own)
    return max(0, best)


def peak_upper_bound_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """The bound the solvers enforce (see module docstring); never below the prediction."""
    ranks = group_ranks(problem)
    group = {n.name: ranks[group_key(n)] for n in problem.nodes}
    by_name = {n.name: n for n in problem.nodes}
    savers = savers_of(problem)
    kept = kept_bytes(problem, assignment)
    transient = 0
    for pf in _signatures(problem, assignment):
        on_demand = {n.name for n in problem.nodes if n.name in assignment.recompute and n.name not in pf
                     and not is_sent(n)}
        per_group = [0] * len(ranks)
        early = 0
        for n in problem.nodes:
            if n.name not in on_demand:
                continue
            per_group[group[n.name]] += n.saved_bytes
            if max((group[s] for s in savers[n.name]), default=-1) > group[n.name]:
                closure = _group_ancestors(by_name, group, n.name) | {n.name}
                early += sum(by_name[a].saved_bytes for a in closure if a in on_demand)
        transient = max(transient, max(per_group, default=0) + early)
    prefetched = max((sum(by_name[name].saved_bytes for name in pf if not is_sent(by_name[name]))
                      for pf in _signatures(problem, assignment)), default=0)
    # several chunks per device, or deferred weight gradients (lynx.solvers.memory_replay): each
    # chunk's kept bytes times its most microbatches in flight
    chunk_in_flight, held_over, handing = bound_counts(problem)
    if chunk_in_flight:
        dropped = assignment.dropped
        kept_term = sum(chunk_in_flight.get(n.chunk, problem.in_flight) * n.saved_bytes for n in problem.nodes
                        if n.name not in dropped or is_sent(n))
    else:
        kept_term = problem.in_flight * kept
    if handing:
        may_hand = handed_bytes(problem)
        handed = sum(may_hand[n.name] for n in problem.nodes if n.name in assignment.recompute)
    else:
        handed = 0
    return kept_term + (1 + held_over) * prefetched + transient + handing * handed


def _group_ancestors(by_name: dict, group: dict[str, int], name: str) -> set[str]:
    """In-stage ancestors of ``name`` within its own group."""
    g = group[name]
    seen: set[str] = set()
    stack = [name]
    while stack:
        for src in by_name[stack.pop()].inputs:
            if src in by_name and group[src] == g and src not in seen:
                seen.add(src)
                stack.append(src)
    return seen
