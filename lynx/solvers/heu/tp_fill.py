"""HEU's last pass on a stage with tensor-parallel windows: move on-demand recompute into them.

HEU's books bound memory linearly (``in_flight · kept + max_c P_c + max_{c,g} T_{c,g}``): a
value recomputed in a window counts from the backward's start on top of the largest group
regenerated on demand. A ``tp_allreduce`` window of layer ``L`` runs inside ``L``'s backward,
after its all-reduces, and what it brings back for the layer below replaces part of that
layer's on-demand regeneration, so the exact model (:func:`~lynx.solvers.memory.peak_activation_bytes`)
often has room where the books have none — at the tightest budgets (level 0.0 of the grid)
the books place nothing there. :func:`fill_tp_windows` takes each such window in time order
and moves into it the longest prefix, in forward order, of the layer below's on-demand nodes
for its microbatch that starts within its capacity and whose inputs are there by then (kept, placed in
a window already, prefetched in a window, or streamed in before it:
:func:`~lynx.solvers.offload.streamed_before`), keeping a move only where the exact peak stays
within the budget and the plan stays valid.

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=2, microbatches=2, in_flight=1)
    >>> a = Assignment(frozenset())
    >>> fill_tp_windows(p, a) is a   # no tensor-parallel windows: nothing to move
    True
"""

from __future__ import annotations

from lynx.errors import LynxPlanError
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.memory_microbatch import arrivals_by_microbatch, held_bytes, microbatch_peak_bytes
from lynx.solvers.offload import pending_by_group, streamed_before, total_exposed_s
from lynx.solvers.problem import Assignment, ProblemNode, ProblemWindow, StageProblem, microbatch_classes
from lynx.solvers.validate import validate

__all__ = ["fill_tp_windows"]


def fill_tp_windows(problem: StageProblem, assignment: Assignment) -> Assignment:
    """``assignment`` with on-demand recompute moved into tensor-parallel windows (see the
    module docstring); the same object when nothing moves or nothing it tried exposes less.
    Decided once per microbatch class (its members' windows are alike), so the exact peak
    replays as few microbatch signatures as before."""
    if not assignment.recompute or not any(w.kind == "tp_allreduce" for w in problem.windows):
        return assignment
    by_layer: dict[int, list[ProblemNode]] = {}
    for n in problem.nodes:
        if n.layer is not None and n.name in assignment.recompute:
            by_layer.setdefault(n.layer, []).append(n)
    consumers: dict[str, list[ProblemNode]] = {n.name: [] for n in problem.nodes}
    for n in problem.nodes:
        for src in n.inputs:
            if src in consumers:
                consumers[src].append(n)
    known = {n.name for n in problem.nodes}
    seconds = {n.name: n.recompute_s for n in problem.nodes}
    windows = {w.id: w for w in problem.windows}
    used: dict = {}
    for (name, _mb), wid in assignment.window_of.items():
        used[wid] = used.get(wid, 0.0) + seconds[name]
    budget = problem.activation_budget_bytes
    peak = _Peak(problem, assignment)
    current = assignment
    for cls in microbatch_classes(problem):
        for k, layers in enumerate(cls.eligible_layers):
            w = windows[cls.window_ids[k][0]]
            if w.kind != "tp_allreduce" or not layers or cls.capacities[k] <= 0:
                continue
            moves, cuts = _movable(problem, current, w, by_layer.get(max(layers), ()), consumers, known,
                                   cls.capacities[k] - used.get(w.id, 0.0))
            if not moves:
                continue
            members = [(mb, cls.window_ids[k][i]) for i, mb in enumerate(cls.members)
                       if all((n, mb) not in current.window_of for n in moves)]
            # the longest prefix that fits (bisection over where it may end: each try replays the peak)
            lo, hi, best = 0, len(cuts) - 1, None
            while lo <= hi:
                mid = (lo + hi) // 2
                cut = cuts[mid]
                placed = dict(current.window_of)
                placed.update({(n, mb): wid for mb, wid in members for n in moves[:cut]})
                trial = Assignment(current.recompute, placed, current.offload, current.prefetch_of)
                if peak(trial) <= budget:
                    best, lo = (cut, trial), mid + 1
                else:
                    hi = mid - 1
            if best is not None:
                current = best[1]
                for _mb, wid in members:
                    used[wid] = used.get(wid, 0.0) + sum(seconds[n] for n in moves[:best[0]])
    if current is assignment:
        return assignment
    try:
        validate(problem, current)
    except LynxPlanError:
        return assignment
    if peak_activation_bytes(problem, current) > budget:   # (the device's replay, where it differs)
        return assignment
    if total_exposed_s(problem, current) >= total_exposed_s(problem, assignment) - 1e-12:
        return assignment
    return current


class _Peak:
    """The closed-form peak (:func:`~lynx.solvers.memory.peak_activation_bytes` without the
    action list: one chunk, backwards in order) of assignments that differ from ``base`` only
    in their window placements: what a microbatch holds between its forward and backward, and
    the copies pending, stay put, so each microbatch signature's own peak is computed once."""

    def __init__(self, problem: StageProblem, base: Assignment) -> None:
        self.problem = problem
        self.held = held_bytes(problem, base)
        self.pending = pending_by_group(problem, base) if base.offload else None
        self.own: dict[frozenset, int] = {}

    def __call__(self, assignment: Assignment) -> int:
        problem = self.problem
        best = 0
        seen: set[tuple[frozenset, int]] = set()
        for mb, arrivals in arrivals_by_microbatch(problem, assignment).items():
            others = problem.in_flight - 1
            if problem.backward_in_order:
                others = min(others, problem.microbatches - 1 - mb)
            if (arrivals, others) in seen:
                continue
            seen.add((arrivals, others))
            own = self.own.get(arrivals)
            if own is None:
                own = self.own[arrivals] = microbatch_peak_bytes(problem, assignment, frozenset(n for n, _ in arrivals),
                                                                 self.pending, dict(arrivals))
            best = max(best, others * self.held + own)
        return max(0, best)


def _movable(problem: StageProblem, assignment: Assignment, window: ProblemWindow, nodes, consumers: dict,
             known: set[str], room: float) -> tuple[list[str], list[int]]:
    """The layer's on-demand nodes for the window's microbatch that may move into it, in
    forward order, while ``room`` seconds last (then on to the next place a prefix may end:
    an overflow is exposed, as on demand, but the rest is hidden) — each input there by then,
    no consumer of a later group regenerating from it on demand (that runs before the
    window) — and the prefix lengths that may be taken: none leaves a value without a saved
    output to an on-demand consumer (it lives only with its readers)."""
    mb = window.microbatch
    placed = assignment.window_of
    out: list[str] = []
    cuts: list[int] = []
    taken: set[str] = set()
    open_values: set[str] = set()   # taken, no saved output, an on-demand consumer not taken yet
    spent = 0.0
    for n in nodes:
        if (n.name, mb) in placed:
            continue
        if spent >= room - 1e-15 and not open_values:
            break   # (full, and the prefix may end here)
        ok = True
        for src in n.inputs:
            if src not in known:
                continue
            if src in assignment.offload:
                ok = (src, mb) in assignment.prefetch_of or streamed_before(problem, src, window.id)
            elif src in assignment.recompute:
                ok = src in taken or (src, mb) in placed
            if not ok:
                break
        if ok:
            for c in consumers[n.name]:
                if c.name in assignment.recompute and (c.name, mb) not in placed and c.layer != n.layer:
                    ok = False   # (a consumer regenerated on demand in another group reads it there)
                    break
        if not ok:
            break   # (a prefix: what follows may read it)
        out.append(n.name)
        taken.add(n.name)
        spent += n.recompute_s
        open_values.discard(n.name)
        open_values -= {src for src in open_values
                        if all(c.name in taken or c.name not in assignment.recompute or (c.name, mb) in placed
                               for c in consumers[src])}
        if not n.output_saved and any(c.name in assignment.recompute and (c.name, mb) not in placed
                                      for c in consumers[n.name]):
            open_values.add(n.name)
        if not open_values:
            cuts.append(len(out))
    return out[:cuts[-1]] if cuts else [], cuts
