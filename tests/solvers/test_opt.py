"""OPT (CP-SAT): optimal against brute force, valid, within budget, deterministic, clear errors."""

import dataclasses
import itertools

import pytest

from lynx.errors import LynxBudgetError, LynxConfigError
from lynx.solvers import SOLVERS, solve
from lynx.solvers.setup import OFFLOAD_SOLVERS
from lynx.solvers.baselines import solve_full
from lynx.solvers.opt import solve_opt
from lynx.solvers.problem import Assignment, ProblemNode, ProblemWindow, StageProblem, exposed_recompute_s
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.memory import peak_activation_bytes, peak_upper_bound_bytes
from lynx.solvers.validate import validate
from lynx.errors import LynxPlanError

SMALL = dict(layers=3, microbatches=6, in_flight=3, recv_grad_capacity_s=[0.004, 0.002, 0, 0, 0.001, 0.001])

W0, W1 = "s0.recv_grad.mb0", "s0.recv_grad.mb1"   # window ids as a plan writes them


def _brute_force(p: StageProblem) -> float:
    """Least exposed time over every valid assignment within the bound the solvers enforce."""
    names = [n.name for n in p.nodes]
    best = float("inf")
    for mask in itertools.product((False, True), repeat=len(names)):
        rec = [n for n, m in zip(names, mask) if m]
        per_node_choices = []
        for name in rec:
            opts = []
            for mb in range(p.microbatches):
                opts.append([None] + [w.id for w in p.windows if w.microbatch == mb])
            per_node_choices.append(list(itertools.product(*opts)))
        for combo in itertools.product(*per_node_choices):
            window_of = {(name, mb): w for name, ws in zip(rec, combo) for mb, w in enumerate(ws) if w is not None}
            a = Assignment(frozenset(rec), window_of)
            if peak_upper_bound_bytes(p, a) > p.activation_budget_bytes:
                continue
            try:
                validate(p, a)
            except LynxPlanError:
                continue
            if not _unsaved_outputs_stay(p, a):
                continue
            best = min(best, exposed_recompute_s(p, a))
    return best


def _unsaved_outputs_stay(p: StageProblem, a: Assignment) -> bool:
    """Solver convention: an output that is not a saved tensor is consumed where it is made."""
    by_name = {n.name: n for n in p.nodes}
    for n in p.nodes:
        if n.name not in a.recompute:
            continue
        for src in n.inputs:
            if src in a.recompute and not by_name[src].output_saved:
                for mb in range(p.microbatches):
                    if a.window_of.get((src, mb)) != a.window_of.get((n.name, mb)):
                        return False
    return True


def _brute_problem(budget: int) -> StageProblem:
    nodes = (
        ProblemNode("x", 40, True, 0.4, (), 0, "L", False),
        ProblemNode("y", 0, False, 1.0, ("x",), 0, "L", False),
        ProblemNode("z", 90, True, 0.3, ("y",), 0, "L", True),
        ProblemNode("u", 60, True, 0.7, ("z",), 1, "L", False),
        ProblemNode("v", 30, True, 0.2, ("u",), 1, "L", False),
    )
    windows = (ProblemWindow(W0, "recv_grad", 0, 1.2, None), ProblemWindow(W1, "recv_grad", 1, 0.5, None))
    return StageProblem(0, nodes, windows, microbatches=2, in_flight=2, activation_budget_bytes=budget)


@pytest.mark.parametrize("budget", [250, 330, 400, 520])
def test_opt_matches_brute_force(budget):
    p = _brute_problem(budget)
    res = solve_opt(p, time_limit_s=10.0)
    validate(p, res.assignment)
    assert res.status == "OPTIMAL"
    assert peak_activation_bytes(p, res.assignment) <= budget
    assert res.objective_s == pytest.approx(_brute_force(p), abs=1e-5)


@pytest.mark.parametrize("fraction", [0.2, 0.35, 0.6])
def test_opt_valid_fits_and_beats_every_fitting_baseline(fraction):
    p = make_uniform_problem(budget_fraction=fraction, **SMALL)
    res = solve("opt", p, time_limit_s=30.0)
    validate(p, res.assignment)
    assert res.status == "OPTIMAL" and res.gap is not None and res.gap <= 1e-4
    assert peak_activation_bytes(p, res.assignment) <= p.activation_budget_bytes
    assert res.objective_s == pytest.approx(exposed_recompute_s(p, res.assignment))
    for name in SOLVERS:
        if name == "opt" or name in OFFLOAD_SOLVERS:   # (offload baselines: tests/solvers/test_offload_solvers.py)
            continue
        try:
            other = solve(name, p, time_limit_s=30.0)
        except LynxBudgetError:
            continue
        if peak_activation_bytes(p, other.assignment) <= p.activation_budget_bytes:
            assert res.objective_s <= other.objective_s * (1 + 1e-4) + 1e-9, name


def test_windows_hide_recompute_when_they_suffice():
    p = make_uniform_problem(layers=3, microbatches=4, in_flight=4, budget_fraction=0.4, recv_grad_capacity_s=1.0)
    res = solve_opt(p, time_limit_s=30.0)
    assert res.assignment.recompute  # the budget forces dropping
    assert res.objective_s == pytest.approx(0.0, abs=1e-9)


def test_opt_is_deterministic():
    p = make_uniform_problem(budget_fraction=0.3, views=True, **SMALL)
    first = solve_opt(p, time_limit_s=30.0).assignment
    assert all(solve_opt(p, time_limit_s=30.0).assignment == first for _ in range(2))


def test_infeasible_budget_says_what_is_needed():
    p = make_uniform_problem(layers=3, microbatches=4, in_flight=4, budget_fraction=0.01)
    with pytest.raises(LynxBudgetError, match=r"leanest plan needs .* dominated by"):
        solve_opt(p, time_limit_s=10.0)


@pytest.mark.parametrize("limit", [0, -1.0, float("nan")])
def test_bad_time_limit(limit):
    with pytest.raises(LynxConfigError, match="time_limit_s"):
        solve("opt", make_uniform_problem(layers=1), time_limit_s=limit)


def test_unknown_solver_lists_valid_names():
    with pytest.raises(LynxConfigError, match="valid solvers: opt, heu"):
        solve("cplex", make_uniform_problem(layers=1))


def test_early_stop_reports_status_and_gap():
    p = make_uniform_problem(layers=6, microbatches=16, in_flight=4, budget_fraction=0.15, views=True,
                             recv_grad_capacity_s=[0.05, 0.01, 0.003] + [0.0] * 10 + [0.002] * 3, tp_capacity_s=0.0002)
    calls = []
    res = solve_opt(p, time_limit_s=0.5, progress=lambda *a: calls.append(a))
    assert res.status in ("OPTIMAL", "FEASIBLE")
    assert res.gap is not None and res.gap >= 0
    assert peak_activation_bytes(p, res.assignment) <= p.activation_budget_bytes
    validate(p, res.assignment)


@pytest.mark.parametrize("solver", ["heu", "checkmate", "opt"])
def test_budget_of_exactly_full_peak_is_feasible(solver):
    """Memory is modelled exactly when tensor sizes share a divisor: at a budget equal to
    `full`'s peak to the byte, the solvers find a plan (rounding each tensor up to
    budget/2**26 = 3 bytes here used to make every plan 'not fit')."""
    p = make_uniform_problem(layers=2, seq=2000, hidden=1000, heads=8, microbatches=2, in_flight=3,
                             recv_grad_capacity_s=0.0005)
    full_peak = peak_activation_bytes(p, solve_full(p).assignment)
    p = dataclasses.replace(p, activation_budget_bytes=full_peak)
    res = solve(solver, p, time_limit_s=10.0)
    validate(p, res.assignment)
    assert peak_activation_bytes(p, res.assignment) <= full_peak


@pytest.mark.parametrize(
    "fraction, caps",
    [(0.2, [0.004, 0.002, 0.002, 0.001]), (0.35, [0.0, 0.003, 0.003, 0.0]), (0.5, [0.01, 0.0, 0.0, 0.0])],
)
def test_layer_symmetry_breaking_keeps_the_optimum(fraction, caps):
    from lynx.solvers.cpsat import solve_model
    from lynx.solvers.stage_model import model_from_problem

    p = make_uniform_problem(
        layers=5,
        microbatches=4,
        in_flight=3,
        budget_fraction=fraction,
        views=True,
        recv_grad_capacity_s=caps,
        pre=True,
        post=True,
    )
    model = model_from_problem(p)
    ordered = solve_model(model, time_limit_s=60.0, symmetry=True)
    free = solve_model(model, time_limit_s=60.0, symmetry=False)
    assert ordered.status == free.status == "OPTIMAL"
    assert ordered.objective_s == pytest.approx(free.objective_s, rel=1e-4, abs=1e-9)
