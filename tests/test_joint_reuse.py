"""A one-stage pipeline takes the profile's joint trace (lynx.frontend.joint_reuse) only where a
trace of its own would give the same graph: the same code as a fresh trace, gradients bitwise
eager's (dropout on), and a trace of its own for other input shapes or a joint graph holding a
tensor constant (one lifted while profiling would be fake)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lynx.frontend.joint as joint_mod
import lynx.frontend.joint_reuse as reuse
from lynx.frontend.capture import capture
from lynx.frontend.profile import profile
from lynx.rewrite import build_stages
from lynx.rewrite.split import op_nodes
from lynx.testing import run_local


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.drop = nn.LayerNorm(dim), nn.Dropout(0.2)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(F.gelu(self.up(self.norm(x)))))   # (B, T, C)


class Net(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.fixture(scope="module")
def profiled_net():
    """Net captured and profiled (its joint graph traced on fake tensors), and its one-stage split
    dropping the dropouts' and GELUs' outputs (recomputed in the backward)."""
    torch.manual_seed(0)
    model, inputs = Net(), (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    captured = capture(model, inputs)
    profile(captured, target="cpu")
    names = [n.name for n in op_nodes(captured.gm)]
    (stage,) = build_stages(captured.gm, [names], [frozenset(n for n in names if "gelu" in n or "dropout" in n)])
    return model, inputs, captured, stage


def test_a_one_stage_pipeline_reuses_the_profile_trace_bitwise(monkeypatch, profiled_net) -> None:
    model, inputs, captured, stage = profiled_net
    profiled = captured.gm.meta["lynx_profile_joint"][2]
    traces = []
    real = joint_mod._trace
    monkeypatch.setattr(joint_mod, "_trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    assert stage.dropped and stage.lowered(*inputs).joint is profiled and not traces
    fresh = real(stage.gm, list(inputs))
    assert (fresh.gm.code, fresh.origin, fresh.attr_names) == (profiled.gm.code, profiled.origin, profiled.attr_names)
    batch = dict(zip(captured.input_names, inputs))
    torch.manual_seed(3)
    ref = [model(*inputs) for _ in range(2)]
    for loss in ref:
        loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    losses = run_local([stage], [batch] * 2, schedule="sequential")
    assert all(torch.equal(a, b.detach()) for a, b in zip(losses, ref))
    assert all(torch.equal(p.grad, want[n]) for n, p in model.named_parameters())


def test_other_shapes_and_tensor_constants_trace_anew(monkeypatch, profiled_net) -> None:
    _model, inputs, captured, stage = profiled_net
    other = [torch.randint(0, 32, (1, 8)), torch.randint(0, 32, (1, 8))]
    assert reuse.reusable(stage.gm, other) is None and reuse.reusable(stage.gm, list(inputs)) is not None
    gm = captured.gm
    arg_sig, attr_sig, joint = gm.meta["lynx_profile_joint"]
    graph = fx.Graph()
    result = graph.graph_copy(joint.gm.graph, {})
    graph.get_attr("_tensor_constant0")   # what a constant lifted while profiling would be
    graph.output(result)
    lifted = joint_mod.JointGraph(**{**joint.__dict__, "gm": fx.GraphModule({"_tensor_constant0": torch.ones(1)},
                                                                            graph)})
    monkeypatch.setitem(gm.meta, "lynx_profile_joint", (arg_sig, attr_sig, lifted))
    assert reuse.reusable(stage.gm, list(inputs)) is None
    # a program of its own (not the whole graph's) is never a candidate
    assert not reuse.same_program(gm, fx.symbolic_trace(Net()))
