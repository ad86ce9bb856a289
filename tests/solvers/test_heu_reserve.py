"""HEU with tensor-parallel windows: an open window first takes what no later window can.

A tp collective inside layer l's backward serves only the layers below l, so the top layer's
recompute can go only to the recv window before the backward. Filling that window by value
alone (layer 0's item first) left layer 1's item on demand (found on gpt-20b a100 pp4 tp4,
stages 1 and 2, where OPT hid everything); HEU also realises with the open window reserving
room for it.
"""

import pytest

from lynx.solvers import solve
from lynx.solvers.problem import ProblemNode, ProblemWindow, StageProblem
from lynx.solvers.validate import validate


def _problem() -> StageProblem:
    def node(name, cost, layer):
        return ProblemNode(name, 100, True, cost, (), layer, "Block", False)

    nodes = (node("a0", 1.0, 0), node("a1", 0.5, 1))  # a0 is worth more per byte
    windows = (ProblemWindow("s0.recv_grad.mb0", "recv_grad", 0, 1.0, None),
               ProblemWindow("s0.tp.l1.b.mb0", "tp_allreduce", 0, 1.0, (0,)))
    return StageProblem(0, nodes, windows, 1, 2, 250)  # 250 B: both dropped, at most one on demand


@pytest.mark.parametrize("solver", ["heu", "opt"])
def test_the_top_layer_gets_the_open_window(solver):
    p = _problem()
    res = solve(solver, p, time_limit_s=10.0)
    validate(p, res.assignment)
    assert res.assignment.recompute == {"a0", "a1"}
    assert res.objective_s == pytest.approx(0.0)
    assert str(res.assignment.window_of[("a1", 0)]) == "s0.recv_grad.mb0"
    assert str(res.assignment.window_of[("a0", 0)]) == "s0.tp.l1.b.mb0"
