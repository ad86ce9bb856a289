"""HEU's last pass: spend the memory the exact peak leaves unused on keeping on-demand recompute.

HEU plans against linear books (``in_flight · kept + prefetched + the largest on-demand
group``, :func:`~lynx.solvers.memory.peak_upper_bound_bytes`), and with offload against the
budget less what offloading can add to a backward at most
(:func:`~lynx.solvers.offload.offload_overhead`): both conservative, so its final plans often
peak well below the budget by the exact model
(:func:`~lynx.solvers.memory.peak_activation_bytes`) while still recomputing on demand
(gpt-1.3b, a100-80g, pp 8, level 0.0: stage 6 peaks at 1416 of 1640 MiB and exposes a
layer's whole attention core). :func:`exact_fill` keeps, greedily, the on-demand node that
saves the most exposed seconds per byte it adds: it stops recomputing the node and the
recomputed ancestors that save nothing (``saved_bytes == 0``) that only it needed — keeping a
softmax output spares re-running the zero-byte scores, scale and mask before it. A move is
kept only where its exact peak stays within the budget (with at least one
group's copy to the host still pending: :func:`_pending_floor`) and its exposure
(:func:`~lynx.solvers.offload.total_exposed_s`) drops, and the filled plan only where it stays
valid; offload decisions and the host bytes are untouched.

Candidates are filtered first by a cheap necessary condition (keeping ``b`` more bytes per
microbatch adds at least ``b`` to every microbatch in flight's held bytes: ``in_flight ·
(held + b)`` must fit), so a stage with no room replays the peak once; and once a move of
``b`` bytes does not fit, none of ``b`` bytes or more is tried (each try replays the peak:
without that, gpt-20b's cold plan at level 0.0 took 3× the CPU time).

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=2, in_flight=1, budget_fraction=1.0)
    >>> a = Assignment(frozenset({"l0.softmax", "l0.scores"}))
    >>> exact_fill(p, a).recompute    # everything fits: nothing needs recomputing
    frozenset()
"""

from __future__ import annotations

from lynx.errors import LynxPlanError
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.memory_microbatch import held_bytes
from lynx.solvers.offload import offloaded_by_group, pending_by_group, total_exposed_s
from lynx.solvers.problem import Assignment, ProblemNode, StageProblem, consumers_of, is_sent
from lynx.solvers.validate import validate

__all__ = ["exact_fill", "keep_move"]


def exact_fill(problem: StageProblem, assignment: Assignment) -> Assignment:
    """``assignment`` with on-demand recompute kept while the exact peak leaves room (see the
    module docstring); the same object when no move fits or none exposes less."""
    if not assignment.recompute:
        return assignment
    budget = problem.activation_budget_bytes
    by_name = {n.name: n for n in problem.nodes}
    consumers = consumers_of(problem)
    room = budget // max(1, problem.in_flight) - held_bytes(problem, assignment)
    moves = []
    for i, n in enumerate(problem.nodes):
        if (n.name in assignment.recompute and 0 < n.saved_bytes <= room and not is_sent(n)
                and (n.output_saved or not any(c in assignment.recompute for c in consumers[n.name]))
                and _on_demand(problem, assignment, n.name)):
            removed = keep_move(assignment.recompute, n.name, by_name, consumers)
            gain = sum(by_name[r].recompute_s for r in removed)
            if gain > 0:
                moves.append((-gain / n.saved_bytes, -gain, i, n.name))
    pending = _pending_floor(problem, assignment)
    if not moves or peak_activation_bytes(problem, assignment, pending) >= budget:
        return assignment   # (the peak replayed only where the cheap condition leaves a move)
    moves.sort()
    current, exposed = assignment, total_exposed_s(problem, assignment)
    too_big = room + 1   # (the fewest bytes a move that did not fit added: the room only shrinks)
    for _, _, _, name in moves:
        nbytes = by_name[name].saved_bytes
        if name not in current.recompute or nbytes > room or nbytes >= too_big:
            continue
        removed = keep_move(current.recompute, name, by_name, consumers)
        recompute = current.recompute - removed
        trial = Assignment(recompute, {k: w for k, w in current.window_of.items() if k[0] in recompute},
                           current.offload, current.prefetch_of)
        if peak_activation_bytes(problem, trial, pending) > budget:
            too_big = nbytes
            continue
        trial_exposed = total_exposed_s(problem, trial)
        if trial_exposed >= exposed - 1e-12:
            continue
        current, exposed, room = trial, trial_exposed, room - nbytes
    if current is not assignment:   # (checked once: a keep move only stops recomputing)
        try:
            validate(problem, current)
        except LynxPlanError:
            return assignment
    return current


def keep_move(recompute: frozenset[str], name: str, by_name: dict[str, ProblemNode],
              consumers: dict[str, list[str]]) -> frozenset[str]:
    """What keeping recomputed ``name`` stops recomputing: itself, and (transitively) its
    recomputed in-stage inputs that save nothing and that no node still recomputed reads.

    >>> from lynx.solvers.problem import consumers_of
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=1, microbatches=1, in_flight=1, views=True)
    >>> by_name = {n.name: n for n in p.nodes}
    >>> rec = frozenset(n.name for n in p.nodes)
    >>> sorted(keep_move(rec, "l0.softmax", by_name, consumers_of(p)))   # (v_t still reads qkv_view)
    ['l0.causal_mask', 'l0.k_t', 'l0.q_t', 'l0.scale', 'l0.scores', 'l0.softmax']
    """
    removed = {name}
    stack = [name]
    while stack:
        for src in by_name[stack.pop()].inputs:
            node = by_name.get(src)
            if (node is None or src in removed or src not in recompute or node.saved_bytes > 0
                    or any(c in recompute and c not in removed for c in consumers[src])):
                continue
            removed.add(src)
            stack.append(src)
    return frozenset(removed)


def _pending_floor(problem: StageProblem, assignment: Assignment) -> list[int] | None:
    """The pending copies the fill's peaks count: the solvers' bound
    (:func:`~lynx.solvers.offload.pending_by_group`), but at least one group's copy to the host
    in service at every group. That bound comes from the previous round's timeline: a plan at
    the budget to the byte can be over it in the replay (gpt-2.7b, a100-80g, pp 4 × tp 2,
    level 0.0, first round: stage 0 bound 0, the replay 35 MiB at the backward's start —
    a 25 MiB overshoot that turned offload off for the run)."""
    copies = problem.copies
    if copies is None or copies.synchronous or not assignment.offload:
        return None
    per_group = offloaded_by_group(problem, assignment.offload)
    bound = pending_by_group(problem, assignment) or [0] * len(per_group)
    return [max(b, max(per_group)) for b in bound]


def _on_demand(problem: StageProblem, assignment: Assignment, name: str) -> bool:
    """Whether some microbatch recomputes ``name`` on demand."""
    return any((name, mb) not in assignment.window_of for mb in range(problem.microbatches))
