"""OPT regression: an input of an earlier group whose output is not a saved tensor.

Found on llama-7b (interleaved 1F1B, pp 4, 8 microbatches, budget = `full`'s peak, stage 0):
OPT returned ``rms_norm_2__L18`` on demand with its input ``add_7__L17`` (layer 17, output
not saved) on demand too — regenerated only after layer 18's, so the plan is invalid. Such
an input must run in the same window as its consumer (its output lives in no byte count),
and an on-demand consumer in a later group cannot have it: the consumer must be placed.
"""

import pytest

from lynx.errors import LynxBudgetError
from lynx.solvers import solve
from lynx.solvers.problem import ProblemNode, ProblemWindow, StageProblem
from lynx.solvers.validate import validate


def _problem(windows: tuple[ProblemWindow, ...] = (), budget: int = 5000) -> StageProblem:
    """Layer 0: a0 → u0 (zero bytes, output not saved); layer 1: i1 (reads u0; 1000 B, cheap)
    → b1 (500 B, costly). Four microbatches in flight: keeping all needs 6400 B; dropping
    i1 (with u0) would need 3400 B but is valid only if both run in one window; dropping b1
    needs 4900 B."""
    def node(name, saved, out, cost, inputs, layer):
        return ProblemNode(name, saved, out, cost, inputs, layer, "Block", False)

    nodes = (node("a0", 100, True, 0.5, (), 0), node("u0", 0, False, 1.0, ("a0",), 0),
             node("i1", 1000, True, 0.1, ("u0",), 1), node("b1", 500, True, 5.0, ("i1",), 1))
    return StageProblem(0, nodes, windows, 1, 4, budget)


@pytest.mark.parametrize("solver", ["opt", "checkmate", "heu"])
def test_cross_group_unsaved_input_is_never_regenerated_after_its_consumer(solver):
    p = _problem()
    res = solve(solver, p, time_limit_s=10.0)
    validate(p, res.assignment)  # the buggy model dropped i1 and u0 on demand: u0 after i1
    assert "i1" not in res.assignment.recompute
    assert res.assignment.recompute == {"b1"}


def test_cross_group_unsaved_input_shares_the_consumers_window():
    window = ProblemWindow("s0.recv_grad.mb0", "recv_grad", 0, 10.0, None)
    p = _problem((window,), budget=4000)  # dropping b1 no longer fits: i1 and u0 share the window
    res = solve("opt", p, time_limit_s=10.0)
    validate(p, res.assignment)
    assert res.objective_s == pytest.approx(0.0)
    assert res.assignment.window_of[("i1", 0)] == res.assignment.window_of[("u0", 0)] == window.id


def test_cross_group_unsaved_input_infeasible_when_only_the_consumer_could_go():
    p = _problem(budget=3500)  # only dropping i1 fits, and without a window it is invalid
    with pytest.raises(LynxBudgetError):
        solve("opt", p, time_limit_s=10.0)


def test_an_invalid_expansion_is_never_returned(monkeypatch):
    """A modelling bug that expands to an invalid plan: OPT warns and returns HEU's (valid)
    plan as FEASIBLE; the registry refuses any solver's invalid plan with LynxPlanError."""
    import lynx.solvers.baselines as baselines
    import lynx.solvers.opt as opt
    from lynx.errors import LynxPlanError
    from lynx.solvers.problem import Assignment, SolveResult

    p = _problem()
    bad = Assignment(frozenset({"i1", "u0"}))  # u0 regenerated after i1: invalid
    monkeypatch.setattr(opt, "expand_solution", lambda *a: bad)
    with pytest.warns(RuntimeWarning, match="invalid"):
        res = solve("opt", p, time_limit_s=10.0)
    validate(p, res.assignment)
    assert res.status == "FEASIBLE" and res.assignment != bad
    monkeypatch.setattr(baselines, "solve_none", lambda *a, **k: SolveResult(bad, "HEURISTIC", 0.0, None, 0.0))
    with pytest.raises(LynxPlanError, match="solver 'none' returned an invalid plan"):
        solve("none", p)
