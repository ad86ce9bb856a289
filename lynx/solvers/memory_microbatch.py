"""One microbatch's saved bytes during its backward, and what it holds between forward and backward.

The per-microbatch half of the memory model (:mod:`lynx.solvers.memory` has the whole of it
and the rules these follow): :func:`microbatch_peak_bytes` is the most one microbatch holds at
any backward step given what was prefetched for it, :func:`held_bytes` what it holds between
its forward and its backward, :func:`arrivals_by_microbatch` what was prefetched for each
microbatch and from which backward step, :func:`saved_parts` a node's saved bytes split into
its output's storage and the rest. :mod:`lynx.solvers.memory_replay` combines them over a
device's action list.

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=2, in_flight=2)
    >>> keep_all = Assignment(recompute=frozenset())
    >>> everything = sum(n.saved_bytes for n in p.nodes)
    >>> held_bytes(p, keep_all) == microbatch_peak_bytes(p, keep_all, frozenset()) == everything
    True
"""

from __future__ import annotations

from collections.abc import Sequence

from lynx.planner.windows import WindowId
from lynx.solvers.offload import group_layout, issue_steps
from lynx.solvers.problem import Assignment, ProblemNode, StageProblem, is_sent
from lynx.solvers.problem import consumers_of as _consumers

__all__ = ["microbatch_peak_bytes", "held_bytes", "arrivals_by_microbatch", "saved_parts", "window_steps",
           "backward_rows"]

_NEVER = 1 << 60


def arrivals_by_microbatch(problem: StageProblem, assignment: Assignment) -> dict[int, frozenset[tuple[str, int]]]:
    """Per microbatch, its prefetched nodes of ``problem`` (recomputed in a window, or offloaded
    and prefetched in one), each with the backward step it is there from."""
    steps = window_steps(problem)
    index = {n.name: i for i, n in enumerate(problem.nodes)}
    by_window: dict[tuple[int, WindowId], list[str]] = {}
    for (name, mb), window in assignment.window_of.items():
        if name in index:
            by_window.setdefault((mb, window), []).append(name)
    by_mb: dict[int, set[tuple[str, int]]] = {}
    for (mb, window), names in by_window.items():
        at = steps.get(window)
        names.sort(key=index.__getitem__)
        share = -(-len(names) // len(at)) if at else 1
        for k, name in enumerate(names):
            by_mb.setdefault(mb, set()).add((name, at[k // share] if at else 0))
    for (name, mb) in assignment.prefetch_of:
        if name in index:
            by_mb.setdefault(mb, set()).add((name, 0))
    return {mb: frozenset(by_mb.get(mb, ())) for mb in range(problem.microbatches)}


def window_steps(problem: StageProblem) -> dict[WindowId, list[int]]:
    """Backward steps at which a tensor-parallel window's recomputation runs: a window of layer
    ``L`` (eligible: the layers below it) runs right after each of layer ``L``'s backward
    all-reduces, its nodes in forward order split in equal shares over them, the first share
    after the first all-reduce the backward issues (``lynx.rewrite.tp_windows``). A layer whose
    graph does not mark its all-reduces (a graph analysed without a sharding plan: the simulator
    times two per layer, ``lynx.planner.tp_costs.layer_allreduce_s``) has them somewhere in its
    backward: its window's recomputation is counted from the first step of that backward (the
    earliest they can be). Every other window runs before step 0."""
    last = len(problem.nodes) - 1
    steps: dict[int, list[int]] = {}
    first: dict[int, int] = {}   # per layer, the first step of its backward
    for i, n in enumerate(problem.nodes):
        if n.layer is not None:
            first[n.layer] = last - i
            if n.tp_collective:
                steps.setdefault(n.layer, []).append(last - i)
    out: dict[WindowId, list[int]] = {}
    for w in problem.windows:
        if w.kind != "tp_allreduce" or not w.eligible_layers:
            continue
        layer = max(w.eligible_layers) + 1
        if steps.get(layer):
            out[w.id] = sorted(steps[layer])
        elif layer in first and not steps:   # (unmarked: no layer of the stage marks one)
            out[w.id] = [first[layer]]
    return out


def microbatch_peak_bytes(problem: StageProblem, assignment: Assignment, prefetched: frozenset[str],
                          pending: Sequence[int] | None = None, arrival: dict[str, int] | None = None) -> int:
    """Most bytes one microbatch holds at any backward step, given the nodes prefetched for it.

    Each node's saved bytes are two intervals of backward steps (see the module docstring):
    its output's storage, from when it is there (step 0 if kept or prefetched, else when
    first needed) to its last reader; the rest, from then to the node's own step. An
    offloaded node is there from its prefetch's issue (step 0 when prefetched in a window,
    else one group ahead of its read group: :func:`lynx.solvers.offload.issue_steps`);
    ``pending`` adds, per group rank, what other microbatches'
    offload copies still hold while that group is backpropagated; ``arrival``: the step a
    node prefetched in a tensor-parallel window is there from (else 0).
    """
    arrival = arrival or {}
    last, rows = backward_rows(problem)
    dropped = assignment.recompute
    offloaded = assignment.offload
    issue = issue_steps(problem, offloaded) if offloaded else {}
    delta = [0] * (last + 2)

    def hold(first: int, until: int, nbytes: int) -> None:
        if nbytes and first <= until:
            delta[first] += nbytes
            delta[until + 1] -= nbytes

    regenerated: dict[str, int] = {}  # on-demand node -> backward step it is re-run at
    for name, own_step, consumers, saver_steps, unknown, maybe, out_bytes, own_bytes, sent, reread in rows:
        # backward steps reading the output: its savers', and the re-runs of dropped consumers
        reads = list(saver_steps)
        for c in consumers:
            if c in prefetched and c not in offloaded:
                reads.append(0)  # (an invalid plan) a window re-runs it first; a prefetched copy reads nothing
            elif regenerated.get(c, _NEVER) != _NEVER:
                reads.append(regenerated[c])
        if unknown:  # unknown savers: every consumer, perhaps itself
            first_read, last_read = min(min(maybe, default=_NEVER), min(reads, default=_NEVER)), own_step
        else:
            first_read, last_read = min(reads, default=_NEVER), max(reads, default=-1)
        if name in dropped and name not in prefetched:
            at = min(first_read, own_step if own_bytes else _NEVER)
            regenerated[name] = at
        elif name in offloaded and name not in prefetched:
            at = issue[name]
        else:
            at = arrival.get(name, 0)
        if sent:  # the stage holds what it sent until the microbatch's backward ends
            hold(0, last, out_bytes)
            if name in dropped and at != _NEVER and reread:
                hold(at, last_read, out_bytes)  # in-stage readers get a recomputed copy
        elif at != _NEVER:
            hold(at, last_read, out_bytes)
        if at != _NEVER:
            hold(at, own_step, own_bytes)
    if pending:
        for s_, g in enumerate(group_layout(problem).group_of_step):
            extra = pending[g] if g < len(pending) else 0
            hold(s_, s_, extra)
    live = best = 0
    for change in delta[:-1]:
        live += change
        best = max(best, live)
    return best


_STATIC: dict[int, tuple[tuple, tuple[int, tuple]]] = {}
_SHAPES: dict[tuple, tuple] = {}


def backward_rows(problem: StageProblem) -> tuple[int, tuple]:
    """What :func:`microbatch_peak_bytes` (and a split backward's model,
    :func:`lynx.solvers.memory_weights.part_rise_bytes`) reads of the nodes alone, consumers before producers:
    the last backward step, and per node its name, backward step, consumers, savers' steps (a
    known saved output), whether its savers are unknown and then the steps that may read it,
    its output's and its other saved bytes, whether it is sent and then whether in-stage
    readers reread it. Cached per node tuple (a solver replays one stage's plans many times),
    and the part that is not bytes per graph shape (HEU with offload plans the stage again
    with the offloaded values' bytes zeroed: :mod:`lynx.solvers.heu.offload`)."""
    key = id(problem.nodes)
    found = _STATIC.get(key)
    if found is not None and found[0] is problem.nodes:
        return found[1]
    nodes = problem.nodes
    last = len(nodes) - 1
    # (is_sent and the readers depend on these alone; the bytes are read below)
    shape = tuple((n.name, n.inputs, n.saved_by, n.output_saved, n.sent) for n in nodes)
    structure = _SHAPES.get(shape)
    if structure is None:
        step = {n.name: last - i for i, n in enumerate(nodes)}
        consumers = _consumers(problem)
        rows = []
        for n in reversed(nodes):
            unknown = n.output_saved and n.saved_by is None
            savers = (tuple(step[s] for s in n.saved_by if s in step)
                      if n.output_saved and n.saved_by is not None else ())
            maybe = tuple(step[c] for c in consumers[n.name]) if unknown else ()
            rows.append((n.name, step[n.name], tuple(consumers[n.name]), savers, unknown, maybe, is_sent(n),
                         n.saved_by is None or bool(n.saved_by)))
        if len(_SHAPES) > 64:
            _SHAPES.clear()
        structure = _SHAPES[shape] = tuple(rows)
    table = []
    for n, (name, own_step, consumers_, savers, unknown, maybe, sent, reread) in zip(reversed(nodes), structure):
        out_bytes, own_bytes = saved_parts(n)
        if unknown and n.saved_bytes:
            maybe = (*maybe, own_step)
        table.append((name, own_step, consumers_, savers, unknown, maybe, out_bytes, own_bytes, sent, reread))
    if len(_STATIC) > 256:
        _STATIC.clear()
    _STATIC[key] = (nodes, (last, tuple(table)))
    return last, tuple(table)


def saved_parts(node: ProblemNode) -> tuple[int, int]:
    """(bytes of the saved output, the rest); unknown: all of it is the rest, or, for a value
    only a later stage saves, the output."""
    if node.output_bytes is None:
        return (node.saved_bytes, 0) if is_sent(node) else (0, node.saved_bytes)
    out = min(node.output_bytes, node.saved_bytes) if node.output_saved else 0
    return out, node.saved_bytes - out


def held_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """Bytes one microbatch holds between its forward and its backward: what it keeps, and
    of a dropped node whose output only a later stage saves, that output (it was sent)."""
    dropped = assignment.dropped
    return sum(n.saved_bytes if n.name not in dropped else saved_parts(n)[0] if is_sent(n) else 0
               for n in problem.nodes)
