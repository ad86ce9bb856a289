"""Simulator: recomputation in windows is hidden up to capacity, on demand it is exposed, and
the shift propagates through the pipeline; memory is static + in-flight activations."""

from __future__ import annotations

import pytest

from lynx.errors import LynxPlanError
from lynx.planner.comm import CommModel
from lynx.planner.problems import build_pipeline, build_problems, static_bytes
from lynx.planner.synthetic import synthetic_graph
from lynx.planner.simulator import simulate_assignments
from lynx.solvers.problem import Assignment
from lynx.planner.timeline import Loads, PipelineCosts, run_timeline


def _setup(pp: int = 2, m: int = 4, layers: int = 4, schedule: str = "1f1b", comm: CommModel | None = None):
    g = synthetic_graph(layers=layers)
    pipe = build_pipeline(g, pp=pp, microbatches=m, schedule=schedule, comm=comm or CommModel.free())
    static = static_bytes(g, pipe, optimizer="adamw")
    problems = build_problems(g, pipe, run_timeline(pipe), budget_bytes=2**40, static=static)
    return g, pipe, static, problems


def _layer_nodes(problem):
    return [n for n in problem.nodes if n.layer is not None]


def test_full_recompute_adds_one_forward_per_layer_closed_form() -> None:
    p, m, F, B = 4, 8, 1.0, 2.0
    base = run_timeline(PipelineCosts.uniform(pp=p, microbatches=m, forward_s=F, backward_s=B))
    full = run_timeline(PipelineCosts.uniform(pp=p, microbatches=m, forward_s=F, backward_s=B),
                        Loads(on_demand={(c, j, c): F for c in range(p) for j in range(m)}))
    assert base.step_time_s == pytest.approx((m + p - 1) * (F + B))
    assert full.step_time_s == pytest.approx((m + p - 1) * (F + F + B))
    assert sum(full.exposed_recompute_s) == pytest.approx(p * m * F)


def test_full_recompute_on_graph_exposes_one_layer_forward_per_microbatch() -> None:
    g, pipe, static, problems = _setup(pp=1, m=4)
    keep = [Assignment(recompute=frozenset())]
    # Megatron full: keep each layer's input (the previous layer's add2), recompute the rest
    dropped = [n for n in _layer_nodes(problems[0]) if not n.name.endswith("add2")]
    full = [Assignment(recompute=frozenset(n.name for n in dropped))]
    a = simulate_assignments(g, pipe, problems, keep, static=static, budget_bytes=2**40)
    b = simulate_assignments(g, pipe, problems, full, static=static, budget_bytes=2**40)
    layer_forward = sum(n.recompute_s for n in dropped)
    assert b.step_time_s - a.step_time_s == pytest.approx(4 * layer_forward)
    assert b.exposed_recompute_s == pytest.approx(4 * layer_forward) and b.hidden_recompute_s == 0.0
    assert b.peak_memory_bytes[0] < a.peak_memory_bytes[0]


def test_recompute_in_a_large_enough_window_is_hidden() -> None:
    g, pipe, static, problems = _setup(pp=2, m=4)
    stage0 = problems[0]
    window = next(w for w in stage0.windows if w.microbatch == 0 and w.kind == "recv_grad")
    layer0 = [n for n in stage0.nodes if n.layer == 0]
    load = sum(n.recompute_s for n in layer0)
    assert window.capacity_s > load
    recompute = frozenset(n.name for n in layer0)
    placed = Assignment(recompute=recompute, window_of={(n.name, 0): window.id for n in layer0})
    keep = Assignment(recompute=frozenset())
    base = simulate_assignments(g, pipe, problems, [keep, keep], static=static, budget_bytes=2**40)
    sim = simulate_assignments(g, pipe, problems, [placed, keep], static=static, budget_bytes=2**40)
    # microbatch 0 hidden; microbatches 1..3 on demand
    assert sim.hidden_recompute_s == pytest.approx(load)
    assert sim.exposed_recompute_s == pytest.approx(3 * load)
    assert sim.step_time_s <= base.step_time_s + 3 * load + 1e-12


def test_window_overflow_extends_the_backward_and_shifts_downstream() -> None:
    pipe = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0)
    base = run_timeline(pipe)
    cap = base.window("s0.recv_grad.mb0").capacity_s
    over = run_timeline(pipe, Loads(window={"s0.recv_grad.mb0": cap + 0.5}))
    assert over.hidden_recompute_s[0] == pytest.approx(cap)
    assert over.exposed_recompute_s[0] == pytest.approx(0.5)
    assert over.step_time_s == pytest.approx(base.step_time_s + 0.5)
    # stage 1 recomputing on demand delays stage 0's gradients: its windows grow
    late = run_timeline(pipe, Loads(on_demand={(1, j, 1): 0.25 for j in range(4)}))
    assert late.window("s0.recv_grad.mb0").capacity_s == pytest.approx(cap + 0.25)


def test_unknown_window_is_refused() -> None:
    pipe = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0)
    with pytest.raises(LynxPlanError, match="does not have"):
        run_timeline(pipe, Loads(window={"s7.recv_grad.mb99": 1.0}))


def test_memory_is_static_plus_in_flight_activations() -> None:
    for schedule, in_flight in (("1f1b", [2, 1]), ("gpipe", [4, 4])):
        g, pipe, static, problems = _setup(pp=2, m=4, schedule=schedule)
        keep = [Assignment(recompute=frozenset()) for _ in problems]
        sim = simulate_assignments(g, pipe, problems, keep, static=static, budget_bytes=2**40)
        for s, problem in enumerate(problems):
            assert problem.in_flight == in_flight[s]
            saved = sum(n.saved_bytes for n in problem.nodes)
            assert sim.peak_memory_bytes[s] == static[s] + in_flight[s] * saved
        # adamw in fp16: 16 bytes per parameter
        assert static[0] == 16 * sum(pipe.costs[b].param_bytes for b in pipe.chunks[0].blocks) // 2


def test_fits_budget_and_invalid_assignment() -> None:
    g, pipe, static, problems = _setup(pp=2, m=4)
    keep = [Assignment(recompute=frozenset()) for _ in problems]
    sim = simulate_assignments(g, pipe, problems, keep, static=static, budget_bytes=min(static))
    assert not sim.fits_budget
    bad = Assignment(recompute=frozenset({"l1_qkv"}), window_of={("l1_qkv", 0): "s0.recv_grad.mb3"})
    with pytest.raises(LynxPlanError):
        simulate_assignments(g, pipe, problems, [bad, keep[1]], static=static, budget_bytes=2**40)


def test_public_names_are_callable_after_submodule_import() -> None:
    import lynx
    import lynx.compiler  # noqa: F401 - importing the submodules rebinds lynx.compile / lynx.simulate
    import lynx.planner.simulator  # noqa: F401

    assert callable(lynx.simulate) and callable(lynx.compile)


def test_a_sent_value_nobody_saves_is_held_per_microbatch_in_flight() -> None:
    # stage 0 also sends a view of a mask no stage saves: it holds the mask's 256 B per
    # microbatch in flight whatever the plan; the problem's budget leaves it out, the plan counts it
    g, pipe, static, problems = _setup(pp=2, m=4)
    last = problems[0].nodes[-1].name
    block = g.nodes[last]["block"]
    receiver = next(iter(g.successors(last)))
    g.add_node("mask", **{**g.nodes[last], "output_bytes": 256, "saved_bytes": 0, "output_saved": False})
    g.add_node("mask_view", **{**g.nodes[last], "output_bytes": 0, "saved_bytes": 0, "output_saved": False,
                               "is_view": True})
    g.add_edge("mask", "mask_view")
    g.add_edge("mask_view", receiver)
    g.graph["blocks"][block]["nodes"] += ["mask", "mask_view"]
    problems = build_problems(g, pipe, run_timeline(pipe), budget_bytes=2**40, static=static)
    assert [p.sent_bytes for p in problems] == [256, 0]
    assert problems[0].activation_budget_bytes == 2**40 - static[0] - 2 * 256
    assert [n.sent for n in problems[0].nodes if n.name == last] == [True]  # the saved output sent on
    keep = [Assignment(recompute=frozenset()) for _ in problems]
    sim = simulate_assignments(g, pipe, problems, keep, static=static, budget_bytes=2**40)
    assert sim.activation_bytes[0] == 2 * (sum(n.saved_bytes for n in problems[0].nodes) + 256)
