"""HEU's plans leave memory the exact peak does not use; lynx.solvers.heu.exact_fill keeps on-demand
recompute there (and the zero-byte ancestors only it needed stop re-running)."""

from __future__ import annotations

import dataclasses

from lynx.solvers.baselines import layer_recompute_set
from lynx.solvers.cpsat_offload import with_copies
from lynx.solvers.heu.exact_fill import exact_fill
from lynx.solvers.heu.offload import solve_heu_offload
from lynx.solvers.heu.solve import clear_cache, solve_heu
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import total_exposed_s
from lynx.solvers.problem import Assignment
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import required_recompute_closure, validate

MIB = 2**20


def _full_stage(extra_bytes: int, in_flight: int = 2):
    """A stage with views, everything but the layer boundaries recomputed on demand
    (Megatron-full), its budget that plan's exact peak plus ``extra_bytes``."""
    p = make_uniform_problem(layers=2, microbatches=4, in_flight=in_flight, views=True)
    full = Assignment(layer_recompute_set(p))
    budget = peak_activation_bytes(p, full) + extra_bytes
    return dataclasses.replace(p, activation_budget_bytes=budget), full


def test_fill_keeps_a_softmax_and_stops_re_running_its_zero_byte_ancestors() -> None:
    """Selective recomputation (the attention core on demand) with room for one softmax (128 MiB
    per microbatch in flight): keeping it spares the scores, scale and mask before it too."""
    p = make_uniform_problem(layers=2, microbatches=4, in_flight=2, views=True)
    core = required_recompute_closure(p, {n.name for n in p.nodes if n.name.endswith(
        (".q_t", ".k_t", ".scores", ".scale", ".causal_mask", ".softmax", ".attn_dropout"))})
    plan = Assignment(core)
    validate(p, plan)
    p = dataclasses.replace(p, activation_budget_bytes=peak_activation_bytes(p, plan) + 300 * MIB)
    filled = exact_fill(p, plan)
    assert filled is not plan
    validate(p, filled)
    assert peak_activation_bytes(p, filled) <= p.activation_budget_bytes
    assert total_exposed_s(p, filled) < total_exposed_s(p, plan) - 1e-6
    kept = plan.recompute - filled.recompute
    assert any(n.endswith(".softmax") for n in kept)
    layer = next(n for n in kept if n.endswith(".softmax")).split(".")[0]
    assert {f"{layer}.scores", f"{layer}.scale", f"{layer}.causal_mask"} <= kept   # (zero-byte, re-run only for it)


def test_fill_spends_no_more_than_the_exact_peak_leaves() -> None:
    for extra in (0, 10 * MIB, 100 * MIB, 300 * MIB, 1000 * MIB):
        p, full = _full_stage(extra)
        filled = exact_fill(p, full)
        validate(p, filled)
        assert peak_activation_bytes(p, filled) <= p.activation_budget_bytes
        assert total_exposed_s(p, filled) <= total_exposed_s(p, full)
    p, full = _full_stage(0)
    assert exact_fill(p, full) is full   # no room: nothing moves


def test_fill_leaves_offload_and_prefetches_alone() -> None:
    p, full = _full_stage(300 * MIB, in_flight=4)
    p = with_copies(p)
    kept = [n.name for n in p.nodes if n.name not in full.recompute and n.saved_bytes > 0 and not n.sent][:2]
    plan = Assignment(full.recompute, offload=frozenset(kept))
    budget = peak_activation_bytes(p, plan) + 300 * MIB
    p = dataclasses.replace(p, activation_budget_bytes=budget)
    filled = exact_fill(p, plan)
    assert filled is not plan and filled.offload == plan.offload and filled.prefetch_of == plan.prefetch_of
    validate(p, filled)
    assert peak_activation_bytes(p, filled) <= budget


def test_heu_with_offload_leaves_no_keep_move_that_fits() -> None:
    """HEU's books and offload's overhead bound are conservative: before the pass, its plan on
    this stage peaks below the budget while a kept softmax would fit and expose less."""
    clear_cache()
    p = with_copies(make_uniform_problem(layers=4, microbatches=8, in_flight=4, budget_fraction=0.3, views=True))
    res = solve_heu_offload(p, solve_heu)
    validate(p, res.assignment)
    assert peak_activation_bytes(p, res.assignment) <= p.activation_budget_bytes
    assert exact_fill(p, res.assignment) is res.assignment
