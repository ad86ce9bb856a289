"""Ranks sharing a CPU's cores: the timeline re-timed as processor sharing, against hand-computed steps."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.planner.core_sharing import CoreSharing, bar_work
from lynx.planner.hardware import get_hardware, share_cores
from lynx.planner.problems import build_pipeline
from lynx.planner.synthetic import synthetic_graph
from lynx.planner.timeline import Loads, PipelineCosts, run_timeline
from lynx.viz import timeline_bars

# pp 2 × tp 2 = 4 ranks on 2 cores: with both stages busy each rank has half a core (the spec's
# static share, speed 1); a stage busy alone has a core per rank (speed 2)
FOUR_ON_TWO = CoreSharing(ranks=4, cores=2, per_device=2)


def _shared(pipe: PipelineCosts, sharing: CoreSharing = FOUR_ON_TWO) -> PipelineCosts:
    return dataclasses.replace(pipe, cores=sharing)


def _uniform(**kw) -> PipelineCosts:
    return PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0, **kw)


def test_speed_is_the_busy_ranks_share_relative_to_the_static_one() -> None:
    assert [FOUR_ON_TWO.speed(n) for n in (1, 2)] == [2.0, 1.0]
    # 8 ranks (pp 4 × tp 2) on 2 cores: a lone stage's 2 ranks get a core each (4 × the static quarter)
    eight = CoreSharing(ranks=8, cores=2, per_device=2)
    assert [eight.speed(n) for n in (1, 2, 3, 4)] == [4.0, 2.0, pytest.approx(4 / 3), 1.0]


def test_1f1b_two_stages_hand_computed() -> None:
    """F = 1, B = 2 at the static share, m = 4: 15 s static; shared, stage 0's first forward and
    stage 1's first backward run alone at twice the speed, and so do the last two backwards."""
    static, shared = run_timeline(_uniform()), run_timeline(_shared(_uniform()))
    assert static.step_time_s == 15.0
    assert shared.step_time_s == pytest.approx(12.0)   # work-conserving: 2 × 12 s of work on 2 stages' worth
    assert shared.device_end_s == pytest.approx([12.0, 11.0])
    times = [[(f"{a.kind}{a.microbatch}", a.start, a.end) for a in acts] for acts in shared.actions]
    assert times[0] == [("F0", 0.0, 0.5), ("F1", 0.5, 1.5), ("B0", 2.5, 4.5), ("F2", 4.5, 5.5), ("B1", 5.5, 7.5),
                        ("F3", 7.5, 8.5), ("B2", 8.5, 10.5), ("B3", 11.0, 12.0)]
    assert times[1] == [("F0", 0.5, 1.5), ("B0", 1.5, 2.5), ("F1", 2.5, 3.5), ("B1", 3.5, 5.5), ("F2", 5.5, 6.5),
                        ("B2", 6.5, 8.5), ("F3", 8.5, 9.5), ("B3", 9.5, 11.0)]
    # stage 0 waits 1.5-2.5 for B0's gradient: busy there, it would share with stage 1 (speed 1)
    # and do 1 s of work; 10.5-11.0 likewise, 0.5 s
    windows = {str(w.id): (w.start, w.capacity_s) for w in shared.windows if w.capacity_s > 0}
    assert windows == {"s0.recv_grad.mb0": (1.5, 1.0), "s0.recv_grad.mb3": (10.5, 0.5)}
    assert shared.busy_s == pytest.approx([10.5, 10.5])   # 12 s of work each, part of it at twice the speed


@pytest.mark.parametrize("load,arrival,start,hidden,exposed", [(1.5, 3.25, 3.25, 1.5, 0.0), (4.0, 3.5, 5.5, 2.0, 2.0)])
def test_recomputation_in_a_window_slows_the_other_stage(load: float, arrival: float, start: float, hidden: float,
                                                          exposed: float) -> None:
    """Stage 0 recomputes from 1.5 while stage 1 runs B0 (both at speed 1). 1.5 s: done at 3.0,
    then stage 1 finishes B0 alone (0.5 s of work at speed 2): B0's gradient arrives at 3.25, the
    window held 1.75 s of work, all hidden. 4 s: stage 1's B0 ends at 3.5 (the window's 2 s of
    work), F1 and B1 follow beside the rest of the recomputation, which ends at 5.5: 2 s exposed."""
    t = run_timeline(_shared(_uniform()), Loads(window={"s0.recv_grad.mb0": load}))
    b0 = next(a for a in t.actions[0] if (a.kind, a.microbatch) == ("B", 0))
    assert (b0.ready, b0.arrival, b0.start) == pytest.approx((1.5, arrival, start))
    assert (t.hidden_recompute_s[0], t.exposed_recompute_s[0]) == pytest.approx((hidden, exposed))
    assert t.window("s0.recv_grad.mb0").capacity_s == pytest.approx(1.75 if load < 2 else 2.0)


def test_every_rank_busy_keeps_the_static_timeline() -> None:
    """A sharing no count of busy stages changes (one stage's ranks fill the cores) is none."""
    cpu = get_hardware("cpu-local")
    assert CoreSharing.from_hardware(share_cores(cpu, ranks=4, cores=2), pp=1, tp=4, dp=1) is None
    assert CoreSharing.from_hardware(share_cores(cpu, ranks=2, cores=2), pp=2, tp=1, dp=1) is None
    assert CoreSharing.from_hardware(get_hardware("h100-sxm"), pp=4, tp=2, dp=1) is None
    assert CoreSharing.from_hardware(share_cores(cpu, ranks=4, cores=2), pp=2, tp=2, dp=1) == FOUR_ON_TWO
    # a sharing with speed 1 at every count of busy stages replays as the static timeline does
    same = CoreSharing(ranks=4, cores=4, per_device=2)
    pipe = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0, tp_s=0.25)
    a, b = run_timeline(pipe), run_timeline(_shared(pipe, same))
    assert b.step_time_s == pytest.approx(a.step_time_s)
    assert [w.capacity_s for w in b.windows if w.capacity_s > 0] == pytest.approx(
        [w.capacity_s for w in a.windows if w.capacity_s > 0])


def test_build_pipeline_takes_the_sharing_from_the_spec() -> None:
    g = synthetic_graph(layers=4, seq=64, hidden=64, heads=4)
    cpu = get_hardware("cpu-local")
    shared = build_pipeline(g, pp=2, tp=2, microbatches=4, hardware=share_cores(cpu, ranks=4, cores=2))
    assert shared.cores == FOUR_ON_TWO
    assert build_pipeline(g, pp=2, tp=2, microbatches=4, hardware=cpu).cores is None
    assert share_cores(cpu, ranks=4, cores=2).core_share.model_dump() == {"ranks": 4, "cores": 2}
    assert "core_share" not in get_hardware("h100-sxm").model_dump()   # GPU specs record as before


@pytest.mark.parametrize("schedule,p,v", [("1f1b", 2, 1), ("1f1b", 4, 1), ("gpipe", 3, 1),
                                          ("interleaved1f1b", 2, 2), ("zbh1", 3, 1)])
def test_shared_replay_conserves_work_and_order(schedule: str, p: int, v: int) -> None:
    """Every action after its input, each device's actions in order without overlap, the step no
    shorter than all work on all cores and no longer than the static step."""
    pipe = PipelineCosts.uniform(pp=p, microbatches=2 * p, forward_s=1.0, backward_s=2.0, schedule=schedule,
                                 p2p_s=0.1, tp_s=0.3, virtual=v)
    sharing = CoreSharing(ranks=2 * p, cores=2, per_device=2)
    static, shared = run_timeline(pipe), run_timeline(_shared(pipe, sharing))
    work = sum(sum(a.end - a.start for a in acts) for acts in static.actions)
    assert shared.step_time_s >= work / p - 1e-9   # the cores deliver p stages' worth of static shares
    assert shared.step_time_s <= static.step_time_s + 1e-9
    for acts in shared.actions:
        for a, b in zip(acts, acts[1:]):
            assert a.end <= b.start + 1e-9
        for a in acts:
            assert a.start >= a.arrival - 1e-9 and a.ready <= a.start + 1e-9
    # the drawing agrees: per device, busy segments never overlap and end by the device's end
    for s in range(p):
        busy = sorted((g.start, g.end) for g in shared.segments
                      if g.device == s and g.kind in ("forward", "backward", "weight", "tp", "recompute"))
        assert all(x[1] <= y[0] + 1e-9 for x, y in zip(busy, busy[1:]))
        assert busy[-1][1] <= shared.device_end_s[s] + 1e-9
    # tp windows keep their capacity (host work, its seconds at the static share)
    assert {w.capacity_s for w in shared.windows if w.kind == "tp_allreduce"} == {0.3}


def test_data_parallel_exchange_and_optimizer_after_the_shared_step() -> None:
    pipe = _uniform()
    costs = tuple(dataclasses.replace(c, dp_s=1.0) for c in pipe.costs)
    pipe = dataclasses.replace(pipe, costs=costs, optimizer_s=(0.5, 0.5))
    t = run_timeline(_shared(pipe))
    # stage 1's last backward ends at 11.0 and stage 0's, alone, at 12.0 (as without dp); each
    # exchanges its block's gradients for 1 s (idle: the dp link is not host-shared), then steps
    # its optimizer alone: 0.5 s of work at speed 2
    dp = {s: [(g.start, g.end) for g in t.segments if g.kind == "dp" and g.device == s] for s in (0, 1)}
    assert dp[1] == [pytest.approx((11.0, 12.0))] and dp[0] == [pytest.approx((12.0, 13.0))]
    assert t.device_end_s == pytest.approx([13.25, 12.25])
    assert [w.kind for w in t.windows if w.kind == "dp_collective"] == ["dp_collective"] * 2


def test_bar_work_weighs_each_second_by_the_speed_then() -> None:
    shared = run_timeline(_shared(_uniform()))
    bars = timeline_bars(shared)
    # 12 s of work per stage (4 × (1 + 2)); without the sharing, the bars' wall seconds
    assert [bar_work(bars, s, ("compute",), FOUR_ON_TWO) for s in (0, 1)] == pytest.approx([12.0, 12.0])
    assert bar_work(bars, 0, ("compute",), None) == pytest.approx(10.5)
