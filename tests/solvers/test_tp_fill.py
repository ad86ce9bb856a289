"""At the tightest budgets HEU's books place nothing in tensor-parallel windows; the exact peak
has room there (lynx.solvers.heu.tp_fill), and a TP window may recompute from a value the
backward prefetched before it (lynx.solvers.offload.streamed_before)."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.errors import LynxPlanError
from lynx.planner.windows import WindowId
from lynx.solvers.baselines import layer_recompute_set
from lynx.solvers.cpsat_offload import with_copies
from lynx.solvers.heu.tp_fill import fill_tp_windows
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.memory_microbatch import window_steps
from lynx.solvers.offload import copy_exposed_s, streamed_before, total_exposed_s, tp_window_wait_s
from lynx.solvers.problem import Assignment
from lynx.solvers.synthetic import make_uniform_problem
from lynx.solvers.validate import validate


def _tp_stage(offload: bool = False):
    """A last stage (one microbatch in flight) with TP windows after qkv's and fc1's all-reduces,
    its budget Megatron-full's peak (the grid's level 0.0)."""
    p = make_uniform_problem(layers=4, microbatches=2, in_flight=1, tp_capacity_s=2e-4)
    nodes = tuple(dataclasses.replace(n, tp_collective=n.name.endswith((".qkv", ".fc1"))) for n in p.nodes)
    p = dataclasses.replace(p, nodes=nodes)
    if offload:
        p = with_copies(p)
    full = Assignment(layer_recompute_set(p))
    return dataclasses.replace(p, activation_budget_bytes=peak_activation_bytes(p, full)), full


def test_fill_moves_on_demand_recompute_into_tp_windows_within_the_budget() -> None:
    p, full = _tp_stage()
    filled = fill_tp_windows(p, full)
    assert filled is not full and filled.recompute == full.recompute
    validate(p, filled)
    assert peak_activation_bytes(p, filled) <= p.activation_budget_bytes
    assert total_exposed_s(p, filled) < total_exposed_s(p, full)
    assert {w.kind for w in filled.window_of.values()} == {"tp_allreduce"}
    for (name, mb), wid in filled.window_of.items():   # the layer right below the window's
        assert name.startswith(f"l{wid.layer - 1}.") and wid.microbatch == mb


def test_a_tp_window_may_read_what_the_backward_prefetched_before_it() -> None:
    p, _ = _tp_stage(offload=True)
    boundary = "l0.add2"   # layer 1's input, read in layer 1: streamed in as layer 2's backward starts
    assert streamed_before(p, boundary, WindowId.tp(0, 2, 0))
    assert not streamed_before(p, boundary, WindowId.tp(0, 3, 0))     # (issued after that window)
    assert not streamed_before(p, boundary, WindowId.recv(0, "recv_grad", 0))
    recompute = frozenset({"l1.ln1"})
    ok = Assignment(recompute, {("l1.ln1", 0): WindowId.tp(0, 2, 0)}, offload=frozenset({boundary}))
    validate(p, ok)
    late = Assignment(recompute, {("l1.ln1", 0): WindowId.tp(0, 3, 0)}, offload=frozenset({boundary}))
    with pytest.raises(LynxPlanError, match="prefetched only during the backward"):
        validate(p, late)


def test_an_unmarked_tp_windows_values_count_from_its_layers_backward() -> None:
    # a graph analysed without a sharding plan marks no all-reduce (the grid's): layer L's window
    # is somewhere in L's backward, so what it regenerates counts from L's first backward step,
    # not from the microbatch's backward's start (step 0: a receive window's)
    p = make_uniform_problem(layers=4, microbatches=1, in_flight=1, tp_capacity_s=1e-3, recv_grad_capacity_s=1e-3)
    assert not any(n.tp_collective for n in p.nodes)
    last = len(p.nodes) - 1
    index = {n.name: i for i, n in enumerate(p.nodes)}
    w2 = WindowId.tp(0, 2, 0)
    assert window_steps(p)[w2] == [last - index["l2.add2"]]
    layer1 = [n.name for n in p.nodes if n.layer == 1]
    recompute = frozenset(layer1)
    in_tp = Assignment(recompute, {(n, 0): w2 for n in layer1})
    before = Assignment(recompute, {(n, 0): WindowId.recv(0, "recv_grad", 0) for n in layer1})
    validate(p, in_tp)
    assert peak_activation_bytes(p, in_tp) < peak_activation_bytes(p, before)


def test_fill_uses_unmarked_tp_windows_at_the_tightest_budget() -> None:
    p = make_uniform_problem(layers=4, microbatches=2, in_flight=1, tp_capacity_s=2e-4)
    full = Assignment(layer_recompute_set(p))
    p = dataclasses.replace(p, activation_budget_bytes=peak_activation_bytes(p, full))
    filled = fill_tp_windows(p, full)
    validate(p, filled)
    assert peak_activation_bytes(p, filled) <= p.activation_budget_bytes
    assert total_exposed_s(p, filled) < total_exposed_s(p, full)


def test_a_tp_window_reading_a_streamed_value_is_charged_its_wait() -> None:
    """Layer 2's backward (1 ms) issues the copy of ``l0.add2`` (1.1 ms); its TP window (0.2 ms)
    recomputing ``l1.ln1`` from it waits 0.1 ms, as the runtime does before the value's first
    reader: with 0.262 ms placed there, 0.1 ms more is exposed than the window's overflow and the
    group's copy charge (lynx.solvers.offload.tp_window_wait_s). A window that reads no streamed
    value, or reads it prefetched in the slot, waits for nothing."""
    p, _ = _tp_stage(offload=True)
    boundary, w2 = "l0.add2", WindowId.tp(0, 2, 0)
    backward = [1e-3 + 2e-4] * 4
    rate = 8388608 / 1.1e-3
    p = dataclasses.replace(p, copies=dataclasses.replace(p.copies, group_backward_s=tuple(backward),
                                                          h2d_bytes_per_s=rate, d2h_bytes_per_s=rate))
    recompute = frozenset({"l1.ln1", "l1.qkv"})
    placed = {("l1.ln1", 0): w2, ("l1.qkv", 0): w2}
    reads = Assignment(recompute, placed, offload=frozenset({boundary}))
    validate(p, reads)
    assert tp_window_wait_s(p, reads) == pytest.approx(1e-4)
    on_demand = Assignment(recompute, {}, offload=frozenset({boundary}))
    assert copy_exposed_s(p, reads) == pytest.approx(copy_exposed_s(p, on_demand) + 1e-4)
    aside = Assignment(recompute, placed, offload=frozenset({"l2.ln1"}))   # (a value the window does not read)
    slots = {(boundary, j): slot.window for j, slot in enumerate(p.copies.slots)}
    slot = Assignment(recompute, placed, offload=frozenset({boundary}), prefetch_of=slots)
    assert tp_window_wait_s(p, aside) == tp_window_wait_s(p, slot) == 0.0
