"""The stage problem's accounting and validity rules (lynx.solvers.problem)."""

import dataclasses

import pytest

from lynx.errors import LynxPlanError
from lynx.solvers.problem import (
    Assignment,
    ProblemNode,
    ProblemWindow,
    StageProblem,
    exposed_recompute_s,
    microbatch_classes,
)
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.memory import microbatch_peak_bytes, peak_activation_bytes, peak_upper_bound_bytes
from lynx.solvers.validate import required_recompute_closure, validate

W0, W1 = "s0.recv_grad.mb0", "s0.recv_grad.mb1"   # window ids as a plan writes them


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


def test_peak_follows_the_backward_node_by_node():
    w = (ProblemWindow(W0, "recv_grad", 0, 10.0, None), ProblemWindow(W1, "recv_grad", 1, 10.0, None))
    p = _tiny(w)
    a = Assignment(frozenset({"b", "e", "f"}), {("b", 0): W0, ("e", 1): W1, ("f", 1): W1})
    validate(p, a)
    # backward steps: f 0, e 1, c 2, b 3, a 4. Microbatch 0 at step 0 holds kept a and c,
    # prefetched b and f (regenerated for its own backward); microbatch 1 at most a + c + f.
    others = (3 - 1) * (100 + 50)
    assert peak_activation_bytes(p, a) == others + 100 + 50 + 200 + 300
    assert peak_activation_bytes(p, a) <= peak_upper_bound_bytes(p, a)


def _chain(saved_by=None) -> StageProblem:
    # one layer: p -> q -> r -> s, each saving 100 B; s keeps the layer's output.
    # q's output is saved by r only (a known saver) or, unknown, by every consumer.
    nodes = (
        ProblemNode("p", 100, True, 1.0, (), 0, "L", False),
        ProblemNode("q", 100, True, 1.0, ("p",), 0, "L", False, saved_by),
        ProblemNode("r", 100, True, 1.0, ("q",), 0, "L", False),
        ProblemNode("s", 100, True, 1.0, ("r", "q"), 0, "L", False),
    )
    return StageProblem(0, nodes, (), microbatches=1, in_flight=1, activation_budget_bytes=10_000)


def test_on_demand_regeneration_is_lazy_and_frees_as_backward_proceeds():
    # drop q and r: r is regenerated at s's step (0) from q, so both live from step 0;
    # keeping s and p, the peak is p + q + r + s = 400 (the group-level bound says the same).
    a = Assignment(frozenset({"q", "r"}))
    p = _chain()
    assert peak_activation_bytes(p, a) == 400
    # drop only q with its saver r known: q comes back at r's step (1), after s (step 0) is
    # freed, so the peak is 300 while the group-level bound counts all 400.
    known = _chain(saved_by=("r",))
    a = Assignment(frozenset({"q"}))
    assert peak_activation_bytes(known, a) == 300
    assert peak_upper_bound_bytes(known, a) == 400
    # unknown savers: every consumer (s too) may read q, so it comes back at step 0: 400.
    assert peak_activation_bytes(_chain(), a) == 400


def test_kept_input_of_a_recomputed_node_is_freed_after_its_last_reader():
    # o saves its own output (as softmax does) and is dropped; p is kept and read by dropped q.
    # Steps: s 0, r 1, q 2, p 3, o 4. q is re-run at r's step (1), reading p; p's last reader
    # is q's backward (step 2): the backward graph frees p there, so when o comes back at
    # step 4 it is alone: 300 (holding p to the end, as the interpreter did, would be 400).
    nodes = (
        ProblemNode("o", 300, True, 1.0, (), 0, "L", False, ("o",), output_bytes=300),
        ProblemNode("p", 100, True, 1.0, ("o",), 0, "L", False, ("q",), output_bytes=100),
        ProblemNode("q", 100, True, 1.0, ("p",), 0, "L", False, ("r",), output_bytes=100),
        ProblemNode("r", 100, True, 1.0, ("q",), 0, "L", False, ("s",), output_bytes=100),
        ProblemNode("s", 100, False, 1.0, ("r",), 0, "L", False, (), output_bytes=0),
    )
    p = StageProblem(0, nodes, (), microbatches=1, in_flight=1, activation_budget_bytes=10_000)
    a = Assignment(frozenset({"o", "q"}))
    validate(p, a)
    # step 0: s, r, p; step 1: regenerated q and p; step 2: p; step 4: o
    assert microbatch_peak_bytes(p, a, frozenset()) == 300
    assert peak_upper_bound_bytes(p, a) >= 300


def test_a_saved_output_is_freed_at_its_last_saver_and_the_rest_at_the_own_step():
    # a's output (80 B) is saved by b and c, a's own internals (20 B, e.g. a dropout mask) by a.
    # Steps: c 0, b 1, a 2. Dropped a comes back at c's step with both parts; its output goes
    # after b's step (1), its internals at its own step (2).
    nodes = (
        ProblemNode("a", 100, True, 1.0, (), 0, "L", False, ("b", "c"), output_bytes=80),
        ProblemNode("b", 400, False, 1.0, ("a",), 0, "L", False, (), output_bytes=0),
        ProblemNode("c", 10, False, 1.0, ("a",), 0, "L", False, (), output_bytes=0),
    )
    p = StageProblem(0, nodes, (), microbatches=1, in_flight=1, activation_budget_bytes=10_000)
    drop_a = Assignment(frozenset({"a"}))
    # step 0: b, c, a (regenerated) = 510; step 1: b + a = 500; step 2: a's internals = 20
    assert microbatch_peak_bytes(p, drop_a, frozenset()) == 510
    # with b dropped too (on demand, it saves only internals): it comes back at its step (1),
    # after c's bytes went: a + b = 500
    assert microbatch_peak_bytes(p, Assignment(frozenset({"b"})), frozenset()) == 100 + 400
    # unknown split: a's 100 B are held to a's own step (as long as any of them is needed)
    unknown = dataclasses.replace(p, nodes=(dataclasses.replace(nodes[0], output_bytes=None), *nodes[1:]))
    assert microbatch_peak_bytes(unknown, drop_a, frozenset()) == 510


@pytest.mark.parametrize("fraction", [0.15, 0.3, 0.6])
def test_node_peak_never_exceeds_the_solvers_bound(fraction):
    from lynx.solvers import solve

    p = make_uniform_problem(
        layers=3,
        microbatches=4,
        in_flight=3,
        budget_fraction=fraction,
        views=True,
        recv_grad_capacity_s=[0.004, 0.0, 0.001, 0.0],
        pre=True,
        post=True,
    )
    for name in ("full", "selective", "checkmate", "heu", "opt"):
        a = solve(name, p, time_limit_s=10.0).assignment
        assert peak_activation_bytes(p, a) <= peak_upper_bound_bytes(p, a), name
        if name in ("checkmate", "heu", "opt"):
            assert peak_upper_bound_bytes(p, a) <= p.activation_budget_bytes, name


def test_exposed_counts_on_demand_and_window_overflow():
    w = (ProblemWindow(W0, "recv_grad", 0, 1.5, None),)
    p = _tiny(w)
    a = Assignment(frozenset({"b", "e", "f"}), {("b", 0): W0, ("e", 0): W0, ("f", 0): W0})
    validate(p, a)
    on_demand = 2.0 + 4.0 + 1.0  # microbatch 1 has no window
    overflow = (2.0 + 4.0 + 1.0) - 1.5
    assert exposed_recompute_s(p, a) == pytest.approx(on_demand + overflow)


@pytest.mark.parametrize(
    "assignment, message",
    [
        (Assignment(frozenset({"zz"}), {}), "not in the stage"),
        (Assignment(frozenset({"f"}), {}), "does not keep its output"),
        (Assignment(frozenset({"b"}), {("b", 1): W0}), "serves microbatch 0"),
        (Assignment(frozenset({"b"}), {("b", 0): "s0.recv_grad.mb7"}), "unknown window"),
        (Assignment(frozenset({"a"}), {("a", 0): "s0.tp.l1.b.mb0"}), "not eligible"),
        (Assignment(frozenset(), {("a", 0): W0}), "not recomputed"),
        (Assignment(frozenset({"a", "b"}), {("b", 0): W0, ("a", 0): W1}), "before its input"),
        (Assignment(frozenset({"a", "b"}), {("b", 0): W0}), "before its input"),
        # d-chain across layers: c (layer 0) on demand is regenerated after layer 1's backward
        (Assignment(frozenset({"c", "e", "f"}), {}), "before its input"),
    ],
)
def test_validate_rejects(assignment, message):
    w = (
        ProblemWindow(W0, "recv_grad", 0, 1.0, None),
        ProblemWindow(W1, "recv_grad", 0, 1.0, None),
        ProblemWindow("s0.tp.l1.b.mb0", "tp_allreduce", 0, 1.0, (1,)),
    )
    with pytest.raises(LynxPlanError, match=message):
        validate(_tiny(w), assignment)


def test_validate_accepts_prefetched_cross_layer_input():
    w = (ProblemWindow(W0, "recv_grad", 0, 1.0, None), ProblemWindow(W1, "recv_grad", 1, 1.0, None))
    a = Assignment(frozenset({"c", "e", "f"}), {("c", 0): W0, ("c", 1): W1})
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


def test_a_stage_output_saved_only_downstream_stays_whether_dropped_or_not():
    # b's output is saved only by the next stage (saved_by=()): dropping it frees nothing here
    nodes = (
        ProblemNode("a", 100, True, 1.0, (), 0, "L", False, ("b",)),
        ProblemNode("b", 50, True, 1.0, ("a",), 0, "L", False, ()),
    )
    p = StageProblem(0, nodes, (), microbatches=2, in_flight=2, activation_budget_bytes=10_000)
    keep, drop = Assignment(frozenset()), Assignment(frozenset({"b"}))
    assert peak_activation_bytes(p, keep) == peak_activation_bytes(p, drop) == 2 * 150
    assert peak_upper_bound_bytes(p, drop) >= 300


def test_microbatch_classes_merge_capacities_equal_up_to_rounding():
    p = make_uniform_problem(layers=2, microbatches=3, recv_grad_capacity_s=[0.5, 0.5 - 1e-16, 0.4])
    classes = {c.members: c.capacities for c in microbatch_classes(p)}
    assert classes == {(0, 1): (0.5 - 1e-16,), (2,): (0.4,)}


def test_early_regeneration_by_a_later_layer_is_within_the_bound():
    # layer 0: a -> b (b on demand, its output saved by layer 1's c); layer 1: c -> d, d on demand.
    # b comes back at c's step, inside layer 1's backward, with a (its on-demand input).
    nodes = (
        ProblemNode("a", 100, True, 1.0, (), 0, "L", False, ("b",)),
        ProblemNode("b", 100, True, 1.0, ("a",), 0, "L", False, ("c",)),
        ProblemNode("c", 100, True, 1.0, ("b",), 1, "L", False, ("d",)),
        ProblemNode("d", 300, True, 1.0, ("c",), 1, "L", False, ("d",)),
    )
    p = StageProblem(0, nodes, (), microbatches=1, in_flight=1, activation_budget_bytes=10_000)
    a = Assignment(frozenset({"a", "b", "d"}))
    validate(p, a)
    # steps: d 0, c 1, b 2, a 3; step 0: c (kept, held: d reads it) and d; step 1: c, and b
    # and a regenerated for c's backward
    assert peak_activation_bytes(p, a) == 100 + 300
    assert peak_upper_bound_bytes(p, a) == 100 + 300 + 200  # kept c + layer 1's d + early a, b
