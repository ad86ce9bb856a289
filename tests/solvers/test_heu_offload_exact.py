"""HEU with offload at the tightest budgets: the dear values below the top group, budgeted by the
exact peak where the additive overhead bound leaves the rest nothing (lynx.solvers.heu.offload_exact)."""

from __future__ import annotations

import dataclasses

from lynx.solvers.copies import StageCopies
from lynx.solvers.cpsat_offload import with_copies
from lynx.solvers.heu import offload as heu_offload
from lynx.solvers.heu.offload_join import lean_fits, rest_problem
from lynx.solvers.heu.offload_exact import (TIGHT, dear_set, exact_left, fitting_dear_set, lean, lean_with_offload,
                                           tight)
from lynx.solvers.heu.solve import solve_heu
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import offload_overhead, offloaded_by_group, read_groups, total_exposed_s
from lynx.solvers.problem import Assignment, group_key, group_ranks
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import validate


def _tight(fraction: float = 0.08, in_flight: int = 4):
    return with_copies(make_uniform_problem(layers=4, microbatches=4, in_flight=in_flight, budget_fraction=fraction))


def test_dear_set_takes_boundaries_and_dear_values_below_the_top_group() -> None:
    p = _tight()
    chosen = dear_set(p)
    ranks, reads = group_ranks(p), read_groups(p)
    top = max(ranks.values())
    by_name = {n.name: n for n in p.nodes}
    assert chosen and all(reads[name] < top for name in chosen)   # nothing the top group reads
    can = [n for n in p.nodes if n.saved_bytes > 0 and reads[n.name] < top]
    boundaries = {n.name for n in can if reads[n.name] > ranks[group_key(n)]}
    assert boundaries <= chosen
    cheapest = min(can, key=lambda n: n.recompute_s / n.saved_bytes)
    assert cheapest.name not in chosen and any(name not in boundaries for name in chosen)
    dearest = max(can, key=lambda n: n.recompute_s / n.saved_bytes)
    assert dearest.name in chosen and by_name[dearest.name].layer is not None
    assert dear_set(_tight(in_flight=1)) == frozenset()   # one microbatch: its copies must drain by the forward's end
    assert dear_set(dataclasses.replace(p, copies=None)) == frozenset()


def test_exact_left_measures_what_the_set_adds_to_the_leanest_plan() -> None:
    p = _tight()
    chosen = dear_set(p)
    leanest = lean(p)
    bound = p.activation_budget_bytes - offload_overhead(p, chosen)
    rest = rest_problem(p, chosen, max(bound, 0))
    assert not lean_fits(p, chosen, rest)   # the additive bound leaves the rest too little
    left = exact_left(p, rest, chosen, leanest)
    assert left is not None and left > bound
    joined = lean_with_offload(p, chosen, leanest)
    validate(p, joined)
    assert peak_activation_bytes(p, joined) <= p.activation_budget_bytes
    assert exact_left(dataclasses.replace(p, activation_budget_bytes=1), rest, chosen, leanest) is None


def test_heu_offloads_the_dear_set_where_the_bound_leaves_the_rest_nothing() -> None:
    p = _tight()
    heu_offload.forget_winners()
    res = solve_heu(p)
    validate(p, res.assignment)
    assert peak_activation_bytes(p, res.assignment) <= p.activation_budget_bytes   # checked whole, exactly
    assert res.assignment.offload == dear_set(p)
    assert abs(res.objective_s - total_exposed_s(p, res.assignment)) < 1e-12
    without = solve_heu(dataclasses.replace(p, copies=None))
    assert res.objective_s < 0.8 * without.objective_s


def test_nothing_is_pending_when_the_lane_has_drained_every_term() -> None:
    copies = StageCopies(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, alpha_s=0.0, synchronous=False,
                         host_budget_bytes=2**40, slots=(), group_backward_s=(0.002, 0.002),
                         pending=(((1, 1), 5e6), ((0, 1), 2e6)))
    assert copies.pending_bytes([1_000_000, 1_000_000]) == 0   # the queue is empty: nothing in service either
    assert copies.pending_bytes([3_000_000, 3_000_000]) == 1_000_000 + 3_000_000   # backlog + one in service


def test_the_dear_set_is_tried_at_tight_budgets_only() -> None:
    p = _tight()
    plain, leanest = dataclasses.replace(p, copies=None), lean(p)
    assert tight(p, plain, leanest)
    loose = int(TIGHT * peak_activation_bytes(plain, Assignment(leanest))) + 1
    roomy = dataclasses.replace(p, activation_budget_bytes=loose)
    assert not tight(roomy, dataclasses.replace(roomy, copies=None), leanest)
    heu_offload.forget_winners()
    assert solve_heu(roomy).assignment.offload != dear_set(roomy)


def _pending(p, drained_share: float):
    """``p`` with the copies of a forward's top two groups (the dear set's) still queued at a
    backward's start, ``drained_share`` of them moved since (as the timeline gives)."""
    groups = len(set(group_ranks(p).values()))
    top_two = sum(offloaded_by_group(p, dear_set(p))[-2:])
    counts = tuple([0] * (groups - 2) + [1, 1])
    return dataclasses.replace(p, copies=dataclasses.replace(p.copies, pending=((counts, drained_share * top_two),)))


def test_the_dear_set_sheds_its_upper_groups_dear_values_until_its_leanest_plan_fits() -> None:
    # copies a forward's upper groups offload are still pending at the next backward's start
    # (gpt-1.3b a100-80g pp 4 tp 2, level 0.0, stage 0: the dear set's leanest plan 383 MiB of
    # 348): the whole dear set was skipped, leaving only the small sets (31.1 ms exposed there)
    for share in (0.5, 0.0):
        p = _pending(_tight(), share)
        leanest, dear = lean(p), dear_set(p)
        assert peak_activation_bytes(p, lean_with_offload(p, dear, leanest)) > p.activation_budget_bytes
        chosen = fitting_dear_set(p, leanest)
        assert chosen < dear and exact_left(p, rest_problem(p, chosen, 0), chosen, leanest) is not None
        ranks, reads = group_ranks(p), read_groups(p)
        own = {n.name: ranks[group_key(n)] for n in p.nodes}
        assert {name for name in dear if reads[name] > own[name]} <= chosen   # the boundaries stay
        assert min(own[name] for name in dear - chosen) >= max(own[name] for name in chosen - _boundaries(p, chosen))
        heu_offload.forget_winners()
        res = solve_heu(p)
        validate(p, res.assignment)
        assert peak_activation_bytes(p, res.assignment) <= p.activation_budget_bytes
        assert res.assignment.offload == chosen
        untrimmed = _solve_untrimmed(p)   # (before: the dear set as it was, skipped)
        assert res.objective_s < 0.9 * untrimmed.objective_s
    p = _tight()   # (where the whole set fits: unchanged)
    assert fitting_dear_set(p, lean(p)) == dear_set(p)


def _boundaries(p, chosen):
    ranks, reads = group_ranks(p), read_groups(p)
    return {name for name in chosen if reads[name] > ranks[group_key(next(n for n in p.nodes if n.name == name))]}


def _solve_untrimmed(p):
    trimmed = heu_offload.fitting_dear_set
    heu_offload.fitting_dear_set = lambda problem, leanest: dear_set(problem)
    try:
        heu_offload.forget_winners()
        return solve_heu(p)
    finally:
        heu_offload.fitting_dear_set = trimmed
        heu_offload.forget_winners()


def test_a_set_that_won_before_and_no_longer_fits_is_searched_again() -> None:
    # the planner's next round re-solves a stage with its windows and pending copies re-derived
    # from the replay (the same nodes, the same budget): only the set that won is tried — where
    # it no longer fits, the whole search runs again instead of falling back to recomputation
    roomy = _tight()
    heu_offload.forget_winners()
    first = solve_heu(roomy)
    assert first.assignment.offload == dear_set(roomy)
    later = _pending(roomy, 0.0)
    assert later.nodes is roomy.nodes
    again = solve_heu(later)
    validate(later, again.assignment)
    assert peak_activation_bytes(later, again.assignment) <= later.activation_budget_bytes
    assert again.assignment.offload == fitting_dear_set(later, lean(later))
    assert again.objective_s < 0.9 * solve_heu(dataclasses.replace(later, copies=None)).objective_s
    heu_offload.forget_winners()
