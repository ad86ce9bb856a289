"""Pipeline timeline: closed forms on uniform stages, windows found exactly, partitioning."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.errors import LynxConfigError
from lynx.planner.comm import CommModel
from lynx.planner.partition import balanced_boundaries, partition_graph
from lynx.planner.problems import build_pipeline
from lynx.planner.synthetic import synthetic_graph
from lynx.planner.schedule import compute_order, list_actions
from lynx.planner.timeline import PipelineCosts, run_timeline


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 16), (8, 8), (8, 32), (3, 7)])
def test_1f1b_bubble_fraction_closed_form(p: int, m: int) -> None:
    t = run_timeline(PipelineCosts.uniform(pp=p, microbatches=m, forward_s=1.0, backward_s=2.0))
    assert t.step_time_s == pytest.approx((m + p - 1) * 3.0)
    for s in range(p):
        assert t.bubble_fraction(s) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (8, 3), (2, 5)])
def test_in_flight_gpipe_holds_m_and_1f1b_min_p_minus_s_m(p: int, m: int) -> None:
    gpipe = run_timeline(PipelineCosts.uniform(pp=p, microbatches=m, forward_s=1.0, backward_s=2.0, schedule="gpipe"))
    one_f_one_b = run_timeline(PipelineCosts.uniform(pp=p, microbatches=m, forward_s=1.0, backward_s=2.0))
    assert gpipe.in_flight == [m] * p
    assert one_f_one_b.in_flight == [min(p - s, m) for s in range(p)]


def test_gpipe_step_time_closed_form() -> None:
    t = run_timeline(PipelineCosts.uniform(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0, schedule="gpipe"))
    # forwards fill in (m + p - 1)·F, backwards drain in (m + p - 1)·B
    assert t.step_time_s == pytest.approx((8 + 3) * 1.0 + (8 + 3) * 2.0)


def test_every_action_runs_once_after_its_dependencies() -> None:
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved1f1b", 2), ("interleaved1f1b", 3)):
        pipe = PipelineCosts.uniform(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0, schedule=schedule,
                                virtual=v, p2p_s=0.25)
        t = run_timeline(pipe)
        ends = {(a.kind, a.chunk, a.microbatch): a for acts in t.actions for a in acts}
        assert len(ends) == 2 * 8 * 4 * v
        for a in ends.values():
            if a.kind == "F" and a.chunk > 0:
                assert a.start >= ends[("F", a.chunk - 1, a.microbatch)].end + 0.25 - 1e-9
            if a.kind == "B" and a.chunk < 4 * v - 1:
                assert a.start >= ends[("B", a.chunk + 1, a.microbatch)].end + 0.25 - 1e-9
            if a.kind == "B":
                assert a.start >= ends[("F", a.chunk, a.microbatch)].end - 1e-9


def test_interleaved_has_smaller_bubble_than_1f1b() -> None:
    # same total work per device: 2 chunks of half the cost each
    plain = run_timeline(PipelineCosts.uniform(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0))
    inter = run_timeline(PipelineCosts.uniform(pp=4, microbatches=8, forward_s=0.5, backward_s=1.0,
                                          schedule="interleaved1f1b", virtual=2))
    assert inter.step_time_s < plain.step_time_s
    assert inter.bubble_s[0] == pytest.approx(plain.bubble_s[0] / 2)


def test_balanced_1f1b_fast_links_windows_are_exactly_the_bubble() -> None:
    p, m, F = 4, 8, 1.0
    t = run_timeline(PipelineCosts.uniform(pp=p, microbatches=m, forward_s=F, backward_s=2.0))
    for s in range(p):
        mine = [w for w in t.windows if w.device == s]
        # idle time no recomputation can use: the wait for microbatch 0's activation (s·F)
        # and the tail after the stage's last backward (s·B)
        assert sum(w.capacity_s for w in mine) == pytest.approx(t.bubble_s[s] - s * (F + 2.0))
        # no steady-state waits: only the first backward and the cool-down ones wait
        served = sorted(w.microbatch for w in mine if w.kind == "recv_grad")
        assert served == ([0] if s < p - 1 else []) + list(range(m - (p - s - 1), m)) * (s < p - 1)
    first = t.window("s0.recv_grad.mb0")
    assert first.capacity_s == pytest.approx((p - 1) * 2.0)  # the warm-up bubble: (p−1)·B


def test_slow_links_add_a_wait_before_steady_state_backwards() -> None:
    fast = run_timeline(PipelineCosts.uniform(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0))
    slow = run_timeline(PipelineCosts.uniform(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0, p2p_s=0.5))
    steady = range(2, 5)  # after the first backward, before the cool-down
    fast_waits = {w.microbatch for w in fast.windows if w.device == 0 and w.kind == "recv_grad"}
    slow_waits = {w.microbatch: w.capacity_s for w in slow.windows if w.device == 0 and w.kind == "recv_grad"}
    assert not fast_waits & set(steady)
    assert all(slow_waits[j] == pytest.approx(1.0) for j in steady)  # a transfer wait on every one


def test_unbalanced_last_stage_adds_waits_upstream() -> None:
    g = synthetic_graph(layers=4, heavy_post=30.0)
    pipe = build_pipeline(g, pp=2, microbatches=8, comm=CommModel.free())
    t = run_timeline(pipe)
    steady = [w for w in t.windows if w.device == 0 and w.kind == "recv_grad" and 1 <= w.microbatch <= 6]
    assert len(steady) == 6 and all(w.capacity_s > 0 for w in steady)


def test_tp_windows_one_per_layer_backward_serving_lower_layers() -> None:
    g = synthetic_graph(layers=4)
    comm = CommModel(p2p=lambda n: 0.0, tp_allreduce=lambda n: 1e-4, dp_gradients=lambda n: 0.0)
    pipe = build_pipeline(g, pp=2, microbatches=4, tp=2, comm=comm)
    t = run_timeline(pipe)
    tp = [w for w in t.windows if w.kind == "tp_allreduce" and w.device == 0]
    assert len(tp) == 2 * 4  # 2 layers on stage 0 × 4 microbatches
    assert all(w.capacity_s == pytest.approx(2e-4) for w in tp)
    w = t.window("s0.tp.l1.b.mb2")
    assert w.eligible_layers == (0,) and w.microbatch == 2
    assert t.window("s0.tp.l0.b.mb2").eligible_layers == ()


def test_dp_collectives_run_after_the_last_backward_and_leave_no_usable_window() -> None:
    g = synthetic_graph(layers=4)
    comm = CommModel(p2p=lambda n: 0.0, tp_allreduce=lambda n: 0.0, dp_gradients=lambda n: 5e-3)
    t_dp = run_timeline(build_pipeline(g, pp=2, microbatches=4, comm=comm))
    t_free = run_timeline(build_pipeline(g, pp=2, microbatches=4, comm=CommModel.free()))
    assert t_dp.step_time_s > t_free.step_time_s
    dp = [w for w in t_dp.windows if w.kind == "dp_collective"]
    assert dp and all(w.eligible_layers == () and w.microbatch == 3 for w in dp)


def test_schedule_orders() -> None:
    order = [[(a.kind, a.chunk, a.microbatch) for a in acts] for acts in compute_order("1f1b", 2, 3)]
    assert order[0] == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)]
    assert order[1] == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)]
    with pytest.raises(LynxConfigError, match="unknown schedule"):
        compute_order("zigzag", 2, 2)


def test_partition_balanced_with_edges_on_first_and_last() -> None:
    assert balanced_boundaries([1, 1, 1, 1, 1, 1], 3) == [(0, 2), (2, 4), (4, 6)]
    assert balanced_boundaries([1, 1, 1, 1], 2, head=2.0) == [(0, 1), (1, 4)]
    g = synthetic_graph(layers=8, heavy_post=20.0)
    chunks = partition_graph(g, pp=4)
    names = [[g.graph["blocks"][b]["name"] for b in c.blocks] for c in chunks]
    assert names[0][0] == "pre" and names[-1][-1] == "post"
    assert sum(len(c.layers) for c in chunks) == 8 and all(c.layers for c in chunks)
    assert len(chunks[-1].layers) < len(chunks[0].layers)  # the heavy head gets fewer layers


def test_more_stages_than_layers_is_refused() -> None:
    g = synthetic_graph(layers=3)
    with pytest.raises(LynxConfigError, match="only 3 layers"):
        partition_graph(g, pp=4)
    with pytest.raises(LynxConfigError, match="virtual_stages"):
        partition_graph(g, pp=2, virtual=2)


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1),
                                            ("zbh1", 3, 6, 1), ("interleaved1f1b", 2, 4, 2)])
def test_the_runtime_cost_is_charged_on_every_action_of_the_list(schedule: str, p: int, m: int, v: int) -> None:
    """Every action of a device's list — compute, send, receive — costs ``action_s`` more, in
    each of the four schedules: each device is busy that much longer per action (``runtime``
    segments), a compute action's right before its graphs; the step grows by at least the
    critical path's compute actions and by no more than all of the devices' charges."""
    plain = PipelineCosts.uniform(pp=p, microbatches=m, forward_s=1.0, backward_s=2.0, schedule=schedule, virtual=v)
    charged = dataclasses.replace(plain, action_s=0.25)
    t0, t1 = run_timeline(plain), run_timeline(charged)
    counts = [list_actions(schedule, p, m, s, virtual=v) for s in range(p)]
    # per chunk and microbatch an F and a B (and a W in zbh1); device 0 sends each forward on and
    # receives its gradient (+ SEND_F, RECV_B), and with 2 chunks a device receives each input and
    # sends each gradient of its second chunk too: 4 more per microbatch
    assert counts[0] == (3 if schedule == "zbh1" else 2) * m * v + 2 * m + (4 * m if v == 2 else 0)
    assert t1.busy_s == pytest.approx([b + n * 0.25 for b, n in zip(t0.busy_s, counts)])
    for s, n in enumerate(counts):
        runtime = sum(g.end - g.start for g in t1.segments if g.kind == "runtime" and g.device == s)
        assert runtime == pytest.approx(n * 0.25)
    compute_on_path = 2 * (m + p - 1) if v == 1 else 2 * p * v   # interleaved: microbatch 0 through every chunk
    assert t0.step_time_s + compute_on_path * 0.25 - 1e-9 <= t1.step_time_s <= t0.step_time_s + sum(counts) * 0.25
    for g in t1.segments:   # a compute action's own share is followed at once by its graphs
        if g.kind == "runtime" and g.label.endswith(" runtime"):
            assert any(h.device == g.device and h.kind in ("forward", "backward", "weight")
                       and h.start == pytest.approx(g.end) for h in t1.segments)


def test_build_pipeline_takes_the_runtime_cost_from_the_hardware() -> None:
    from lynx.planner.hardware import get_hardware

    spec = get_hardware("cpu-local").model_copy(update={"runtime_action_s": 3e-4})
    g = synthetic_graph(layers=4)
    assert build_pipeline(g, pp=2, microbatches=4, hardware=spec).action_s == 3e-4
    assert build_pipeline(g, pp=2, microbatches=4, hardware=get_hardware("cpu-local")).action_s == 0.0


def test_a_split_backward_sends_its_input_gradients_before_its_weight_part() -> None:
    """With ``grads_first`` (the runtime's default where nothing is recomputed on demand) a B on
    a chunk that sends gradients back posts them after its input-gradient part: the previous
    stage's backward starts a weight part earlier (pp 2: F 1, B 2 of which W 1, no link)."""
    from lynx.planner.timeline import Loads

    plain = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0)
    plain = dataclasses.replace(plain, costs=tuple(dataclasses.replace(c, backward_weight_s=1.0) for c in plain.costs))
    split = dataclasses.replace(plain, grads_first=True)
    t0, t1 = run_timeline(plain), run_timeline(split)
    b0 = [next(a for a in t.actions[0] if a.kind == "B" and a.microbatch == 0) for t in (t0, t1)]
    # device 1: F0 1-2, B0 2-4 (its input part ends at 3); device 0's B0 waited until 4, now 3
    assert (b0[0].start, b0[1].start) == (pytest.approx(4.0), pytest.approx(3.0))
    assert t1.busy_s == pytest.approx(t0.busy_s) and t1.step_time_s == pytest.approx(t0.step_time_s - 1.0)
    # a B that recomputes on demand runs whole (the runtime's unless_held): as without the split
    whole = run_timeline(split, Loads(on_demand={(1, j, 1): 0.0 + 1e-9 for j in range(4)}))
    assert whole.step_time_s == pytest.approx(t0.step_time_s, abs=1e-6)


def test_the_links_host_cost_is_charged_to_the_compute_a_message_overlaps() -> None:
    """``link_host_s_per_byte``: each message costs its two devices ``bytes × s/B`` times the share
    of its flight a compute action overlaps (pp 2, F 1 s, B 2 s, a 1 s link; 1000 B at 1 ms/B:
    1 s for a whole overlap); time a device waits absorbs it."""
    from lynx.planner.hardware import LinkSpec
    from lynx.planner.link_host import link_host_charges
    from lynx.planner.timeline import _Replay, Loads

    plain = PipelineCosts.uniform(pp=2, microbatches=2, forward_s=1.0, backward_s=2.0, p2p_s=1.0)
    charged = dataclasses.replace(plain, link_host_s_per_byte=1e-3, boundary_bytes=(1000,))
    replay = _Replay(charged, Loads(), record=False)
    replay.run_actions()
    charges = link_host_charges(replay)
    # device 0's F1 (1-2 s) sends while F0's activation flows (1-2 s: device 1 waits for it, no
    # charge); device 1's F0 (2-3 s) receives F1's, its F1 (5-6 s) sends B0's gradient, which
    # device 0 waits for (no charge)
    assert charges == {(0, "F", 0, 1): pytest.approx(1.0), (1, "F", 1, 0): pytest.approx(1.0),
                       (1, "F", 1, 1): pytest.approx(1.0)}
    t0, t1 = run_timeline(plain), run_timeline(charged)
    assert sum(t1.busy_s) == pytest.approx(sum(t0.busy_s) + sum(charges.values()))
    assert t1.step_time_s >= t0.step_time_s
    assert "host_s_per_byte" not in LinkSpec(alpha_s=0.0, beta_bytes_per_s=1e9).model_dump()   # as before


def test_messages_one_way_queue_on_their_link() -> None:
    """A device's messages to the same peer go one after another (one connection, in order): F1's
    activation, sent at 2 s while F0's (1-4 s) is still in flight, arrives at 7 s, not 5 s."""
    pipe = PipelineCosts.uniform(pp=2, microbatches=2, forward_s=1.0, backward_s=0.5, p2p_s=3.0)
    t = run_timeline(pipe)
    f1 = next(a for a in t.actions[1] if a.kind == "F" and a.microbatch == 1)
    assert (f1.arrival, f1.start) == (pytest.approx(7.0), pytest.approx(7.0))
    sends = sorted((g.start, g.end) for g in t.segments if g.kind == "send" and g.device == 0)
    assert sends[:2] == [(pytest.approx(1.0), pytest.approx(4.0)), (pytest.approx(4.0), pytest.approx(7.0))]


def test_a_token_bucket_link_slows_only_messages_sent_back_to_back() -> None:
    """GPipe, pp 2, forwards of 1 s and 2 s messages: activation 0 leaves at 1 on a rested link,
    activation 1 is sent at 2 but leaves at 3, right behind it, on an empty bucket (+burst); with
    forwards of 5 s the link rests 3 s between them, the bucket refills and nothing changes."""
    def arrivals(forward_s: float, burst_s: float) -> list[float]:
        pipe = PipelineCosts.uniform(pp=2, microbatches=2, forward_s=forward_s, backward_s=1.0, schedule="gpipe",
                                     p2p_s=2.0)
        t = run_timeline(dataclasses.replace(pipe, link_burst_s=burst_s))
        return [a.start for a in t.actions[1] if a.kind == "F"]

    assert arrivals(1.0, 0.0) == [3.0, 5.0]
    assert arrivals(1.0, 0.5) == [3.0, 5.5]
    assert arrivals(5.0, 0.5) == arrivals(5.0, 0.0) == [7.0, 12.0]
    from lynx.planner.hardware import LinkSpec
    from lynx.planner.problems import build_pipeline

    link = LinkSpec(alpha_s=0.0, beta_bytes_per_s=1e9, burst_s=0.25)
    assert "burst_s" not in LinkSpec(alpha_s=0.0, beta_bytes_per_s=1e9).model_dump()   # as before
    assert LinkSpec.model_validate(link.model_dump()) == link
    from lynx.planner.hardware import get_hardware

    hw = get_hardware("cpu-local")
    hw = hw.model_copy(update={"links": {**hw.links, "pp": link}})
    assert build_pipeline(synthetic_graph(layers=4), pp=2, microbatches=2, hardware=hw).link_burst_s == 0.25
