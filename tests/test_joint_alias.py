"""Outputs aliasing an input (lynx.frontend.joint): an input returned as it is is cloned in the
first trace (``passed_through``), so a stage forwarding its inputs (an interleaved Llama chunk
passing on the mask and rotary tables) is traced once; any other aliasing output still costs a
second trace. Either way the joint graph is the one the two-trace rule (trace, then trace again
cloning every aliasing output) gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lynx.frontend.joint as joint_mod
from lynx.frontend.joint import passed_through, trace_joint


class PassOn(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.lin, self.view = nn.Linear(4, 4), view

    def forward(self, x, mask, cos):
        h = self.lin(x) + mask
        if self.view:  # a view of an input and one of an intermediate also returned
            return h, mask, cos, cos[:1], h.t()
        return h, mask, cos


def _graph(view: bool):
    args = (torch.randn(2, 4, requires_grad=True), torch.randn(2, 4), torch.randn(2, 4))
    gm = torch.export.export(PassOn(view), args, strict=False).module()
    return gm, list(args)


@pytest.mark.parametrize("view, traces, cloned", [(False, 1, [1, 2]), (True, 2, [1, 2, 3, 4])])
def test_passed_through_inputs_are_cloned_in_the_first_trace(monkeypatch, view, traces, cloned) -> None:
    gm, args = _graph(view)
    assert passed_through(gm, args) == frozenset({1, 2})
    calls = []
    real = joint_mod.aot_export_joint
    monkeypatch.setattr(joint_mod, "aot_export_joint", lambda *a, **k: calls.append(1) or real(*a, **k))
    once = trace_joint(gm, args)
    assert len(calls) == traces and once.cloned_outputs == cloned
    # the two-trace rule, on a fresh capture: the same joint graph
    gm2, args2 = _graph(view)
    monkeypatch.setattr(joint_mod, "passed_through", lambda *a: frozenset())
    twice = trace_joint(gm2, args2)
    assert len(calls) == traces + 2
    assert twice.cloned_outputs == once.cloned_outputs and twice.gm.code == once.gm.code
    assert twice.out_requires_grad == once.out_requires_grad and twice.origin == once.origin
