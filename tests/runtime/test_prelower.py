"""lynx.runtime.prelower: a rank's chunks lowered when its Pipeline is built, for the first step's signature.

Which received values need a gradient is found on fake tensors, without a message; the
multi-process worlds check every chunk of theirs was lowered when built and never again
(tests/runtime/test_user_pipeline.py). Here, on one process: a boundary that sends a float
value no parameter reaches (as Llama's rotary cos/sin) besides one that needs a gradient, and
an integer one; and what a chunk that cannot be lowered early is left to.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from lynx.frontend.joint import signature_of
from lynx.rewrite import build_stages
from lynx.rewrite.build import split_cached
from lynx.runtime import prelower
from lynx.runtime.prelower import lower_chunks, received_needs_grad
from lynx.runtime.step import as_received


class Sends(nn.Module):
    """Stage 0 computes ``h`` (needs a gradient), ``angles`` (float, from the input alone) and
    ``shifted`` (integer); stage 1 reads all three."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(8, 4), nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        angles = torch.sin(idx.float())
        shifted = idx + 1
        return (self.out(h) * angles.unsqueeze(-1)).sum() + shifted.sum()


@functools.lru_cache(maxsize=1)
def _captured():
    idx = torch.randint(0, 7, (2, 3))
    gm = torch.export.export(Sends(), (idx,), strict=False).module()
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    cut = ops.index(next(n for n in ops if n.startswith("linear")))
    return gm, [ops[:cut], ops[cut:]], idx


def _stages():
    """The split graphs (shared), fresh stage modules over them (nothing lowered), the example."""
    gm, split, idx = _captured()
    return split_cached(gm, split), build_stages(gm, split), {"idx": idx}


def test_received_flags_are_what_the_sender_returns(monkeypatch):
    parts, stages, examples = _stages()
    assert len(parts[1].spec.recv) == 3, parts[1].spec.recv
    flags = received_needs_grad(parts, examples, upto=1)
    # what stage 0 returns with autograd on, run eagerly (what AOTAutograd's traced outputs record)
    with torch.enable_grad():
        sent = parts[0].gm(examples["idx"])
    assert flags == {1: [bool(v.requires_grad) for v in sent]}
    assert sorted(flags[1]) == [False, False, True]   # h only: angles reads no parameter, shifted is integer
    # the receiver is lowered for the signature its first forward brings (step.as_received of those)
    asked = []
    monkeypatch.setattr(stages[1], "lowered", lambda *args: asked.append(signature_of(args)))
    assert lower_chunks({1: stages[1]}, parts, examples, torch.device("cpu")) == [1]
    assert asked == [signature_of(as_received(list(sent)))]


def test_a_chunk_that_cannot_be_lowered_early_is_left_to_its_first_forward(monkeypatch):
    parts, stages, examples = _stages()

    def fails(*args):
        raise RuntimeError("no trace")

    monkeypatch.setattr(stages[0], "lowered", fails)
    assert lower_chunks({0: stages[0]}, parts, examples, torch.device("cpu")) == []
    # receivers are left too when the graphs before them do not run on fake tensors
    monkeypatch.setattr(prelower.GraphRunner, "run", fails)
    assert received_needs_grad(parts, examples, upto=1) is None
    assert lower_chunks({1: stages[1]}, parts, examples, torch.device("cpu")) == [] and not stages[1]._lowered
