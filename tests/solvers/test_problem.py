"""The stage problem's accounting and validity rules (lynx.solvers.problem)."""

import pytest

from lynx.errors import LynxPlanError
from lynx.solvers.problem import (
    Assignment,
    ProblemNode,
    ProblemWindow,
    StageProblem,
    exposed_recompute_s,
    make_uniform_problem,
    microbatch_classes,
    peak_activation_bytes,
    required_recompute_closure,
    validate,
)


def _tiny(windows=()) -> StageProblem:
    # layer 0: a -> b -> c ; layer 1: d reads c (an earlier group) ; e (no output kept) -> f
    nodes = (
        ProblemNode("a", 100, True, 1.0, (), 0, "L", False),
        ProblemNode("b", 200, True, 2.0, ("a",), 0, "L", True),
        ProblemNode("c", 50, True, 0.5, ("b",), 0, "L", False),
        ProblemNode("e", 0, False, 4.0, ("c",), 1, "L", False),
        ProblemNode("f", 300, True, 1.0, ("e",), 1, "L", False),
    )
    return StageProblem(0, nodes, tuple(windows), microbatches=2, in_flight=3, activation_budget_bytes=10_000)


def test_korthikanti_bytes_per_layer():
    s, b, h, a = 512, 2, 256, 8
    p = make_uniform_problem(layers=3, hidden=h, heads=a, seq=s, micro_batch=b, views=True)
    per_layer = sum(n.saved_bytes for n in p.nodes if n.layer == 1)
    assert per_layer == s * b * h * (34 + 5 * a * s // h)


def test_peak_adds_in_flight_kept_max_prefetch_and_transient():
    w = (ProblemWindow("w0", "recv_grad", 0, 10.0, None), ProblemWindow("w1", "recv_grad", 1, 10.0, None))
    p = _tiny(w)
    a = Assignment(frozenset({"b", "e", "f"}), {("b", 0): "w0", ("e", 1): "w1", ("f", 1): "w1"})
    validate(p, a)
    kept = 100 + 50
    prefetched = max(200, 0 + 300)  # microbatch 0: b; microbatch 1: e, f
    transient = max(0 + 300, 200)  # mb 0: layer 1 (e, f) on demand; mb 1: layer 0 (b) on demand
    assert peak_activation_bytes(p, a) == 3 * kept + prefetched + transient


def test_exposed_counts_on_demand_and_window_overflow():
    w = (ProblemWindow("w0", "recv_grad", 0, 1.5, None),)
    p = _tiny(w)
    a = Assignment(frozenset({"b", "e", "f"}), {("b", 0): "w0", ("e", 0): "w0", ("f", 0): "w0"})
    validate(p, a)
    on_demand = 2.0 + 4.0 + 1.0  # microbatch 1 has no window
    overflow = (2.0 + 4.0 + 1.0) - 1.5
    assert exposed_recompute_s(p, a) == pytest.approx(on_demand + overflow)


@pytest.mark.parametrize(
    "assignment, message",
    [
        (Assignment(frozenset({"zz"}), {}), "not in the stage"),
        (Assignment(frozenset({"f"}), {}), "does not keep its output"),
        (Assignment(frozenset({"b"}), {("b", 1): "w0"}), "serves microbatch 0"),
        (Assignment(frozenset({"b"}), {("b", 0): "nope"}), "unknown window"),
        (Assignment(frozenset({"a"}), {("a", 0): "wl"}), "not eligible"),
        (Assignment(frozenset(), {("a", 0): "w0"}), "not recomputed"),
        (Assignment(frozenset({"a", "b"}), {("b", 0): "w0", ("a", 0): "w1"}), "before its input"),
        (Assignment(frozenset({"a", "b"}), {("b", 0): "w0"}), "before its input"),
        # d-chain across layers: c (layer 0) on demand is regenerated after layer 1's backward
        (Assignment(frozenset({"c", "e", "f"}), {}), "before its input"),
    ],
)
def test_validate_rejects(assignment, message):
    w = (
        ProblemWindow("w0", "recv_grad", 0, 1.0, None),
        ProblemWindow("w1", "recv_grad", 0, 1.0, None),
        ProblemWindow("wl", "tp_allreduce", 0, 1.0, (1,)),
    )
    with pytest.raises(LynxPlanError, match=message):
        validate(_tiny(w), assignment)


def test_validate_accepts_prefetched_cross_layer_input():
    w = (ProblemWindow("w0", "recv_grad", 0, 1.0, None), ProblemWindow("w1", "recv_grad", 1, 1.0, None))
    a = Assignment(frozenset({"c", "e", "f"}), {("c", 0): "w0", ("c", 1): "w1"})
    validate(_tiny(w), a)


def test_closure_adds_unsaved_producers():
    assert required_recompute_closure(_tiny(), {"f"}) == frozenset({"e", "f"})


def test_microbatch_classes_group_identical_windows():
    p = make_uniform_problem(layers=2, microbatches=6, recv_grad_capacity_s=[0.5, 0.0, 0.0, 0.1, 0.1, 0.5])
    classes = {c.members: c.capacities for c in microbatch_classes(p)}
    assert classes == {(0, 5): (0.5,), (1, 2): (), (3, 4): (0.1,)}


def test_keep_all_peak_and_budget_fraction():
    p = make_uniform_problem(layers=2, in_flight=3, budget_fraction=0.5, pre=True, post=True)
    keep_all = Assignment(frozenset(), {})
    assert peak_activation_bytes(p, keep_all) == 3 * sum(n.saved_bytes for n in p.nodes)
    assert p.activation_budget_bytes == peak_activation_bytes(p, keep_all) // 2
