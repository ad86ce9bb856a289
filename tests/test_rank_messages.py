"""The order a rank hands its messages to gloo (``lynx.runtime.rank_messages``), without a process group."""

from __future__ import annotations

import torch

import lynx.runtime.rank_messages as rm
from lynx.planner.schedule import Action, Op
from lynx.runtime.p2p import BoundaryMeta
from lynx.runtime.stats import StepStats
from lynx.runtime.step import InFlight


class _Ranks(rm.RankMessages):
    def __init__(self) -> None:
        meta = [BoundaryMeta("h", (2, 3), torch.float32)]
        self.recv_meta, self.send_meta = {0: [], 1: meta}, {0: meta, 1: []}
        self.send_flags, self.recv_flags, self._watched = {}, {}, set()
        self.device = torch.device("cpu")
        self.config = type("Config", (), {"trace": False, "virtual": 1})()

    def _rank_of(self, chunk: int) -> int:
        return chunk


def test_a_first_gradient_receive_waits_for_the_send_that_says_what_comes_back(monkeypatch):
    """The list posts RECV_B before SEND_F; in the runner's first step which sent values get a
    gradient is learnt from that send, so the receive goes out right after the flags, before the
    activation (and from then on where the list puts it)."""
    posted = []
    monkeypatch.setattr(rm, "post_recv", lambda metas, peer, tag, device, only=None, watch=True:
                        posted.append(("recv", tag, tuple(only))) or ([], []))
    monkeypatch.setattr(rm, "post_send", lambda tensors, peer, tag: posted.append(("send", tag)) or ([], []))
    ranks = _Ranks()
    state = rm.StepState(stats=StepStats(rank=0, stage=0, dp_rank=0), start=0.0)
    out = torch.ones(2, 3, requires_grad=True) * 2
    for j in (0, 1):
        state.flights[(0, j)] = InFlight(received=[], output=[out])
        ranks._post_recv_grad(state, Action(Op.RECV_GRAD, 0, j))
        ranks._send_act(state, Action(Op.SEND_ACT, 0, j))
    flags, grad0, act0, grad1, act1 = posted
    assert flags[0] == "send" and flags[1] == rm.flags_tag(0)
    assert grad0 == ("recv", rm.message_tag(Op.RECV_GRAD, 0, 0), (True,))
    assert act0 == ("send", rm.message_tag(Op.SEND_ACT, 0, 0))
    assert grad1 == ("recv", rm.message_tag(Op.RECV_GRAD, 0, 1), (True,)) and act1[0] == "send"
    assert not state.unflagged
