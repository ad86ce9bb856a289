"""What lynx.runtime.Pipeline and lynx.compile check before anything runs (one process, no group)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import lynx
from lynx.errors import LynxConfigError
from lynx.runtime.batching import bind_inputs, check_microbatch, match_layout, split_rows
from lynx.runtime.loss import find_loss

sys.path.insert(0, str(Path(__file__).parent))
import user_models as um  # noqa: E402


class LogitsOnly(um.TupleLM):
    def forward(self, idx, targets):
        return super().forward(idx, targets)[0]


def _compile(model, example, **kw):
    settings = dict(pp=2, microbatches=2, solver="none", hardware="cpu-local", memory_budget="1GiB")
    return lynx.compile(model, example, **{**settings, **kw})


def test_loss_forms_found_in_the_output():
    logits, loss = torch.zeros(2, 4), torch.tensor(0.5)
    assert find_loss(loss).form == "scalar"
    assert find_loss((logits, loss)).index == 1
    assert find_loss([logits, loss, torch.tensor(2.0)]).index == 1   # the first scalar
    spec = find_loss(logits)
    assert spec.form is None and "Tensor(2, 4) float32, which holds no loss" in spec.description
    with pytest.raises(LynxConfigError, match="holds no loss"):
        spec(logits)
    with pytest.raises(LynxConfigError, match="loss_fn must be callable"):
        find_loss(logits, loss_fn=3)
    by_fn = find_loss(logits, loss_fn=lambda out, target: (out - target).square().mean())
    assert float(by_fn(logits, (torch.ones(2, 4),))) == 1.0


def test_compile_says_which_form_is_the_loss():
    model, example = um.build("tuple")
    assert _compile(model, example).loss.description == (
        "the model returns tuple(Tensor(2, 8, 64) float32, Tensor() float32): the loss is element 1, its first scalar")
    no_loss = _compile(LogitsOnly(), example).loss
    assert no_loss.form is None and "pass loss_fn=" in no_loss.description
    with pytest.raises(LynxConfigError, match="loss_fn must be callable"):
        _compile(model, example, loss_fn="cross_entropy")
    with_fn = _compile(LogitsOnly(), example, loss_fn=torch.nn.functional.cross_entropy).loss
    assert with_fn.form == "loss_fn" and "cross_entropy" in with_fn.description


def test_pipeline_refuses_a_model_without_a_loss_before_joining_a_job():
    model, example = um.build("tuple")
    with pytest.raises(LynxConfigError, match="cannot train: the model returns Tensor"):
        lynx.runtime.Pipeline(_compile(LogitsOnly(), example))


def test_pipeline_outside_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, example = um.build("tuple")
    with pytest.raises(LynxConfigError, match="torchrun --nproc_per_node 2"):
        lynx.runtime.Pipeline(_compile(model, example))


def test_the_same_tensor_twice_stays_two_inputs():
    model, (idx, _) = um.build("tuple")
    compiled = _compile(model, (idx, idx))
    stages = [compiled.stage(i).spec.inputs for i in range(2)]
    assert stages == [["idx"], ["targets"]]


def test_keyword_example_inputs_name_the_graph_inputs():
    pytest.importorskip("transformers")
    model, example = um.build("qwen2")
    compiled = _compile(model, example)
    assert compiled.analysis.captured.input_names == ["input_ids", "labels"]
    assert compiled.loss.form == "attribute"


def test_batches_are_split_per_replica_and_checked():
    names = ["idx", "targets"]
    assert bind_inputs(names, (1,), {"targets": 2}) == {"idx": 1, "targets": 2}
    with pytest.raises(LynxConfigError, match="does not take; its inputs are idx, targets"):
        bind_inputs(names, (), {"labels": 1})
    with pytest.raises(LynxConfigError, match="both by position and by keyword"):
        bind_inputs(names, (1,), {"idx": 1})
    batch = torch.arange(24).reshape(12, 2)                   # (dp 2 × m 3 × b 2, 2)
    parts = split_rows(batch, "idx", dp=2, dp_rank=1, microbatches=3)
    assert [p[:, 0].tolist() for p in parts] == [[12, 14], [16, 18], [20, 22]]
    with pytest.raises(LynxConfigError, match="not a multiple of dp × microbatches = 2 × 4 = 8"):
        split_rows(batch, "idx", dp=2, dp_rank=0, microbatches=4)
    with pytest.raises(LynxConfigError, match=r"a step takes 12 rows \(dp 2 × 3 microbatches × 2\)"):
        check_microbatch(torch.zeros(3, 2, dtype=torch.long), "idx", torch.zeros(2, 2, dtype=torch.long),
                         dp=2, microbatches=3)
    sliced = torch.arange(18).reshape(6, 3)[:, 1:]             # a loader's non-contiguous slice
    assert match_layout(sliced, torch.zeros(6, 2)).is_contiguous()
    transposed = torch.zeros(2, 6).t()
    assert match_layout(sliced, transposed).stride() == transposed.stride()


def test_a_tp_plan_asks_for_pp_x_dp_x_tp_processes_before_any_group(monkeypatch):
    """A tp 2 plan runs sharded (tests/runtime/test_tp_pipeline.py); without torchrun it says how many
    processes to launch."""
    import torch.distributed as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, example = um.build("tuple")
    compiled = _compile(model, example, tp=2)
    with pytest.raises(LynxConfigError, match=r"runs on pp × dp × tp = 4 processes: launch the script with"):
        lynx.runtime.Pipeline(compiled)
    assert not dist.is_initialized()


@pytest.mark.parametrize("settings,missing", [
    # interleaved 1F1B and zero bubble run since issue 27, but not sharded: refused with tp > 1
    (dict(schedule="zbh1", tp=2, microbatches=4), "schedule 'zbh1' with tensor parallelism (tp 2 runs under 1f1b"),
    # what the TP backward graph is not checked under: refused, not run approximately
    (dict(tp=2, offload=True), "offload with tensor parallelism (tp 2"),
    (dict(tp=2, compile=True), "compiled stage graphs with tensor parallelism (tp 2"),
])
def test_pipeline_refuses_a_plan_it_cannot_execute_before_any_group(settings, missing):
    """Issue 22, finding 7: an interleaved plan failed late with a raw traceback per rank (a tp 2
    plan trained unsharded without a word: tp now runs sharded)."""
    import torch.distributed as dist

    model, example = um.build("tuple")
    compiled = _compile(model, example, **settings)
    refusal = r"this plan cannot be run: the runtime does not execute " + re.escape(missing)
    with pytest.raises(LynxConfigError, match=refusal):
        lynx.runtime.Pipeline(compiled)
    assert not dist.is_initialized()


def test_dp_from_the_world_size_without_torchrun_says_launch_with_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, example = um.build("tuple")
    world = 1   # what a script computes from WORLD_SIZE when run with plain python
    with pytest.raises(LynxConfigError, match=r"dp must be >= 1, got 0 .*launch the script with `torchrun"):
        _compile(model, example, dp=world // 2)
