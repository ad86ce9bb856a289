"""The rewritten stages drop saved tensors and recompute them with bitwise-identical gradients."""

from __future__ import annotations

import random

import pytest
import torch

from lynx.frontend.capture import capture
from lynx.errors import LynxConfigError, LynxPlanError
from lynx.models import build_preset
from lynx.rewrite import build_stage_module, build_stages
from lynx.rewrite.split import op_nodes
from lynx.testing import run_local

MICROBATCHES = 2


def _gpt2_from_config():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")

    class LMLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = GPT2LMHeadModel(cfg)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=input_ids, labels=labels).loss

    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))  # (B, T)
    return LMLoss(), (ids, ids)


def _model(name: str):
    torch.manual_seed(0)
    if name == "gpt2-hf":
        return _gpt2_from_config()
    return build_preset(name, device="cpu", seq=16, **({"dropout": 0.1} if name.startswith("gpt") else {}))


_CACHE: dict = {}


def _setup(name: str):
    if name not in _CACHE:
        model, inputs = _model(name)
        model.train()
        captured = capture(model, inputs)
        batch = dict(zip(captured.input_names, inputs))
        _CACHE[name] = (model, inputs, captured, batch)
    return _CACHE[name]


def _reference(model, inputs) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The original module, eager, one microbatch after the other."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    losses = []
    for _ in range(MICROBATCHES):
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _rewritten(model, captured, batch, stage_nodes, dropped, *, prefetch=None):
    model.zero_grad(set_to_none=True)
    stages = build_stages(captured.gm, stage_nodes, dropped)
    torch.manual_seed(1234)
    losses = run_local(stages, [batch] * MICROBATCHES, schedule="sequential", prefetch=prefetch)
    return stages, losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _drop_sets(names: list[str]) -> dict[str, set[str]]:
    rng = random.Random(0)
    kinds = sorted({n.rstrip("0123456789_") for n in names})
    return {
        "none": set(),
        "all": set(names),
        "alternate": set(names[::2]),
        "random-half": {n for n in names if rng.random() < 0.5},
        # one op kind dropped at a time, all kinds covered across the union of runs
        "kinds-a": {n for n in names if kinds.index(n.rstrip("0123456789_")) % 2 == 0},
        "kinds-b": {n for n in names if kinds.index(n.rstrip("0123456789_")) % 2 == 1},
    }


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt2-hf"])
def test_gradients_bitwise_equal_for_hand_made_drop_sets(name: str) -> None:
    model, inputs, captured, batch = _setup(name)
    ref_losses, ref_grads = _reference(model, inputs)
    names = [n.name for n in op_nodes(captured.gm)]
    half = len(names) // 2
    runs = [("none", [names])] + [(d, [names[:half], names[half:]]) for d in ("all", "kinds-a")]
    drop_sets = _drop_sets(names)
    for drop_name, stage_nodes in runs:
            drop, split_name = drop_sets[drop_name], f"{len(stage_nodes)} stage(s)"
            dropped = [drop & set(nodes) for nodes in stage_nodes]
            # even microbatches: everything prefetched before B; odd ones: all on demand
            def prefetch(s, j, dropped=dropped, stage_nodes=stage_nodes):
                return [[n for n in stage_nodes[s] if n in dropped[s]]] if j % 2 == 0 else []

            stages, losses, grads = _rewritten(model, captured, batch, stage_nodes, dropped, prefetch=prefetch)
            where = f"{name}, drop {drop_name}, {split_name}"
            assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses)), where
            differ = [k for k in ref_grads if not torch.equal(ref_grads[k], grads[k])]
            assert not differ, f"{where}: gradients differ for {differ[:4]}"
            if drop:
                assert sum(s.meter.peak_bytes for s in stages) > 0


def test_dropping_saves_memory_and_cache_is_freed() -> None:
    model, inputs, captured, batch = _setup("gpt-tiny")
    names = [n.name for n in op_nodes(captured.gm)]
    keep, = build_stages(captured.gm, [names], [set()])
    drop, = build_stages(captured.gm, [names], [set(names[:-4])])  # keep only the head's last ops
    for stage in (keep, drop):
        torch.manual_seed(0)
        out = stage(*[batch[n] for n in stage.spec.inputs], microbatch=0)
        stage.forward_live = stage.meter.live_by.get("stage", 0)
        state = stage._states[0]
        assert len(state.slots) == stage.lowered(*[batch[n] for n in stage.spec.inputs]).n_slots
        out.backward()
        assert state.slots is None, "the microbatch's values outlived its backward"
        stage.release(0)
        del out, state
        assert stage.meter.live_by.get("stage", 0) == 0 and stage.meter.live_by.get("held", 0) == 0
    assert drop.forward_live < keep.forward_live / 4
    # what the backward graph recomputes on demand rises above what the forward kept
    assert drop.meter.peak_by["stage"] > drop.forward_live


def test_backward_frees_what_it_no_longer_needs() -> None:
    """The backward graph takes its inputs boxed: each is released after its last reader."""
    model, inputs, captured, batch = _setup("gpt-tiny")
    names = [n.name for n in op_nodes(captured.gm)]
    stage, = build_stages(captured.gm, [names], [set()])
    args = [batch[n] for n in stage.spec.inputs]
    graph = stage.lowered(*args).backward_graph(frozenset())
    assert "args_list.clear()" in graph.gm.code
    assert graph.extra_peak_bytes == 0 and not graph.nodes   # nothing dropped: nothing comes back


def test_prefetched_nodes_are_not_recomputed_again() -> None:
    model, inputs, captured, batch = _setup("gpt-tiny")
    names = [n.name for n in op_nodes(captured.gm)]
    dropped = set(names[10:40])
    stage, = build_stages(captured.gm, [names], [dropped])
    out = stage(*[batch[n] for n in stage.spec.inputs], microbatch=3)
    stage.recompute(3, [n for n in names if n in dropped])
    out.backward()
    stats = stage.release(3)
    assert stats.prefetch_nodes > 0 and stats.on_demand_nodes == 0
    assert stats.prefetch_s > 0


def test_bad_requests_are_named() -> None:
    model, inputs, captured, batch = _setup("gpt-tiny")
    names = [n.name for n in op_nodes(captured.gm)]
    with pytest.raises(LynxPlanError, match="not in this stage"):
        build_stages(captured.gm, [names[:50], names[50:]], [{names[60]}, set()])
    with pytest.raises(LynxPlanError, match="later stage"):
        build_stages(captured.gm, [names[50:], names[:50]])

    class FakeCompiled:  # just what build_stage_module reads
        class plan:  # noqa: N801
            stages = [object(), object()]

    with pytest.raises(LynxConfigError, match="out of range.*0..1"):
        build_stage_module(FakeCompiled, 2)
    with pytest.raises(LynxConfigError, match="out of range"):
        build_stage_module(FakeCompiled, -1)


def test_stage_shares_original_parameters() -> None:
    model, inputs, captured, batch = _setup("gpt-tiny")
    names = [n.name for n in op_nodes(captured.gm)]
    stages = build_stages(captured.gm, [names[:60], names[60:]])
    original = {id(p) for p in model.parameters()}
    for stage in stages:
        params = list(stage.parameters())
        assert params and all(id(p) in original for p in params)
    assert {id(p) for s in stages for p in s.parameters()} == original
