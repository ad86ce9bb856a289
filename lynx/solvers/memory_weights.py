"""Zero bubble: what a microbatch holds for its deferred weight-gradient part ``W``.

A zero-bubble chunk's backward is two generated graphs (:mod:`lynx.rewrite.emit`): the
input-gradient part ``I`` regenerates each dropped value it reads (and the dropped inputs of
what it re-runs) just before its first reader; the weight-gradient part ``W`` runs later, from
the microbatch's slots and the values ``I`` regenerated that ``W``'s own backward nodes read —
``I`` hands those over (*cross values*), and the stage holds them, with everything the
microbatch kept, until ``W`` has run (the runtime's meter: ``StageModule.backward_weight``).
``W`` regenerates whatever else it reads. (``I`` brings back only the pieces it needs: a node it
re-runs for its statistics alone hands no output over.) Which part reads which saved value is the node's
``output_reads`` / ``rest_reads`` (:mod:`lynx.frontend.joint_weights`; unknown: both).

* :func:`weight_held_bytes`: from ``I``'s end to ``W``'s, per microbatch: what it held after
  its forward (:func:`~lynx.solvers.memory_microbatch.held_bytes`), what was prefetched for it, and the
  cross values;
* :func:`weight_peak_bytes`: while ``W`` runs: that, plus how far ``W``'s own regeneration
  rises above what it starts from (:func:`part_rise_bytes`, step by step as the generated
  graphs run; :func:`split_backward_bound_bytes`: group by group, what HEU's books count).

Which part may regenerate what whatever the plan (``handed_bytes``, ``regenerating_parts``,
``rerun_counts``, importable here too): :mod:`lynx.solvers.memory_regen`.

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=2, in_flight=2)
    >>> keep_all = Assignment(recompute=frozenset())
    >>> weight_held_bytes(p, keep_all, frozenset()) == sum(n.saved_bytes for n in p.nodes)
    True
"""

from __future__ import annotations

from lynx.solvers.memory_microbatch import backward_rows, held_bytes, microbatch_peak_bytes, saved_parts
from lynx.solvers.memory_regen import (BOTH, handed_bytes, reads_input, regenerating_parts, rerun_counts,
                                       starts_input_regeneration, weight_read_bytes)
from lynx.solvers.problem import (Assignment, ProblemNode, StageProblem, consumers_of, group_key, group_ranks,
                                  is_sent)

__all__ = ["weight_held_bytes", "weight_peak_bytes", "input_peak_bytes", "weight_read_bytes", "split_backward_bytes",
           "handed_bytes", "regenerating_parts", "regenerated_nodes", "rerun_counts", "starts_input_regeneration",
           "part_rise_bytes", "split_backward_bound_bytes"]

_NEVER = 1 << 60   # a step no backward reaches


def regenerated_nodes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                      ) -> tuple[frozenset[str], frozenset[str]]:
    """The dropped nodes ``I`` re-runs for one microbatch, and those ``W`` re-runs (``prefetched``:
    those recomputed in windows for it), as :func:`part_rise_bytes` walks the generated graphs: what
    each part's on-demand recomputation costs (:func:`lynx.planner.problems.loads_from_assignments`).
    A node can be in both — ``W`` re-runs what it needs that ``I`` re-ran but did not hand over:
    a value ``I`` needed only to re-run a consumer whose output ``W`` reads (a GELU's input, say,
    re-run for the GELU ``W`` reads), or a node ``I`` re-ran for its statistics alone — so it
    costs twice. In a chunk whose ``I`` reads nothing ``W`` is the whole backward and re-runs
    all of it — in the first chunk whatever the reads say (nothing before it waits for an input
    gradient: the timeline's ``weight_s``).

    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=1, microbatches=2, in_flight=1)
    >>> regenerated_nodes(p, Assignment(recompute=frozenset()), frozenset())
    (frozenset(), frozenset())
    """
    on_demand = assignment.recompute - prefetched
    _, _, _, in_i, in_w = _walk_parts(problem, assignment, prefetched)
    if not any(reads_input(n) for n in problem.nodes) or all(n.chunk == 0 for n in problem.nodes):
        return frozenset(), (in_i | in_w) & on_demand
    return in_i & on_demand, in_w & on_demand


def _regenerated(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                 ) -> tuple[set[str], set[str]]:
    """The dropped nodes ``I`` regenerates, and those ``W`` regenerates (each re-run also brings
    back its dropped inputs, unless handed over; a view, its storage's producer's output)."""
    dropped = assignment.recompute
    consumers = consumers_of(problem)
    in_i: set[str] = set()
    in_w: set[str] = set()
    for n in reversed(problem.nodes):   # consumers before producers
        if (n.name not in dropped and n.view_of is None) or n.name in prefetched:
            continue
        out, rest = n.output_reads or BOTH, n.rest_reads or BOTH
        if out[0] or rest[0] or any(c in in_i for c in consumers[n.name]):
            in_i.add(n.name)
        handed = n.name in in_i and out[1]
        if ((out[1] or rest[1]) and n.name not in in_i) or (not handed and any(c in in_w for c in consumers[n.name])):
            in_w.add(n.name)
    return in_i, in_w


def weight_held_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]) -> int:
    """Bytes one microbatch holds from its ``I``'s end to its ``W``'s (``prefetched``: the nodes
    recomputed in windows for it)."""
    return split_backward_bytes(problem, assignment, prefetched)[1]


def weight_peak_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]) -> int:
    """The most one microbatch holds while its ``W`` runs."""
    return split_backward_bytes(problem, assignment, prefetched)[2]


def input_peak_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]) -> int:
    """The most one microbatch holds while its ``I`` runs."""
    return split_backward_bytes(problem, assignment, prefetched)[0]


def split_backward_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                         ) -> tuple[int, int, int]:
    """(most held during ``I``, held from ``I``'s end to ``W``'s, most held during ``W``).

    The meter (:class:`~lynx.rewrite.stage.StageModule`) counts the microbatch's kept values
    until ``W`` ends and, above them, how far each generated graph's live values rise over its
    inputs (:func:`lynx.rewrite.liveness.extra_peak_bytes`), with the values ``I`` hands over
    from ``I``'s end to ``W``'s; each rise is :func:`part_rise_bytes`."""
    held = sum(sum(_inputs(n, assignment.dropped, prefetched)) for n in problem.nodes)
    if not any(reads_input(n) for n in problem.nodes):
        # the chunk sends no input gradient (the first): I is empty and W the whole backward
        return held, held, microbatch_peak_bytes(problem, assignment, prefetched)
    rise_i, cross, rise_w = part_rise_bytes(problem, assignment, prefetched)
    return held + rise_i, held + cross, held + cross + rise_w


def part_rise_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                    ) -> tuple[int, int, int]:
    """How far ``I``'s live values rise above its inputs, what ``I`` hands ``W``, and how far
    ``W``'s live values rise above its inputs (those handed over among them): the generated
    graphs' ``extra_peak_bytes`` and ``cross_bytes`` (:func:`lynx.rewrite.liveness.extra_peak_bytes`),
    from the rows :func:`~lynx.solvers.memory_microbatch.microbatch_peak_bytes` reads
    (:func:`~lynx.solvers.memory_microbatch.backward_rows`).

    What the graphs do (:func:`lynx.rewrite.emit_backward.build_backward`): a part reads a
    value's saved output and rest where ``output_reads`` / ``rest_reads`` say; before a backward
    step it re-runs, in forward order, each dropped node the step needs — what the step reads,
    and the inputs of what it re-runs — bringing back only the pieces needed (the output for a
    reader or a consumer, the rest for the node's own step; an unknown split: all of it). Each
    value is freed after its last reader, a step or a re-run, except what ``I`` brought back
    that ``W`` reads: ``I`` returns it (held to ``I``'s end) and ``W`` starts from it; ``W``
    re-runs whatever else it needs. Kept values are inputs — of ``I`` all of them (freed at
    once where it does not read them), of ``W`` those it reads — except a value sent to the
    next stage (the stage holds it whatever the graphs do). A view is its storage's producer's
    output: a part needing it needs that output, whether the plan drops the view."""
    return _walk_parts(problem, assignment, prefetched)[:3]


def _walk_parts(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                ) -> tuple[int, int, int, frozenset[str], frozenset[str]]:
    """:func:`part_rise_bytes`, and the nodes each part re-runs (:func:`regenerated_nodes`)."""
    last, rows = backward_rows(problem)
    nodes = problem.nodes
    index = {n.name: i for i, n in enumerate(nodes)}
    # a time: step · k + the re-run's forward index, or + len(nodes) for the step's own reads
    k = len(nodes) + 1
    end = last * k + len(nodes)
    on_demand = assignment.recompute - prefetched
    dropped = assignment.dropped
    handed_out: set[str] = set()
    handed_rest: set[str] = set()
    rises = []
    reruns: list[frozenset[str]] = []
    cross = 0
    for part in (0, 1):
        events: dict[int, int] = {}
        initial = 0
        regen: dict[str, int] = {}   # the time a node is re-run at

        def hold(first: int, until: int, nbytes: int, is_input: bool = False) -> None:
            nonlocal initial
            if is_input and (part == 0 or first <= until):   # I takes every kept value, W what it reads
                initial += nbytes
            if nbytes and first <= until:
                events[first] = events.get(first, 0) + nbytes
                events[until + 1] = events.get(until + 1, 0) - nbytes

        for n, (name, own_step, consumers, savers, unknown, maybe, out_bytes, own_bytes, sent, reread) in zip(
                reversed(nodes), rows):
            out_read, rest_read = (n.output_reads or BOTH)[part], (n.rest_reads or BOTH)[part]
            reads = ([s_ * k + len(nodes) for s_ in savers] if out_read else []) + [
                regen[c] for c in consumers if c in regen]
            if unknown:
                first_read = min(min(maybe, default=_NEVER) * k + len(nodes) if out_read else _NEVER,
                                 min(reads, default=_NEVER))
                last_read = own_step * k + len(nodes) if first_read != _NEVER else -1
            else:
                first_read, last_read = min(reads, default=_NEVER), max(reads, default=-1)
            need_out = first_read != _NEVER
            need_rest = rest_read and own_bytes > 0
            own_end = own_step * k + len(nodes)
            if name not in on_demand and n.view_of is None:   # (a view reads its storage's producer)
                if not (sent and name not in dropped):
                    hold(0, last_read if need_out else -1, out_bytes, True)
                hold(0, own_end if need_rest else -1, own_bytes, True)
                continue
            if sent and not reread:
                out_bytes = 0   # the stage holds what it sent; in-stage readers have none to re-run
            all_rest = n.output_bytes is None   # an unknown split: a re-run brings back all of it
            if part == 1:   # what I handed over is an input; W re-runs the node for the rest
                if need_out and (name in handed_out or all_rest and name in handed_rest):
                    hold(0, last_read, out_bytes, True)
                    need_out = False
                if need_rest and name in handed_rest:
                    hold(0, own_end, own_bytes, True)
                    need_rest = False
            if not (need_out or need_rest):
                continue
            at = min(first_read if need_out else _NEVER, own_end if need_rest else _NEVER) // k * k + index[name]
            regen[name] = at
            out_until = last_read if need_out else -1
            rest_until = own_end if need_rest else max(at, out_until) if all_rest else -1
            if part == 0:
                out_w, rest_w = (n.output_reads or BOTH)[1], (n.rest_reads or BOTH)[1]
                if need_out and out_w and out_bytes:
                    handed_out.add(name)
                    cross += out_bytes
                    out_until = end
                if rest_until >= 0 and rest_w and own_bytes:
                    handed_rest.add(name)
                    cross += own_bytes
                    rest_until = end
            if need_out:
                hold(at, out_until, out_bytes)
            hold(at, rest_until, own_bytes)
        live, best = 0, initial   # (an input nobody reads is freed before the first step)
        for t in sorted(events):
            live += events[t]
            best = max(best, live)
        rises.append(best - initial)
        reruns.append(frozenset(regen))
    return rises[0], cross, rises[1], reruns[0], reruns[1]


def split_backward_bound_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str]
                         ) -> tuple[int, int, int]:
    """:func:`split_backward_bytes` group by group, never less: what HEU's books count
    (:mod:`lynx.solvers.heu.ondemand`, linear in what is dropped).

    Each part runs its groups (layers, edge blocks) in backward order, regenerating all of a
    group's values it may need (its own and, for a consumer it re-runs, their inputs) just before
    the group and freeing what the group read after it — never later than the generated graphs,
    which regenerate each value before its first reader and free it after its last. ``I`` hands
    ``W`` all that ``W`` reads of what it regenerated (a superset of the pieces it brings back)."""
    dropped = assignment.dropped
    if not any(reads_input(n) for n in problem.nodes):
        # the chunk sends no input gradient (the first): I is empty and W the whole backward
        held = held_bytes(problem, assignment) + sum(n.saved_bytes for n in problem.nodes if n.name in prefetched)
        return held, held, microbatch_peak_bytes(problem, assignment, prefetched)
    ranks = group_ranks(problem)
    in_i, in_w = _regenerated(problem, assignment, prefetched)
    by_group: dict[int, list[ProblemNode]] = {}
    for n in problem.nodes:
        by_group.setdefault(ranks[group_key(n)], []).append(n)
    order = sorted(by_group, reverse=True)

    def inputs(n: ProblemNode) -> tuple[int, int]:   # (output, rest) bytes the microbatch holds of n
        out_bytes, rest_bytes = saved_parts(n)
        if n.name not in dropped or n.name in prefetched:
            return out_bytes, rest_bytes
        return (out_bytes, 0) if is_sent(n) else (0, 0)

    def read(n: ProblemNode, part: int) -> int:   # held bytes of n the part (0: I, 1: W) reads
        out_bytes, rest_bytes = inputs(n)
        out_read, rest_read = (n.output_reads or BOTH)[part], (n.rest_reads or BOTH)[part]
        return (out_bytes if out_read else 0) + (rest_bytes if rest_read else 0)

    held = sum(sum(inputs(n)) for n in problem.nodes)
    cross = sum(weight_read_bytes(n) for n in problem.nodes if n.name in in_i)
    live = sum(read(n, 0) for n in problem.nodes)   # the rest is read by W only: dropped by I at once
    peak = held
    for g in order:
        peak = max(peak, live + sum(n.saved_bytes for n in by_group[g] if n.name in in_i))
        live += sum(weight_read_bytes(n) - read(n, 0) if n.name in in_i else -read(n, 0) for n in by_group[g])
    during_i = peak
    initial = live = sum(read(n, 1) for n in problem.nodes) + cross
    peak = initial
    for g in order:
        peak = max(peak, live + sum(n.saved_bytes for n in by_group[g] if n.name in in_w))
        live -= sum(read(n, 1) + (weight_read_bytes(n) if n.name in in_i else 0) for n in by_group[g])
    return during_i, held + cross, held + cross + peak - initial


def _inputs(n: ProblemNode, dropped: frozenset[str], prefetched: frozenset[str]) -> tuple[int, int]:
    """(output, rest) bytes of ``n`` the microbatch holds when its backward starts."""
    out_bytes, rest_bytes = saved_parts(n)
    if n.name not in dropped or n.name in prefetched:
        return out_bytes, rest_bytes
    return (out_bytes, 0) if is_sent(n) else (0, 0)
