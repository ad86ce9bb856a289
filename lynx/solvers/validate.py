"""Validity of an assignment: what a plan may recompute, where, and in which order.

:func:`validate` raises :class:`~lynx.errors.LynxPlanError` naming the first rule an
assignment breaks (unknown nodes or windows, a window serving another microbatch or not
eligible for the node's layer, an input regenerated after its consumer — a ``tp_allreduce``
window of layer ``L`` runs inside ``L``'s backward, after the on-demand regeneration of ``L``
and the layers above it —, an output no byte count covers, ``output_saved=False``, left
from one window to a reader recomputed elsewhere);
:func:`required_recompute_closure` adds the inputs that must be recomputed with a node
because they do not keep their output. See :mod:`lynx.solvers.problem` for the conventions.

Example::

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = make_uniform_problem(layers=1, microbatches=1, in_flight=1)
    >>> sorted(required_recompute_closure(p, {"l0.drop1"}))
    ['l0.drop1', 'l0.proj']
    >>> validate(p, Assignment(frozenset({"l0.drop1", "l0.proj"})))
"""

from __future__ import annotations

from lynx.errors import LynxPlanError
from lynx.solvers.offload import streamed_before
from lynx.solvers.problem import (Assignment, ProblemNode, ProblemWindow, StageProblem, group_key, group_ranks,
                                  is_sent)

__all__ = ["validate", "required_recompute_closure", "uncounted_output"]


def required_recompute_closure(problem: StageProblem, recompute: frozenset[str] | set[str]) -> frozenset[str]:
    """Smallest superset of ``recompute`` in which every recomputed node's inputs are available.

    An in-stage input that is kept but does not keep its output (``output_saved=False``)
    cannot feed a recomputation, so it is recomputed too, transitively.
    """
    by_name = {n.name: n for n in problem.nodes}
    closed = set(recompute)
    stack = list(closed)
    while stack:
        node = by_name.get(stack.pop())
        if node is None:
            continue
        for src in node.inputs:
            producer = by_name.get(src)
            if producer is not None and not producer.output_saved and src not in closed:
                closed.add(src)
                stack.append(src)
    return frozenset(closed)


def validate(problem: StageProblem, assignment: Assignment) -> None:
    """Raise LynxPlanError naming the first rule the assignment breaks (see PROBLEM_SPEC)."""
    by_name = {n.name: n for n in problem.nodes}
    windows = {w.id: (i, w) for i, w in enumerate(problem.windows)}
    where = f"stage {problem.stage}"
    unknown = sorted(assignment.recompute - by_name.keys())
    if unknown:
        raise LynxPlanError(f"{where}: recompute names nodes not in the stage: {unknown[:5]}")
    if assignment.offload or assignment.prefetch_of:
        _validate_offload(problem, assignment, by_name, windows)
    for (name, mb), wid in assignment.window_of.items():
        if name not in assignment.recompute:
            raise LynxPlanError(f"{where}: node {name!r} is placed in window {wid!r} but is not recomputed")
        if not 0 <= mb < problem.microbatches:
            raise LynxPlanError(f"{where}: node {name!r} placed for microbatch {mb}, stage has {problem.microbatches}")
        if wid not in windows:
            raise LynxPlanError(f"{where}: node {name!r} (microbatch {mb}) placed in unknown window {wid!r}")
        _, window = windows[wid]
        if window.microbatch != mb:
            raise LynxPlanError(
                f"{where}: node {name!r} recomputed for microbatch {mb} in window {wid!r}, "
                f"which serves microbatch {window.microbatch}"
            )
        if not _eligible(by_name[name], window):
            raise LynxPlanError(
                f"{where}: node {name!r} (layer {by_name[name].layer}) is not eligible for window {wid!r} "
                f"(eligible layers {window.eligible_layers})"
            )
    ranks = group_ranks(problem)
    placed = assignment.window_of
    order: dict[str, list[tuple[int, ...]]] = {}  # node -> per microbatch, when it is regenerated
    at = {wid: _window_time(w, i, ranks) for wid, (i, w) in windows.items()}
    total = sum(n.recompute_s for n in problem.nodes)

    def when(node: ProblemNode) -> list[tuple[int, ...]]:
        # windows (0, 0, 0, index) precede on-demand (1, -rank, 0, 0): later groups regenerate
        # first; a TP window of layer L (1, -rank(L), 1, index) runs after L's own regeneration
        got = order.get(node.name)
        if got is None:
            on_demand = (1, -ranks[group_key(node)], 0, 0)
            got = order[node.name] = [
                on_demand if (w := placed.get((node.name, mb))) is None else at[w]
                for mb in range(problem.microbatches)
            ]
        return got

    for name in assignment.recompute:
        node = by_name[name]
        for src in node.inputs:
            producer = by_name.get(src)
            if producer is None:
                continue  # outside the stage: always available
            if src not in assignment.recompute:
                if not producer.output_saved:
                    raise LynxPlanError(
                        f"{where}: recomputing {name!r} needs the output of {src!r}, which is kept but does "
                        f"not keep its output (output_saved=False); recompute {src!r} too"
                    )
                if src in assignment.offload:
                    _prefetched_in_time(problem, assignment, name, src, windows)
                continue
            unsaved = uncounted_output(producer, total)
            for mb, (w_src, w_dst) in enumerate(zip(when(producer), when(node))):
                if w_src > w_dst:
                    src_window = assignment.window_of.get((src, mb))
                    dst_window = assignment.window_of.get((name, mb))
                    raise LynxPlanError(
                        f"{where}: for microbatch {mb}, {name!r} is recomputed "
                        f"({'on demand, ' + group_key(node) if dst_window is None else f'in {dst_window}'}) before "
                        f"its input {src!r} is "
                        f"({'on demand, ' + group_key(producer) if src_window is None else str(src_window)})"
                        f"{_mid_backward(src_window)}; keep {src!r} or prefetch it earlier"
                    )
                if unsaved and w_src != w_dst:
                    _unsaved_apart(problem, assignment, src, name, mb)


def _validate_offload(problem: StageProblem, assignment: Assignment, by_name: dict[str, ProblemNode],
                      windows: dict) -> None:
    """What an offload decision may be: an offloadable node, neither recomputed nor sent on,
    prefetched (when in a window) in one that serves its microbatch."""
    where = f"stage {problem.stage}"
    if problem.copies is None:
        raise LynxPlanError(f"{where}: the plan offloads {sorted(assignment.offload)[:3]} but the stage was planned "
                            "without offload; plan with offload=True (`lynx plan --offload`)")
    unknown = sorted(assignment.offload - by_name.keys())
    if unknown:
        raise LynxPlanError(f"{where}: offload names nodes not in the stage: {unknown[:5]}")
    both = sorted(assignment.offload & assignment.recompute)
    if both:
        raise LynxPlanError(f"{where}: {both[0]!r} is both offloaded and recomputed; a node is one or the other")
    for name in sorted(assignment.offload):
        node = by_name[name]
        if node.saved_bytes <= 0:
            raise LynxPlanError(f"{where}: {name!r} is offloaded but saves nothing for backward")
        if is_sent(node):
            raise LynxPlanError(f"{where}: {name!r} is offloaded but its output goes to the next stage, which the "
                                "stage holds until the backward ends; keep it")
    slots = problem.copies.slots
    for (name, mb), wid in assignment.prefetch_of.items():
        if name not in assignment.offload:
            raise LynxPlanError(f"{where}: {name!r} is prefetched in window {wid} but is not offloaded")
        if not 0 <= mb < problem.microbatches:
            raise LynxPlanError(f"{where}: {name!r} prefetched for microbatch {mb}, stage has {problem.microbatches}")
        slot = slots[mb] if mb < len(slots) else None
        if (slot is None or slot.window != wid) and (wid not in windows or windows[wid][1].microbatch != mb):
            first = "none" if slot is None else str(slot.window)
            raise LynxPlanError(f"{where}: {name!r} (microbatch {mb}) is prefetched in {wid}, which does not serve "
                                f"microbatch {mb}'s backward (its first prefetch slot: {first})")


def _prefetched_in_time(problem: StageProblem, assignment: Assignment, name: str, src: str, windows: dict) -> None:
    """A node recomputed in a window that reads an offloaded value needs that value prefetched
    in the same window or an earlier one, or streamed in the backward before a tensor-parallel
    window that runs inside it (:func:`lynx.solvers.offload.streamed_before`)."""
    copies = problem.copies
    for mb in range(problem.microbatches):
        wid = assignment.window_of.get((name, mb))
        if wid is None:
            continue  # on demand: regenerated in the backward, after the streamed prefetch (if slower: waited on)
        pre = assignment.prefetch_of.get((src, mb))
        slot = copies.slots[mb] if copies is not None and mb < len(copies.slots) else None
        ok = pre is not None and ((slot is not None and pre == slot.window) or
                                  (pre in windows and wid in windows and windows[pre][0] <= windows[wid][0]))
        ok = ok or (pre is None and streamed_before(problem, src, wid))   # (a TP window after its issue)
        if not ok:
            raise LynxPlanError(
                f"stage {problem.stage}: for microbatch {mb}, {name!r} is recomputed in {wid} but reads {src!r}, which "
                f"is offloaded and {'prefetched in ' + str(pre) if pre else 'prefetched only during the backward'}; "
                f"prefetch {src!r} in the microbatch's first slot, or recompute {name!r} on demand")


def _window_time(window: ProblemWindow, index: int, ranks: dict[str, int]) -> tuple[int, ...]:
    """Where a window runs in its microbatch's backward (see ``when`` in :func:`validate`): a
    ``tp_allreduce`` window of layer ``L`` after the on-demand regeneration of ``L``'s group
    (lynx.planner.replay_backward: per block, on demand, backward, its all-reduces), any other
    before every on-demand group."""
    layer = window.id.layer if window.kind == "tp_allreduce" else None
    rank = ranks.get(f"layer{layer}") if layer is not None else None
    return (0, 0, 0, index) if rank is None else (1, -rank, 1, index)


def _mid_backward(window) -> str:
    if window is None or window.kind != "tp_allreduce":
        return ""
    return (f", a tensor-parallel window that runs inside layer {window.layer}'s backward, after the on-demand "
            f"regeneration of layer {window.layer} and the layers above it")


def uncounted_output(node: ProblemNode, total_s: float) -> bool:
    """Whether no byte count covers ``node``'s output (``output_saved=False``) once recomputed,
    so it must be recomputed with each recomputed reader (same window, or both on demand);
    ``total_s``: the stage's summed recompute seconds. A zero-byte view or transpose too cheap
    to count (as ``lynx.solvers.stage_model._contract`` makes it transparent) is exempt: it
    may run early in a window and be read later at no cost."""
    return not node.output_saved and not (node.saved_bytes == 0 and node.recompute_s < 1e-4 * (total_s or 1.0))


def _unsaved_apart(problem: StageProblem, assignment: Assignment, src: str, name: str, mb: int) -> None:
    """``src`` keeps no output (``output_saved=False``), so no byte count covers its output
    between its regeneration and ``name``'s: they must be regenerated together."""
    def place(n: str) -> str:
        w = assignment.window_of.get((n, mb))
        return "on demand" if w is None else f"in {w}"
    raise LynxPlanError(
        f"stage {problem.stage}: for microbatch {mb}, {src!r} is recomputed {place(src)} but its reader {name!r} "
        f"{place(name)}; {src!r} does not keep its output (output_saved=False), so nothing counts its bytes in "
        f"between: recompute {src!r} with {name!r} (same window, or both on demand)")


def _eligible(node: ProblemNode, window: ProblemWindow) -> bool:
    if window.eligible_layers is None:
        return True
    return node.layer is not None and node.layer in window.eligible_layers
