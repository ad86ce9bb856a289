"""Two rules of validate the memory model relies on: an output no byte count covers
(``output_saved=False``) is not left from one window to a reader regenerated elsewhere, and a
tensor-parallel window runs inside its layer's backward, after that layer's (and the layers
above's) on-demand regeneration — not before every on-demand group as the other windows do."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.errors import LynxPlanError
from lynx.planner.windows import WindowId
from lynx.solvers import solve
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.problem import Assignment
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import required_recompute_closure, validate

RECV0 = WindowId.recv(0, "recv_grad", 0)


def _stage(**kw):
    return make_uniform_problem(layers=4, microbatches=1, in_flight=1, recv_grad_capacity_s=1e-3,
                                tp_capacity_s=1e-3, **kw)


def test_an_unsaved_output_left_in_a_window_for_an_on_demand_reader_is_refused() -> None:
    p = _stage()
    recompute = frozenset({"l1.scores", "l1.softmax"})
    apart = Assignment(recompute, {("l1.scores", 0): RECV0})   # softmax on demand, scores' output held between
    with pytest.raises(LynxPlanError, match=r"'l1.scores' is recomputed in s0.recv_grad.mb0 but its reader "
                                            r"'l1.softmax' on demand.*output_saved=False"):
        validate(p, apart)
    # (what made it a hole: the memory model counts nothing for it, so the plan looks free)
    on_demand = Assignment(recompute)
    assert peak_activation_bytes(p, apart) <= peak_activation_bytes(p, on_demand)
    validate(p, on_demand)
    validate(p, Assignment(recompute, {("l1.scores", 0): RECV0, ("l1.softmax", 0): RECV0}))


def test_an_unsaved_output_is_not_carried_from_one_window_to_another() -> None:
    p = _stage()
    recompute = frozenset({"l1.scores", "l1.softmax"})
    apart = Assignment(recompute, {("l1.scores", 0): RECV0, ("l1.softmax", 0): WindowId.tp(0, 3, 0)})
    with pytest.raises(LynxPlanError, match=r"'l1.scores' is recomputed in s0.recv_grad.mb0 but its reader "
                                            r"'l1.softmax' in s0.tp.l3.b.mb0"):
        validate(p, apart)


def test_zero_byte_views_may_run_early() -> None:
    p = _stage(views=True)   # (qkv → qkv_view → q_t → scores: the views save nothing and cost ~nothing)
    validate(p, Assignment(frozenset({"l1.qkv_view", "l1.q_t"}), {("l1.qkv_view", 0): RECV0}))


def test_a_tp_window_runs_after_its_layers_on_demand_regeneration() -> None:
    p = _stage()
    # layer 1's output, read by layer 2's first node: layer 2 regenerates on demand before its
    # backward, so before its all-reduces (the window of layer 2), after those of layer 3
    recompute = required_recompute_closure(p, {"l1.add2", "l2.ln1"})   # (with drop2 and fc2)
    layer1 = sorted(recompute - {"l2.ln1"})
    late = Assignment(recompute, {(n, 0): WindowId.tp(0, 2, 0) for n in layer1})
    with pytest.raises(LynxPlanError, match=r"'l2.ln1' is recomputed \(on demand, layer2\) before its input "
                                            r"'l1.add2' is \(s0.tp.l2.b.mb0\), a tensor-parallel window "
                                            r"that runs inside layer 2's backward"):
        validate(p, late)
    validate(p, Assignment(recompute, {(n, 0): WindowId.tp(0, 3, 0) for n in layer1}))
    validate(p, Assignment(recompute, {(n, 0): RECV0 for n in layer1}))   # (a receive: before every on-demand group)
    # layer 1's reader on demand regenerates after layer 2's all-reduces
    layer0 = required_recompute_closure(p, {"l0.add2"})
    validate(p, Assignment(layer0 | {"l1.ln1"}, {(n, 0): WindowId.tp(0, 2, 0) for n in layer0}))
    # a TP window may read what an earlier one regenerated
    validate(p, Assignment(layer0 | {"l1.ln1"}, {(n, 0): WindowId.tp(0, 3, 0) for n in layer0}
                           | {("l1.ln1", 0): WindowId.tp(0, 2, 0)}))


@pytest.mark.parametrize("solver", ["heu", "opt"])
def test_solvers_keep_a_tp_windows_value_from_readers_regenerated_before_it(solver: str) -> None:
    # layers 0..2 with roomy TP windows: both solvers once prefetched l1.add2 in layer 2's window
    # for l2.ln1 regenerated on demand (lynx.solvers.solve raises on an invalid plan)
    p = make_uniform_problem(layers=3, microbatches=2, in_flight=2, tp_capacity_s=5e-3, budget_fraction=0.4)
    p = dataclasses.replace(p, nodes=tuple(dataclasses.replace(n, tp_collective=n.name.endswith((".qkv", ".fc1")))
                                           for n in p.nodes))
    result = solve(solver, p, time_limit_s=10.0)
    assert peak_activation_bytes(p, result.assignment) <= p.activation_budget_bytes
    assert any(w.kind == "tp_allreduce" for w in result.assignment.window_of.values())
