"""Checkpoints of a Pipeline's rank: state round-trips exactly, checkpoints are atomic and never overwritten.

The resume test runs in this process as a world of one (gloo over 127.0.0.1, torn down after).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lynx
from lynx.runtime.checkpoint import (
    MANIFEST,
    META_FILE,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from lynx.runtime.rank_state import pipeline_state
from lynx.runtime.report import format_summary, run_summary
from lynx.runtime.stats import StepStats
from lynx.runtime.topology import free_port


def _build():
    return lynx.models.build_preset("gpt-tiny", seq=16, microbatch=2, device="cpu")


def _lr(step: int) -> float:
    return 3e-3 / (step + 1)     # changes every step: a resumed optimizer must follow it


@pytest.fixture(scope="module")
def world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(3)
        model, inputs = _build()
        compiled = lynx.compile(model, inputs, pp=1, microbatches=2, hardware="cpu-local", solver="full",
                                memory_budget="64MiB")
        yield compiled, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()


class _Run:
    """A training loop over Pipeline with DeMo and a learning-rate schedule, as examples/train_gpt.py."""

    def __init__(self, compiled, initial: dict) -> None:
        from lynx.data import StdlibBatches
        from lynx.optim import DeMo

        compiled.analysis.captured.gm.load_state_dict(initial, strict=False)  # fresh weights
        self.pipe = lynx.runtime.Pipeline(compiled, exit_on_error=False, seed=3)   # its own dropout stream
        self.opt = DeMo(list(self.pipe.parameters()), lr=3e-3, process_group=self.pipe.dp_group)
        self.pipe.use_optimizer(self.opt)
        self.state = pipeline_state(self.pipe, self.opt)
        self.data = StdlibBatches(("idx", "targets"), batch=2, seq=16, max_bytes=1 << 16)

    def steps(self, n: int) -> list[list[float]]:
        out = []
        for _ in range(n):
            step = self.state.next_step
            for group in self.opt.param_groups:
                group["lr"] = _lr(step)
            mbs = self.data(step, 0, 2)
            self.pipe.step(torch.cat([mb["idx"] for mb in mbs]), torch.cat([mb["targets"] for mb in mbs]))
            self.opt.step()
            self.opt.zero_grad()
            self.state.next_step = step + 1
            out.append(list(self.pipe.losses))
        return out


def test_checkpoint_resume_is_bitwise(world_of_one, tmp_path: Path) -> None:
    a = _Run(*world_of_one)
    a.steps(2)
    path = save_checkpoint(a.state, tmp_path, meta={"model": "gpt-tiny"})
    assert path == tmp_path / "step_2" and json.loads((path / META_FILE).read_text())["meta"]["step"] == 2
    expected = a.steps(2)
    a.pipe.close()
    b = _Run(*world_of_one)           # fresh weights, optimizer and RNG: all come from the checkpoint
    assert load_checkpoint(b.state, path) == 2
    assert b.steps(2) == expected     # dropout draws, DeMo momenta and data position all restored
    assert b.state.next_step == 4
    # the same step again is never overwritten: refused, the files as they were
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    assert save_checkpoint(b.state, tmp_path, meta={"model": "other"}) == tmp_path / "step_4"       # new
    b.state.next_step = 2
    with pytest.raises(lynx.LynxConfigError, match="step_2 already exists: a checkpoint is never overwritten"):
        save_checkpoint(b.state, tmp_path, meta={"model": "other"})
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    b.pipe.close()


def test_latest_checkpoint_sees_only_complete_ones(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    for name, complete in (("step_3", True), ("step_10", False), (".step_12.tmp", True), ("notes", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / MANIFEST).write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"


def test_check_compatible_names_the_fields() -> None:
    saved = {"model": "gpt-tiny", "pp": 2, "dp": 2, "microbatches": 4, "optimizer": "demo", "lr": 1.0}
    check_compatible(saved, dict(saved, lr=0.5))          # the learning rate may change
    with pytest.raises(lynx.LynxConfigError, match=r"dp: checkpoint 2, this run 1; .*optimizer: checkpoint 'demo'"):
        check_compatible(saved, dict(saved, dp=1, optimizer="lion"))


def test_run_summary_against_a_plan() -> None:
    class _Plan:
        class predicted:
            step_time_s, exposed_recompute_s, hidden_recompute_s = 0.1, 0.0, 0.0

        stages = []
        timeline = []

    steps = [[StepStats(rank=r, stage=r, dp_rank=0, step_s=t + r * 0.01, peak_saved_bytes=100 * (r + 1))
              for r in range(2)] for t in (1.0, 0.1, 0.12, 0.11)]
    summary = run_summary(steps, _Plan())
    assert summary.step_s == pytest.approx(0.12)                    # median of the slowest rank, warm-up left out
    assert summary.peak_saved_bytes == {0: 100, 1: 200}
    assert "measured/predicted 1.20" in format_summary(summary)
