"""HEU with offload: pick what to copy to the host, then let the recompute heuristic plan the rest.

Offload costs bandwidth, not compute, so what is worth copying is what is dear to recompute per
byte (matmul outputs), and what is worth recomputing is what is cheap per byte (softmax, dropout
masks, norms). :func:`solve_heu_offload`:

1. solves the stage without offload (:func:`~lynx.solvers.heu.solve.solve_heu` on the problem
   without copy lanes: the same nodes, so the same cached structure) — if it exposes nothing,
   that is the plan;
2. tries offload sets: the values a later group reads (:func:`boundaries`: a layer's input,
   what recomputation keeps at its leanest), and for each share ``φ`` of the copy lanes
   (``FRACTIONS``) the set :func:`choose_offload` picks — offloadable nodes by recompute
   seconds per byte, highest first, while the prefetch lane has room: per group, the bytes that
   arrive within the backward of the group above the one reading them (``φ × h2d bandwidth ×
   its seconds``), for what the first-backpropagated group reads the microbatches' median slot
   slack — within the host budget; identical layers get identical picks, so HEU's layer
   families survive. A set whose rest cannot fit at all (Megatron-full's kept set over the
   budget left) is skipped before solving; and the same picks with the boundaries taken
   first (``SEEDED`` shares): at the tightest budgets a layer's matmul outputs fit on the host
   only beside its boundary (gpt-1.3b, pp 4, level 0.0: stage 0 exposes 24.2 ms instead of
   31.1 ms, OPT 21.9 ms); and, where the budget is within ``offload_exact.TIGHT`` of the leanest plan's
   peak, the boundaries with the values dearer than average per byte, none the
   first-backpropagated group reads (:func:`~lynx.solvers.heu.offload_exact.dear_set`), less
   the upper groups' dear values its leanest plan has no room for
   (:func:`~lynx.solvers.heu.offload_exact.fitting_dear_set`);
3. ranks the sets by a quick estimate (:func:`_estimate`: what the rest must recompute at
   least, on demand, plus the copy time), skips those whose rest's leanest plan cannot fit, and
   solves the recompute problem of the rest for the ``SOLVED`` most promising, with every
   policy: the offloaded nodes saved nothing there (they are available, like kept values, to
   what is recomputed from them) and the budget is smaller by what offloading can add to a
   backward (:func:`lynx.solvers.offload.offload_overhead`) — for the dear set, where that
   leaves its rest's leanest plan no room or less than the exact figure does, by what it adds
   to the leanest plan's exact peak instead (:func:`~lynx.solvers.heu.offload_exact.exact_left`;
   the joined plan is then checked whole); a set that exposes nothing ends the search. The
   winner's rest is solved once more with its budget raised by what the joined plan's exact
   peak leaves where that is at least ``offload_join.RAISE_SLACK`` of the budget, kept where it
   exposes less (``offload_overhead`` adds every group's worst case;
   gpt-20b a100-80g pp 4 tp 2 m 8 at level 0.0: stages 1–2 used 1.9 of 3.9 GiB). A stage solved
   again under the same budget (the planner's next round) solves only what won before (that
   offload set, or none) — all the sets again where that set no longer fits (the round's
   windows moved, and the copies pending with them);
4. joins the two, moves on demand what a window would recompute from a value that comes back
   only during the backward, checks the whole plan (validity, the memory model's peak with the
   copies pending, the host budget) and keeps the plan exposing least recompute plus copy time;
   the plan of step 1 goes along (``SolveResult.without_offload``): the planner scores it on
   the whole pipeline too (a backward that copies runs whole — its input gradients sent after
   its weight part — which a stage's objective does not see: :mod:`lynx.planner.loop`);
   both get on-demand recompute moved into tensor-parallel windows
   (:mod:`~lynx.solvers.heu.tp_fill`), then kept where the exact peak leaves room
   (:mod:`~lynx.solvers.heu.exact_fill`).

Example::

    >>> from lynx.solvers.cpsat_offload import with_copies
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> p = with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=4, budget_fraction=0.3))
    >>> from lynx.solvers.heu.solve import solve_heu
    >>> res = solve_heu_offload(p, solve_heu)
    >>> bool(res.assignment.offload), res.status
    (True, 'HEURISTIC')
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from lynx.errors import LynxBudgetError
from lynx.solvers.heu.offload_exact import exact_left, fitting_dear_set, lean, tight
from lynx.solvers.heu.offload_join import lean_fits, raised, rest_problem, with_offload
from lynx.solvers.heu.exact_fill import exact_fill
from lynx.solvers.heu.tp_fill import fill_tp_windows
from lynx.solvers.offload import (copy_exposed_s, group_layout, issue_group, offload_overhead, offloadable,
                                  read_groups, slot_prefetch, total_exposed_s)
from lynx.solvers.problem import Assignment, SolveResult, StageProblem, group_key, group_ranks

__all__ = ["solve_heu_offload", "choose_offload", "boundaries", "forget_winners", "FRACTIONS"]

# shares of the prefetch lane's room an offload set may fill (each is one recompute solve)
FRACTIONS = (1.0, 0.5, 0.25)
# shares of the prefetch lane's room filled after the layer boundaries (:func:`_offload_sets`)
SEEDED = (0.95, 0.9)
# offload sets solved per stage, best estimate first (:func:`_estimate`)
SOLVED = 4
# per (stage nodes, budget): the offload set that won last time (the planner's fixed point
# re-solves the same stage with moved windows: only that set and none are tried again)
_WINNERS: dict[tuple[int, int], tuple[tuple, frozenset[str]]] = {}


def choose_offload(problem: StageProblem, fraction: float, seed: frozenset[str] = frozenset()) -> frozenset[str]:
    """Offloadable nodes, dearest to recompute per byte first, within ``fraction`` of the
    prefetch lane's room per issuing group and the host budget (see the module docstring).

    Decided per *position* — the k-th node of a layer class — for every layer at once (taken
    where every layer's node fits), so identical layers stay identical; edge blocks' nodes on
    their own. On a stage holding one microbatch (its backward follows its forward) per node,
    earliest layer first, and only while the copies to the host end by the forward's end
    (:meth:`~lynx.solvers.copies.StageCopies.drains_by_backward`): a late layer's copy-out
    cannot, so no position would be taken for every layer."""
    copies = problem.copies
    if copies is None:
        return frozenset()
    layout, reads = group_layout(problem), read_groups(problem)
    slacks = [s.slack_s for s in copies.slots if s is not None]
    room = {g: fraction * copies.h2d_bytes_per_s * max(0.0, copies.group_backward_s[g] - copies.alpha_s)
            for g in range(min(layout.groups, len(copies.group_backward_s)))}
    room[-1] = fraction * copies.h2d_bytes_per_s * max(0.0, (statistics.median(slacks) if slacks else 0.0)
                                                       - copies.alpha_s)
    host = copies.host_budget_bytes // max(1, problem.in_flight)
    can = set(offloadable(problem))
    drain = _Drain(problem)
    positions: dict[tuple, list] = {}   # position -> its nodes, one per layer
    index: dict[object, int] = {}
    for i, n in enumerate(problem.nodes):
        k = index[n.layer] = index.get(n.layer, -1) + 1
        if n.name in can:
            key = (n.layer_class, k) if n.layer is not None and not drain.on else ("node", i)
            positions.setdefault(key, []).append(n)
    at = {n.name: i for i, n in enumerate(problem.nodes)}
    order = sorted(positions.values(), key=lambda ns: (-ns[0].recompute_s / ns[0].saved_bytes, -ns[0].saved_bytes,
                                                       at[ns[0].name] if drain.on else 0, ns[0].name))
    chosen: list[str] = []
    for n in problem.nodes:   # (the seed's bytes take their room first)
        if n.name in seed and n.name in can:
            g = issue_group(reads[n.name], layout)
            room[g] = room.get(g, 0.0) - n.saved_bytes
            host -= n.saved_bytes
            drain.add(n)
            chosen.append(n.name)
    for nodes in order:
        if any(n.name in seed for n in nodes):
            continue
        need: dict[int, int] = {}
        for n in nodes:
            g = issue_group(reads[n.name], layout)
            need[g] = need.get(g, 0) + n.saved_bytes
        total = sum(need.values())
        if (total <= host and all(nbytes <= room.get(g, 0.0) for g, nbytes in need.items())
                and drain.fits(nodes)):
            for g, nbytes in need.items():
                room[g] -= nbytes
            host -= total
            for n in nodes:
                drain.add(n)
            chosen += [n.name for n in nodes]
    return frozenset(chosen)


class _Drain:
    """The D2H lane's check on a stage holding one microbatch (``on``): per group, the bytes
    taken so far; :meth:`fits` — whether more still drain by the forward's end."""

    def __init__(self, problem: StageProblem) -> None:
        copies = problem.copies
        self.on = copies is not None and problem.in_flight < 2
        # (a synchronous link copies on the compute thread: there a stage holding one microbatch
        # keeps offload out, as before the lane check — its copies would all be compute)
        self.closed = self.on and copies is not None and copies.synchronous
        self.copies, self.ranks = copies, group_ranks(problem)
        self.by_group = [0] * (1 + max(self.ranks.values(), default=-1))

    def add(self, n) -> None:
        self.by_group[self.ranks[group_key(n)]] += n.saved_bytes

    def fits(self, nodes) -> bool:
        if not self.on:
            return True
        if self.closed:
            return False
        assert self.copies is not None
        trial = list(self.by_group)
        for n in nodes:
            trial[self.ranks[group_key(n)]] += n.saved_bytes
        return self.copies.drains_by_backward(trial)


def _offload_sets(problem: StageProblem, dear: frozenset[str]) -> list[frozenset[str]]:
    """The offload sets a stage tries: :func:`choose_offload`'s per share of the prefetch lane,
    the layer boundaries, and :func:`choose_offload`'s with the boundaries taken first (at the
    tightest budgets the rest of a layer can fit only with its boundary off the device too)."""
    bounds = boundaries(problem)
    return ([choose_offload(problem, fraction) for fraction in FRACTIONS] + [bounds]
            + [choose_offload(problem, fraction, bounds) for fraction in SEEDED if bounds] + [dear])


def forget_winners() -> None:
    """Forget the offload sets chosen before (cold solves)."""
    _WINNERS.clear()


def boundaries(problem: StageProblem) -> frozenset[str]:
    """The offloadable values a later group reads (a layer's input, the residual stream): what
    recomputation keeps at its leanest, so what offload can take off the device at the tightest
    budgets (within the host budget; on a stage holding one microbatch, earliest first, those
    whose copies to the host end by the forward's end)."""
    if problem.copies is None:
        return frozenset()
    reads, ranks = read_groups(problem), group_ranks(problem)
    host = problem.copies.host_budget_bytes // max(1, problem.in_flight)
    can = set(offloadable(problem))
    drain = _Drain(problem)
    chosen = []
    for n in problem.nodes:
        if (n.name in can and reads[n.name] > ranks[group_key(n)] and n.saved_bytes <= host
                and drain.fits((n,))):
            host -= n.saved_bytes
            drain.add(n)
            chosen.append(n.name)
    return frozenset(chosen)


def solve_heu_offload(problem: StageProblem, solve_plain: Callable[..., SolveResult], *,
                      time_limit_s: float = 10.0) -> SolveResult:
    """HEU's plan with offload for a stage with copy lanes (see the module docstring);
    ``solve_plain`` is HEU on a stage without copy lanes (:func:`lynx.solvers.heu.solve.solve_heu`)."""
    start = time.perf_counter()
    plain = dataclasses.replace(problem, copies=None)
    memo = (id(problem.nodes), problem.activation_budget_bytes)
    last = _WINNERS.get(memo)
    again = last is not None and last[0] is problem.nodes   # the fixed point's next round
    won = last[1] if again and last is not None else frozenset()
    best: tuple[float, Assignment] | None = None
    base = None
    winner: frozenset[str] = frozenset()
    winner_left = 0
    if not won:   # (again with an offload set that won: that set alone)
        try:
            base = solve_plain(plain, time_limit_s=time_limit_s)
            best = (base.objective_s, base.assignment)
        except LynxBudgetError:
            pass
    if best is None or best[0] > 0:
        tried: set[frozenset[str]] = set()
        candidates: list[tuple[frozenset[str], int]] = []   # (set, the budget its rest has)
        dear = fitting_dear_set(problem, lean(problem)) if tight(problem, plain, lean(problem)) else frozenset()
        for chosen in [won] if won else [] if again else _offload_sets(problem, dear):
            if chosen and chosen not in tried:
                tried.add(chosen)
                candidates.append((chosen, problem.activation_budget_bytes - offload_overhead(problem, chosen)))
        # solve the SOLVED most promising by a quick estimate (what the rest must recompute at
        # least, on demand, plus the copy time), not every one: each solve costs a base solve
        # (those whose rest cannot fit at all are skipped when their turn comes: the check
        # replays the stage, and a set that exposes nothing ends the search before)
        candidates.sort(key=lambda c: _estimate(problem, *c))
        solved = 0
        for chosen, left in candidates:
            if solved == SOLVED or best is not None and best[0] <= 1e-12:
                break   # (nothing exposed: no later set can win, it must expose 1e-12 s less)
            rest = rest_problem(problem, chosen, max(left, 0))
            fits = left > 0 and lean_fits(problem, chosen, rest)
            exact = False
            if chosen == dear:   # (at the tightest budgets the bound leaves it little: measured, offload_exact)
                measured = exact_left(problem, rest, chosen, lean(problem))
                if measured is not None and (not fits or measured > left):
                    exact, rest = True, rest_problem(problem, chosen, measured)
            if not fits and not exact:
                continue
            solved += 1
            found = with_offload(problem, chosen, rest, solve_plain, time_limit_s, exact=exact)
            if found is not None and (best is None or found[0] < best[0] - 1e-12):
                best, winner, winner_left = found, chosen, rest.activation_budget_bytes
        if len(_WINNERS) > 256:
            _WINNERS.clear()
        _WINNERS[memo] = (problem.nodes, winner)
    if best is not None and winner:
        best = raised(problem, winner, winner_left, best, solve_plain, time_limit_s)
    if best is None and won:   # (the set that won no longer fits the re-derived windows' copies: search again)
        _WINNERS.pop(memo, None)
        return solve_heu_offload(problem, solve_plain, time_limit_s=time_limit_s)
    if best is None:   # (nothing fits with offload either: the recompute plan, or its budget error)
        return solve_plain(plain, time_limit_s=time_limit_s)
    alternative = base if base is not None and best[1] != base.assignment else None
    if alternative is not None:
        filled = exact_fill(problem, fill_tp_windows(problem, alternative.assignment))
        if filled is not alternative.assignment:
            alternative = dataclasses.replace(alternative, assignment=filled,
                                              objective_s=total_exposed_s(problem, filled))
    filled = exact_fill(problem, fill_tp_windows(problem, best[1]))
    if filled is not best[1]:
        best = (total_exposed_s(problem, filled), filled)
    return SolveResult(best[1], "HEURISTIC", best[0], None, time.perf_counter() - start, alternative)


def _estimate(problem: StageProblem, chosen: frozenset[str], budget: int) -> float:
    """A quick figure for ranking offload sets: the recompute seconds the rest
    (:func:`~lynx.solvers.heu.offload_join.rest_problem`, with ``budget``) needs at least — the
    cheapest bytes per second dropped until every microbatch in flight's kept bytes fit, all on
    demand — plus the copy time the set exposes."""
    left = [n for n in problem.nodes if n.name not in chosen]   # (the rest's nodes that save anything)
    over = problem.in_flight * sum(n.saved_bytes for n in left) - budget
    seconds = 0.0
    if over > 0:
        for n in sorted((n for n in left if n.saved_bytes > 0 and not n.sent),
                        key=lambda n: n.recompute_s / n.saved_bytes):
            seconds += n.recompute_s * problem.microbatches
            over -= problem.in_flight * n.saved_bytes
            if over <= 0:
                break
    return seconds + copy_exposed_s(problem, Assignment(frozenset(), {}, chosen, slot_prefetch(problem, chosen)))
