"""RankTrainer and checkpoints: state round-trips exactly, checkpoints are atomic and never overwritten.

The trainer tests run in this process as a world of one (gloo over 127.0.0.1, torn down after).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

import lynx
from lynx.runtime.checkpoint import (
    META_FILE,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from lynx.runtime.launch import WorkerSpec, free_port
from lynx.runtime.pipeline import RuntimeConfig
from lynx.runtime.report import format_summary, run_summary
from lynx.runtime.stats import StepStats


def _build():
    return lynx.models.build_preset("gpt-tiny", seq=16, microbatch=2, device="cpu")


def _lr(step: int) -> float:
    return 3e-3 / (step + 1)     # changes every step: a resumed optimizer must follow it


def _demo(params, group):
    from lynx.optim import DeMo

    return DeMo(params, lr=3e-3, process_group=group)


@pytest.fixture(scope="module")
def world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        from lynx.data import StdlibBatches
        from lynx.runtime.topology import make_topology

        model, inputs = _build()
        plan = lynx.compile(model, inputs, pp=1, microbatches=2, hardware="cpu-local", solver="full",
                            memory_budget="64MiB").plan
        spec = WorkerSpec(build=_build, pp=1, plan=plan, seed=3, optimizer=_demo,
                          runtime=RuntimeConfig(microbatches=2), lr_schedule=_lr,
                          batches=StdlibBatches(("idx", "targets"), batch=2, seq=16, max_bytes=1 << 16))
        yield spec, make_topology(1, 1)
    finally:
        dist.destroy_process_group()


def _losses(trainer, steps) -> list[list[float]]:
    return [trainer.step().losses for _ in range(steps)]


def test_checkpoint_resume_is_bitwise(world_of_one, tmp_path: Path) -> None:
    from lynx.runtime.trainer import RankTrainer

    spec, topo = world_of_one
    a = RankTrainer(spec, topo)
    _losses(a, 2)
    path = save_checkpoint(a, tmp_path, meta={"model": "gpt-tiny"})
    assert path == tmp_path / "step_2" and json.loads((path / META_FILE).read_text())["step"] == 2
    expected = _losses(a, 2)
    a.close()
    b = RankTrainer(spec, topo)          # fresh weights, optimizer and RNG: all come from the checkpoint
    assert load_checkpoint(b, path) == 2
    assert _losses(b, 2) == expected     # dropout draws, DeMo momenta and data position all restored
    assert b.next_step == 4
    # the same step again is never overwritten
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    assert save_checkpoint(b, tmp_path, meta={"model": "other"}) is not None       # step_4: new
    b.next_step = 2
    assert save_checkpoint(b, tmp_path, meta={"model": "other"}) is None           # step_2 exists
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    b.close()


def test_latest_checkpoint_sees_only_complete_ones(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    for name, complete in (("step_3", True), ("step_10", False), (".step_12.tmp", True), ("notes", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / META_FILE).write_text("{}")
            (tmp_path / name / ".metadata").write_bytes(b"")
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
