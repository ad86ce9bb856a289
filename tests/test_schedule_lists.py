"""The one schedule definition: typed per-device action lists for every schedule, replayed by the
timeline and executed by the runtime (tests/runtime/test_user_pipeline.py runs them)."""

from __future__ import annotations

import pytest

from lynx.errors import LynxConfigError
from lynx.planner.schedule import (SCHEDULES, Op, compute_order, link_order_problems, max_in_flight, message_tag,
                                   rank_actions)
from lynx.planner.timeline import PipelineCosts, run_timeline
from lynx.planner.windows import WindowId

CASES = [("1f1b", 1), ("gpipe", 1), ("interleaved1f1b", 2), ("zbh1", 1)]


@pytest.mark.parametrize("schedule,virtual", CASES)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_every_device_list_is_complete_and_replays(schedule, virtual, pp, m):
    lists = rank_actions(schedule, pp, m, virtual)
    chunks = pp * virtual
    for device, acts in enumerate(lists):
        mine = [c for c in range(chunks) if c % pp == device]
        compute = [(a.op, a.chunk, a.microbatch) for a in acts if a.is_compute]
        backward = Op.BACKWARD if schedule != "zbh1" else Op.BACKWARD_INPUT
        for c in mine:
            for j in range(m):
                assert compute.count((Op.FORWARD, c, j)) == 1 and compute.count((backward, c, j)) == 1
                if schedule == "zbh1":   # the weight part after its input part
                    assert compute.index((Op.BACKWARD_WEIGHT, c, j)) > compute.index((backward, c, j))
        # a receive is posted before the action that waits on it; a window right before that action
        for i, a in enumerate(acts):
            if a.op is Op.FORWARD and a.chunk > 0:
                posts = [k for k, b in enumerate(acts)
                         if b.op is Op.RECV_ACT and (b.chunk, b.microbatch) == (a.chunk, a.microbatch)]
                assert posts and posts[0] < i
                assert acts[i - 1].op is Op.RECOMPUTE or acts[i - 2].op is Op.RECOMPUTE
            if a.op is Op.RECOMPUTE:
                assert a.window.device == device and (a.window.chunk is not None) == (virtual > 1)
        assert acts[-1].op is Op.OPTIMIZER
        assert sum(a.op is Op.DP_LAUNCH for a in acts) == len(mine)
    t = run_timeline(PipelineCosts.uniform(pp=pp, microbatches=m, forward_s=1.0, backward_s=2.0, schedule=schedule,
                                           virtual=virtual))
    assert t.step_time_s > 0


def test_zero_bubble_defers_weights_by_the_device_index():
    order = [[str(a) for a in acts] for acts in compute_order("zbh1", pp=3, microbatches=4)]
    assert order[0] == ["F0", "F1", "F2", "I0", "W0", "F3", "I1", "W1", "I2", "W2", "I3", "W3"]
    assert order[2] == ["F0", "I0", "F1", "I1", "F2", "I2", "W0", "F3", "I3", "W1", "W2", "W3"]
    # a microbatch is held until its W: the last device holds 3 where 1F1B holds 1
    assert [max_in_flight("zbh1", stage=s, stages=3, microbatches=4) for s in range(3)] == [3, 3, 3]
    assert [max_in_flight("1f1b", stage=s, stages=3, microbatches=4) for s in range(3)] == [3, 2, 1]


def test_zero_bubble_beats_1f1b_on_the_timeline_when_weights_fill_the_bubble():
    def step(schedule):
        pipe = PipelineCosts.uniform(pp=4, microbatches=8, forward_s=1.0, backward_s=2.0, schedule=schedule)
        costs = tuple(c.__class__(**{**c.__dict__, "backward_weight_s": 1.0}) for c in pipe.costs)
        return run_timeline(pipe.__class__(**{**pipe.__dict__, "costs": costs})).step_time_s

    assert step("zbh1") < step("1f1b") == (8 + 4 - 1) * 3.0


def test_message_tags_are_unique_and_nccl_order_is_checked():
    tags = {message_tag(op, b, j) for op in (Op.SEND_ACT, Op.SEND_GRAD) for b in range(8) for j in range(64)}
    assert len(tags) == 2 * 8 * 64
    assert message_tag(Op.SEND_ACT, 3, 5) == message_tag(Op.RECV_ACT, 3, 5)
    for schedule, virtual in CASES:
        problems = link_order_problems(rank_actions(schedule, 2, 4, virtual), 2)
        assert bool(problems) == (schedule == "interleaved1f1b"), (schedule, problems)


def test_window_ids_are_typed_and_round_trip():
    for text in ("s0.recv_grad.mb3", "s2.recv_act.c6.mb1", "s1.tp.l5.b.mb0", "s0.dp.b2"):
        w = WindowId.parse(text)
        assert str(w) == text and WindowId.parse(str(w)) == w and hash(w) == hash(WindowId.parse(text))
    assert WindowId.recv(0, "recv_grad", 3) != "s0.recv_grad.mb3"   # a value, not its text
    with pytest.raises(LynxConfigError, match="not a Lynx window id"):
        WindowId.parse("s0.recv_grad")
    with pytest.raises(LynxConfigError, match="unknown schedule"):
        rank_actions("zbv", 2, 4)
    assert set(SCHEDULES) == {"1f1b", "gpipe", "interleaved1f1b", "zbh1"}


@pytest.mark.parametrize("schedule,virtual", CASES)
@pytest.mark.parametrize("pp", [2, 4])
def test_receives_are_posted_before_the_sends_beside_them(schedule, virtual, pp):
    """gloo writes a message once the receiver's ready notice is in, and the notice queues behind
    the receiver's own outgoing bytes: no receive follows a send of its gap, an activation receive
    goes out before the compute action ahead of the previous receiving forward (a backward sends
    its input gradients inside it), and no more than two activation receives await their forward."""
    sends, recvs = (Op.SEND_ACT, Op.SEND_GRAD), (Op.RECV_ACT, Op.RECV_GRAD)
    for acts in rank_actions(schedule, pp, 8, virtual):
        gap, awaited = [], 0
        for a in acts:
            if a.is_compute:
                gap = []
                awaited -= a.op is Op.FORWARD and any(b.op is Op.RECV_ACT and (b.chunk, b.microbatch)
                                                      == (a.chunk, a.microbatch) for b in acts)
                continue
            assert not (a.op in recvs and any(b.op in sends for b in gap)), acts
            gap.append(a)
            awaited += a.op is Op.RECV_ACT
            assert awaited <= 2
    stage1 = [str(a) for a in rank_actions("1f1b", 2, 4)[1]]
    assert stage1.index("RECV_F2") < stage1.index("B0") and stage1.index("RECV_F3") < stage1.index("B1")
