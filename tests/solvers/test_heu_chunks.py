"""HEU on devices the linear count does not cover: several chunks (interleaved 1F1B), deferred
weight gradients (ZB-H1).

HEU's books count per (chunk, microbatch), event by event as the replay does
(``lynx.solvers.heu.chunked``), and it plans against the real budget — no sweep of budgets.
Its plan must fit the replayed peak, and its books must never count less than the replay (else
a plan the books accept could overrun the budget).
"""

from __future__ import annotations

import dataclasses

import pytest

from lynx.planner.schedule import rank_actions
from lynx.solvers.heu.books import Books
from lynx.solvers.heu.chunked import full_layout
from lynx.solvers.heu.solve import _structure, clear_cache, solve_heu
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.memory_replay import replay_peak_bytes
from lynx.solvers.memory_weights import (handed_bytes, regenerating_parts, split_backward_bound_bytes,
                                         split_backward_bytes, weight_read_bytes)
from lynx.solvers.exposed import exposed_recompute_s
from lynx.solvers.problem import Assignment
from lynx.solvers.stage_model import hint_from_assignment
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import validate

M = 4
I_ONLY = ("softmax", "attn_dropout", "gelu", "drop1", "drop2")


def _device(schedule: str, stage: int) -> object:
    """A 6-layer stage of a pp-2 pipeline; interleaved: layers 0-2 are chunk ``stage``, layers
    3-5 chunk ``stage + 2`` (2 chunks per device). Its budget: halfway from the leanest plan's
    replayed peak to keeping everything. (Six layers: too many items for HEU's short CP-SAT
    searches, so the test does not import OR-tools.)"""
    p = make_uniform_problem(layers=6, microbatches=M, in_flight=2, seq=512, recv_grad_capacity_s=0.002,
                             stage=stage)
    virtual = 2 if schedule == "interleaved1f1b" else 1
    if virtual == 2:
        nodes = tuple(dataclasses.replace(n, chunk=stage if (n.layer or 0) < 3 else stage + 2) for n in p.nodes)
        p = dataclasses.replace(p, nodes=nodes)
    else:   # zero bubble: what only the input-gradient part reads is freed at I (the rest: unknown, both)
        nodes = tuple(dataclasses.replace(n, output_reads=(True, False), rest_reads=(True, False))
                      if n.name.endswith(I_ONLY) else n for n in p.nodes)
        p = dataclasses.replace(p, nodes=nodes)
    p = dataclasses.replace(p, actions=tuple(rank_actions(schedule, 2, M, virtual)[stage]))
    keep_all = peak_activation_bytes(p, Assignment(frozenset()))
    lean = peak_activation_bytes(p, _lean(p))
    return dataclasses.replace(p, activation_budget_bytes=(lean + keep_all) // 2)


def _lean(problem) -> Assignment:
    """Drop everything but each layer's output."""
    return Assignment(frozenset(n.name for n in problem.nodes if n.saved_bytes and not n.name.endswith("add2")))


def _books_peak(problem, assignment) -> int:
    """HEU's chunk-aware books of ``assignment`` (its peak in the books' accounting)."""
    cached, model, lay, _, _ = _structure(problem)
    lay = full_layout(lay, problem)
    rec, placement = hint_from_assignment(problem, model, assignment)
    books = Books(lay, list(rec))
    for c, where in enumerate(placement):
        for i, w in enumerate(where):
            if w is not None and rec[i]:
                books.place(c, w, [i])
    return books.peak()


@pytest.mark.parametrize("schedule,stage", [("interleaved1f1b", 0), ("interleaved1f1b", 1), ("zbh1", 0),
                                            ("zbh1", 1)])
def test_heu_plan_fits_the_replayed_budget(schedule, stage):
    clear_cache()
    p = _device(schedule, stage)
    result = solve_heu(p)
    validate(p, result.assignment)
    peak = peak_activation_bytes(p, result.assignment)
    assert peak <= p.activation_budget_bytes
    assert result.assignment.recompute   # (the budget binds: keeping everything does not fit)
    assert result.objective_s == pytest.approx(exposed_recompute_s(p, result.assignment))
    # the books never count less than the replay: what they accept fits
    assert _books_peak(p, result.assignment) >= peak
    for plan in (Assignment(frozenset()), _lean(p)):
        assert _books_peak(p, plan) >= peak_activation_bytes(p, plan)


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_bubble_books_follow_the_replay_group_by_group(stage):
    """A part regenerates a group's values after freeing what the groups it ran read, and ``I``
    only what it reads: the books count that (``lynx.solvers.heu.ondemand``), not the largest
    on-demand group on top of everything held — on these stages exactly the replay with each
    split backward counted group by group (``split_backward_bound_bytes``), which is never
    less than the step-by-step replay the runtime's meter follows."""
    clear_cache()
    p = _device("zbh1", stage)
    for plan in (_lean(p), solve_heu(p).assignment):
        by_group = replay_peak_bytes(p, plan, split_model=split_backward_bound_bytes)
        assert _books_peak(p, plan) == by_group >= peak_activation_bytes(p, plan)


def test_what_i_hands_over_is_charged_where_its_regeneration_starts():
    """A value only ``W`` reads is regenerated (and handed over) by ``I`` only to re-run a
    dropped consumer ``I`` reads: it is charged to that consumer, not counted wherever dropped."""
    p = _device("zbh1", 1)
    p = dataclasses.replace(p, nodes=tuple(
        dataclasses.replace(n, output_reads=(False, True), rest_reads=(False, True)) if n.name == "l2.gelu" else n
        for n in p.nodes))
    gelu = next(n for n in p.nodes if n.name == "l2.gelu")
    hand = handed_bytes(p)
    assert hand["l2.gelu"] == 0 and hand["l2.drop2"] == weight_read_bytes(gelu) > 0
    assert regenerating_parts(p)["l2.gelu"] == (True, True)
    held = split_backward_bytes(p, Assignment(frozenset()), frozenset())[1]
    alone = Assignment(frozenset({"l2.gelu"}))
    chain = Assignment(frozenset({"l2.gelu", "l2.fc2", "l2.drop2"}))
    assert split_backward_bytes(p, alone, frozenset())[1] == held - gelu.saved_bytes   # nothing handed over
    drop2 = next(n for n in p.nodes if n.name == "l2.drop2")
    handed = split_backward_bytes(p, chain, frozenset())[1] - (held - gelu.saved_bytes - drop2.saved_bytes)
    assert handed == hand["l2.gelu"] + hand["l2.fc2"] + hand["l2.drop2"]
