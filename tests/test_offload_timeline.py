"""Offload in the planner: copy lanes in the timeline, memory while copies are in flight, plan records.

Closed forms on uniform pipelines (one layer per chunk, a host link whose copies take known
seconds) and hand-made assignments on the synthetic graph; the solvers' offload decisions are
tested in tests/solvers/test_offload_solvers.py."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.config import CompileConfig
from lynx.errors import LynxConfigError, LynxPlanError
from lynx.planner.comm import CommModel
from lynx.planner.copy_lanes import CopyLoads, CopyReplay, HostCopies, Lane
from lynx.planner.hardware import get_hardware
from lynx.planner.host_link import HostLinkSpec
from lynx.planner.problems import (assignment_from_decisions, build_pipeline, build_problems,
                                   decisions_from_assignment, static_bytes)
from lynx.planner.simulator import simulate_assignments
from lynx.planner.synthetic import synthetic_graph
from lynx.planner.timeline import Loads, PipelineCosts, run_timeline
from lynx.solvers.memory import peak_activation_bytes
from lynx.solvers.offload import group_layout, issue_steps, offloadable, read_groups
from lynx.solvers.problem import Assignment
from lynx.solvers.validate import validate

# 1 byte = 1 µs on either lane, no latency: copy seconds are bytes / 1e6
_LINK = HostLinkSpec(alpha_s=0.0, d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6)


def _uniform(pp=2, m=4, F=1.0, B=2.0, link=_LINK, lanes=None):
    pipe = PipelineCosts.uniform(pp=pp, microbatches=m, forward_s=F, backward_s=B)
    host = HostCopies(link=link, lane_of_device=tuple(lanes or range(pp)), share=1)
    return PipelineCosts(**{**pipe.__dict__, "host": host})


def test_a_lane_books_first_fit_and_reports_what_is_still_held() -> None:
    lane = Lane()
    assert lane.book(0.0, 2.0, tag=(0, 0, 0), produced=0.0, nbytes=10) == (0.0, 2.0)
    assert lane.book(1.0, 1.0, tag=(0, 0, 1), produced=1.0, nbytes=5) == (2.0, 3.0)
    assert lane.book(5.0, 1.0, tag=(0, 0, 2), produced=5.0, nbytes=7) == (5.0, 6.0)
    assert lane.book(3.0, 1.5, tag=(0, 0, 3), produced=3.0, nbytes=1) == (3.0, 4.5)   # the gap before 5.0
    assert lane.held(1.5) == 15 and lane.held(2.5, exclude=(0, 0, 1)) == 0 and lane.held(6.0) == 0


def test_a_prefetch_waits_only_for_its_own_blocks_copy_out() -> None:
    """Block 0's copy-out ends at 2 s, block 1's at 6 s: a prefetch of block 0's values issued
    at 3 s starts then (the runtime's streams wait on each value's own D2H event); without
    ``sources`` it waits for the microbatch's last copy-out."""
    host = HostCopies(link=_LINK, lane_of_device=(0,), share=1)
    offload = {(0, 0, 0): 1_000_000, (0, 0, 1): 4_000_000}
    for sources, start in (({(0, 0, 0): frozenset({0})}, 3.0), ({}, 6.0)):
        replay = CopyReplay(host, CopyLoads(offload=offload, sources=sources))
        assert replay.offload(0, 0, 0, 0, 1.0)[:2] == (1.0, 2.0) and replay.offload(0, 0, 0, 1, 2.0)[:2] == (2.0, 6.0)
        assert replay.issue(0, 0, 0, 1_000_000, 3.0, 0)[:2] == (start, start + 1.0)


def test_offload_costs_no_compute_and_a_prefetch_with_room_costs_no_time() -> None:
    """Stage 0 holds two microbatches; its B(j) follows F(j+1): 1 s of forward to prefetch in."""
    base = run_timeline(_uniform())
    copies = CopyLoads(offload={(0, j, 0): 500_000 for j in range(4)},      # 0.5 s each way
                       window={}, streamed={(0, j): [(None, 0, 500_000)] for j in range(4)})
    late = run_timeline(_uniform(), Loads(copies=copies))
    # streamed at B(j)'s start with nothing ahead: each waits its whole copy
    assert late.exposed_copy_s[0] == pytest.approx(4 * 0.5)
    assert late.step_time_s > base.step_time_s
    from lynx.planner.windows import WindowId
    slots = {0: WindowId.recv(0, "recv_act", 1), 1: WindowId.recv(0, "recv_act", 2),
             2: WindowId.recv(0, "recv_act", 3), 3: WindowId.recv(0, "recv_grad", 3)}
    early = CopyLoads(offload=copies.offload, window={slots[j]: [(0, j, 500_000)] for j in range(4)}, streamed={})
    ahead = run_timeline(_uniform(), Loads(copies=early))
    # B0..B2 follow a forward (1 s to copy 0.5 s); B3's slot is the 0.5 s wait for its gradient
    assert ahead.exposed_copy_s[0] == 0.0 and ahead.step_time_s == pytest.approx(base.step_time_s)
    assert ahead.copy_bytes[0] == (2_000_000, 2_000_000) and sum(ahead.busy_s) == pytest.approx(sum(base.busy_s))


def test_what_a_forward_offloads_stays_until_its_copy_ends() -> None:
    """4 s of D2H per microbatch after 1 s forwards: at B0's start (4 s) F0's own copy (1–5 s)
    is still running and F1's waits behind it — both on the device (the storage is released
    only once its copy is done)."""
    copies = CopyLoads(offload={(0, j, 0): 4_000_000 for j in range(4)}, window={}, streamed={})
    t = run_timeline(_uniform(), Loads(copies=copies))
    assert t.pending_bytes[0][0] == 8_000_000   # its own bytes and the other microbatch's, not yet out
    assert t.exposed_copy_s[0] == 0.0


def test_a_devices_copies_run_in_the_order_it_issues_them() -> None:
    """One stream per direction: a prefetch waiting on its copy-out holds up the one behind it
    (first fit would put the second into the gap before the first), and after a backward the
    device's copy-outs wait for the prefetches it issued (the host buffers go back to the pool)."""
    host = HostCopies(link=_LINK, lane_of_device=(0,), share=1)
    offload = {(0, 0, 0): 4_000_000, (0, 1, 0): 1_000_000}
    replay = CopyReplay(host, CopyLoads(offload=offload, sources={(0, 0, 0): frozenset({0})}))
    assert replay.offload(0, 0, 0, 0, 0.0)[:2] == (0.0, 4.0)
    assert replay.issue(0, 0, 0, 1_000_000, 1.0, 0)[:2] == (4.0, 5.0)   # waits for its copy-out
    assert replay.issue(0, 0, 1, 1_000_000, 2.0, 0)[:2] == (5.0, 6.0)   # behind it, not at 2.0
    replay.release(0)
    assert replay.offload(0, 0, 1, 0, 4.5)[:2] == (6.0, 7.0)   # after the prefetches issued before


def test_devices_sharing_a_host_link_share_its_lanes() -> None:
    copies = CopyLoads(offload={(c, j, c): 3_000_000 for c in range(2) for j in range(4)}, window={}, streamed={})
    apart = run_timeline(_uniform(), Loads(copies=copies))
    shared = run_timeline(_uniform(lanes=(0, 0)), Loads(copies=copies))
    assert max(apart.pending_bytes[1].values(), default=0) < max(shared.pending_bytes[1].values(), default=0)


def test_a_synchronous_link_copies_on_the_compute_thread() -> None:
    link = HostLinkSpec(alpha_s=0.0, d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6, synchronous=True)
    base = run_timeline(_uniform(pp=1, m=2))
    copies = CopyLoads(offload={(0, j, 0): 100_000 for j in range(2)}, window={},
                       streamed={(0, j): [(None, 0, 100_000)] for j in range(2)})
    t = run_timeline(_uniform(pp=1, m=2, link=link), Loads(copies=copies))
    assert t.step_time_s == pytest.approx(base.step_time_s + 4 * 0.1)
    assert t.exposed_copy_s[0] == 0.0 and t.pending_bytes[0] == {}


def _graph_setup(m=4, host=None, budget=2**40, layers=4):
    g = synthetic_graph(layers=layers)
    host = host or HostCopies(link=_LINK, lane_of_device=(0, 1), share=1)
    pipe = build_pipeline(g, pp=2, microbatches=m, comm=CommModel.free(), host=host)
    static = static_bytes(g, pipe, optimizer="adamw")
    problems = build_problems(g, pipe, run_timeline(pipe), budget_bytes=budget, static=static, offload=True)
    return g, pipe, static, problems


def _offload_all(problem, window_for_top=True):
    names = offloadable(problem)
    layout, reads = group_layout(problem), read_groups(problem)
    prefetch = {(n, j): problem.copies.slots[j].window for n in names for j in range(problem.microbatches)
                if window_for_top and reads[n] == layout.groups - 1}
    return Assignment(frozenset(), offload=frozenset(names), prefetch_of=prefetch)


def test_offloaded_values_are_held_from_their_prefetch_one_group_ahead() -> None:
    g, pipe, static, problems = _graph_setup(layers=8)
    p = problems[0]
    keep, off = Assignment(frozenset()), _offload_all(p)
    assert p.in_flight == 2 and off.offload
    steps, layout = issue_steps(p, off.offload), group_layout(p)
    reads = read_groups(p)
    for name, step in steps.items():   # issued as the group above the reading one starts
        above = reads[name] + 1
        assert step == (layout.first_step[above] if above < layout.groups else 0)
    # neither microbatch in flight keeps them on the device; the one backpropagated streams them back
    assert peak_activation_bytes(p, off, pending=[0] * layout.groups) < 0.55 * peak_activation_bytes(p, keep)
    # prefetching everything in the window holds it all from the backward's start, like recomputation there
    everything = Assignment(frozenset(), offload=off.offload,
                            prefetch_of={(n, j): p.copies.slots[j].window for n in off.offload for j in range(4)})
    assert peak_activation_bytes(p, everything, pending=[0] * layout.groups) > \
        peak_activation_bytes(p, off, pending=[0] * layout.groups)
    # copies still in flight add to the peak
    assert peak_activation_bytes(p, off, pending=[1000] * layout.groups) == \
        peak_activation_bytes(p, off, pending=[0] * layout.groups) + 1000


def test_simulated_offload_plan_round_trips_through_plan_decisions() -> None:
    g, pipe, static, problems = _graph_setup()
    assignments = [_offload_all(problems[0]), Assignment(frozenset())]
    sim = simulate_assignments(g, pipe, problems, assignments, static=static, budget_bytes=2**40)
    keep = simulate_assignments(g, pipe, problems, [Assignment(frozenset())] * 2, static=static,
                                budget_bytes=2**40)
    assert sim.offloaded_bytes[0] > 0 and sim.host_bytes[0] == 2 * sim.offloaded_bytes[0]
    assert sim.activation_bytes[0] < keep.activation_bytes[0]
    assert sim.exposed_copy_s > 0 and sim.step_time_s > keep.step_time_s   # 1 MB/s: the copies are slow
    decisions = decisions_from_assignment(problems[0], assignments[0])
    offloaded = [d for d in decisions if d.action == "offload"]
    assert offloaded and all(d.window or d.windows or d.prefetch_at for d in offloaded)
    assert assignment_from_decisions(decisions, 4) == assignments[0]


def test_copy_loads_name_the_tp_windows_whose_recomputation_reads_a_streamed_value() -> None:
    """``l0_ln2``, offloaded, streams back for layer 0 (block 1) as layer 1's backward starts;
    layer 1's TP window recomputes ``l0_fc1`` from it for microbatch 0 (the replay waits for it
    there), while for microbatch 1 it is prefetched in the slot (nothing to wait for there)."""
    from lynx.planner.offload_costs import copy_loads
    from lynx.planner.windows import WindowId

    g, pipe, _static, problems = _graph_setup()
    p = problems[0]
    w0, w1 = WindowId.tp(0, 1, 0), WindowId.tp(0, 1, 1)
    a = Assignment(frozenset({"l0_fc1", "l0_gelu"}),
                   {("l0_fc1", 0): w0, ("l0_fc1", 1): w1, ("l0_gelu", 0): w0, ("l0_gelu", 1): w1},
                   offload=frozenset({"l0_ln2"}), prefetch_of={("l0_ln2", 1): p.copies.slots[1].window})
    loads = copy_loads(g, pipe, problems, [a, Assignment(frozenset())])
    assert loads.window_reads == {w0: frozenset({1})} and g.nodes["l0_ln2"]["block"] == 1


def test_offload_rules() -> None:
    g, pipe, static, problems = _graph_setup()
    p = problems[0]
    name = offloadable(p)[0]
    with pytest.raises(LynxPlanError, match="both offloaded and recomputed"):
        validate(p, Assignment(frozenset({name}), offload=frozenset({name})))
    sent = next(n.name for n in p.nodes if n.sent and n.output_saved)
    with pytest.raises(LynxPlanError, match="next stage"):
        validate(p, Assignment(frozenset(), offload=frozenset({sent})))
    plain = build_problems(g, pipe, run_timeline(pipe), budget_bytes=2**40, static=static)[0]
    with pytest.raises(LynxPlanError, match="offload=True"):
        validate(plain, Assignment(frozenset(), offload=frozenset({name})))
    # a consumer recomputed in a window needs its offloaded input prefetched there or earlier
    window = next(w for w in p.windows if w.microbatch == 0)
    consumer = next(n for n in p.nodes if name in n.inputs and n.saved_bytes and n.layer is not None)
    bad = Assignment(frozenset({consumer.name}), {(consumer.name, 0): window.id}, offload=frozenset({name}))
    with pytest.raises(LynxPlanError, match="prefetched only during the backward"):
        validate(p, bad)
    good = Assignment(frozenset({consumer.name}), {(consumer.name, 0): window.id}, offload=frozenset({name}),
                      prefetch_of={(name, 0): p.copies.slots[0].window})
    validate(p, good)


def test_offload_settings_and_hardware() -> None:
    cfg = CompileConfig(pp=2, microbatches=4, hardware="a100-80g", offload=True)
    assert cfg.host_budget_bytes() == get_hardware("a100-80g").host_memory_bytes
    assert "offload" in cfg.fingerprint_fields()
    plain = CompileConfig(pp=2, microbatches=4, hardware="a100-80g")
    assert "offload" not in plain.fingerprint_fields() and "offload" not in plain.record()
    with pytest.raises(LynxConfigError, match="one model chunk per device"):
        CompileConfig(pp=2, microbatches=4, schedule="interleaved1f1b", offload=True)
    with pytest.raises(LynxConfigError, match="host link"):
        CompileConfig(pp=2, microbatches=4, offload=True,
                      hardware=get_hardware("a100-80g").model_copy(update={"host_link": None}))
    with pytest.raises(LynxConfigError, match="offload=True"):
        CompileConfig(pp=2, microbatches=4, host_memory_budget="1GiB")
    assert get_hardware("h100-sxm").host_link.h2d_bytes_per_s == 2 * get_hardware("a100-80g").host_link.h2d_bytes_per_s
    # a spec without a host link records as before the field existed
    bare = get_hardware("a100-80g").model_copy(update={"host_link": None, "host_memory_bytes": None})
    assert "host_link" not in bare.model_dump(mode="json")
    shared = HostCopies.from_hardware(get_hardware("a100-80g").model_copy(
        update={"host_link": get_hardware("a100-80g").host_link.model_copy(update={"shared_by": 4})}), pp=4, tp=2)
    assert shared.share == 2 and shared.lane_of_device == (0, 0, 1, 1)


def test_a_hardware_file_says_devices_share_the_host_link(tmp_path) -> None:
    from lynx.planner.hardware_files import load_hardware_file

    path = tmp_path / "dgx.yaml"
    path.write_text("device: a100-80g\nhost_link: {shared_by: 2}\n")
    spec = load_hardware_file(path)
    assert spec.host_link.shared_by == 2 and spec.host_link.d2h_bytes_per_s == 25e9
    path.write_text("device: a100-80g\nhost_link: {shared_by: 0}\n")
    with pytest.raises(LynxConfigError, match="host_link.shared_by"):
        load_hardware_file(path)


def test_a_backward_without_copies_still_sends_its_input_gradients_first() -> None:
    """Offload on stage 0 only: stage 1's B brings nothing back from the host, so it still runs
    split as the runtime does (its input gradients sent before its weight part); stage 0's
    copies stay on their lanes (pp 2: F 1, B 2 of which W 1)."""
    pipe = _uniform()
    pipe = dataclasses.replace(pipe, costs=tuple(dataclasses.replace(c, backward_weight_s=1.0) for c in pipe.costs))
    split = dataclasses.replace(pipe, grads_first=True)
    copies = CopyLoads(offload={(0, j, 0): 100_000 for j in range(4)}, window={},
                       streamed={(0, j): [(None, 0, 100_000)] for j in range(4)})
    plain, early = (run_timeline(p, Loads(copies=copies)) for p in (pipe, split))
    b0 = [next(a for a in t.actions[0] if a.kind == "B" and a.microbatch == 0) for t in (plain, early)]
    assert b0[0].start > b0[1].start and early.step_time_s < plain.step_time_s
    assert early.copy_bytes[0] == plain.copy_bytes[0] == (400_000, 400_000)
    # stage 1 offloading too: its B brings values back and runs whole, as without the split
    both = CopyLoads(offload={**copies.offload, **{(1, j, 1): 100_000 for j in range(4)}}, window={},
                     streamed={**copies.streamed, **{(1, j): [(None, 1, 100_000)] for j in range(4)}})
    assert run_timeline(split, Loads(copies=both)).step_time_s == pytest.approx(
        run_timeline(pipe, Loads(copies=both)).step_time_s)


def test_a_tp_window_recomputing_waits_for_the_prefetch_of_the_block_below() -> None:
    """One device, two blocks of 1 s each way, block 1's backward all-reduce 0.5 s. Block 0's
    values go out after its forward (1–2 s) and stream back as block 1's backward starts (2 s,
    2.5 s: back at 4.5 s). Block 1's TP window, at 3 s, recomputes for block 0 from them
    (lynx.solvers.offload.streamed_before, ``CopyLoads.window_reads``): it runs once they are
    back, 4.5–4.7 s. A window whose recomputation reads none of them waits for none (the
    runtime waits before a value's first reader): it runs at 3–3.2 s, inside its all-reduce."""
    from lynx.planner.partition import BlockCost, Chunk
    from lynx.planner.windows import WindowId
    costs = tuple(BlockCost(block=b, name=f"layer{b}", layer=b, forward_s=1.0, backward_s=1.0, tp_forward_s=0.0,
                            tp_backward_s=0.5 * b, param_bytes=0, dp_s=0.0) for b in range(2))
    pipe = PipelineCosts(pp=1, microbatches=1, schedule="1f1b", chunks=(Chunk(0, 0, (0, 1), (0, 1)),), costs=costs,
                         boundary_s=(), host=HostCopies(link=_LINK, lane_of_device=(0,), share=1))
    wid = WindowId.tp(0, 1, 0)
    copies = CopyLoads(offload={(0, 0, 0): 1_000_000}, streamed={(0, 0): [(1, 0, 2_500_000)]})
    reads = dataclasses.replace(copies, window_reads={wid: frozenset({0})})
    idle = run_timeline(pipe, Loads(copies=copies))
    busy = run_timeline(pipe, Loads(window={wid: 0.2}, copies=reads))
    aside = run_timeline(pipe, Loads(window={wid: 0.2}, copies=copies))
    assert idle.step_time_s == pytest.approx(5.5) and idle.exposed_copy_s[0] == pytest.approx(1.0)
    assert busy.step_time_s == pytest.approx(5.7) and busy.exposed_copy_s[0] == pytest.approx(1.0)
    assert aside.step_time_s == pytest.approx(5.5) and aside.exposed_copy_s[0] == pytest.approx(1.0)
