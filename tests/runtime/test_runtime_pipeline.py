"""Multi-process Pipeline × data parallel on gloo equals the single-process reference bitwise.

One spawned world (pp 2 × dp 2) runs a hand-made plan with windows of both kinds under 1F1B
and GPipe through :class:`lynx.runtime.Pipeline` (``pipeline_ranks.py``), then the user-loop
cases of tests/runtime/test_user_pipeline.py's pp 2 × dp 2 layout (checked bitwise against
PyTorch by its ``check_cases``: gpt-tiny interleaved and under an offloading plan), then checks that
ranks holding different plans are refused before anything runs, and that a rank raising is
named by the others quickly. Each replica's losses are compared with the single-process run
of its own microbatches and dropout streams (replica 0's are what a pp 2 world without data
parallelism runs), the averaged gradients with the reference's; pp 2 alone runs bitwise
against PyTorch in tests/runtime/test_user_pipeline.py.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import pytest
import torch

import lynx
from lynx.errors import LynxRuntimeError
from lynx.frontend.capture import capture
from lynx.rewrite import build_stages
from lynx.rewrite.split import op_nodes
from lynx.runtime.topology import rank_seed
from lynx.testing import run_local, spawn_world

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_ranks as pr  # noqa: E402
from test_user_pipeline import DP_CASES, check_cases  # noqa: E402


@functools.lru_cache(maxsize=None)
def _setup(dp: int):
    torch.manual_seed(pr.SEED)
    model, inputs = pr.BUILD()
    compiled = lynx.compile(model, inputs, pr.config(dp))
    names = [n.name for n in op_nodes(compiled.analysis.captured.gm)]
    nodes, schedules = pr.hand_split(names)
    return compiled.plan, nodes, schedules


def _reference(schedule: str, dp: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    _plan, nodes, schedules = _setup(dp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: identical kernels, identical rounding
    try:
        torch.manual_seed(pr.SEED)
        model, inputs = pr.BUILD()
        model.train()
        captured = capture(model, inputs)
        stages = build_stages(captured.gm, nodes, [s.dropped for s in schedules])
        losses, grads = [], []
        for d in range(dp):
            model.zero_grad(set_to_none=True)
            seeds = [rank_seed(pr.SEED, s, d) for s in range(len(nodes))]
            mbs = [dict(zip(captured.input_names, pr.batches().microbatch(0, d, j))) for j in range(pr.M)]
            out = run_local(stages, mbs, schedule=schedule, stage_seeds=seeds, loss_scale=1.0 / pr.M)
            losses.append([float(x) for x in out])
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)
    if dp == 1:
        return losses, grads[0]
    return losses, {n: (grads[0][n] + grads[1][n]).div_(dp) for n in grads[0]}


def _check_equal(results: list[dict], dp: int) -> None:
    for schedule in pr.SCHEDULES:
        ref_losses, ref_grads = _reference(schedule, dp)
        grads: dict[str, torch.Tensor] = {}
        for r in (res[schedule] for res in results):
            if r["stage"] == 1:
                assert r["losses"] == ref_losses[r["dp_rank"]], f"{schedule} dp{r['dp_rank']} losses"
            grads.update(r["grads"])
            if r["stage"] == 0:
                assert r["window_recompute_s"] > 0, "no window recompute ran"
            assert r["peak_saved_bytes"] > 0
            if schedule == "1f1b":
                _check_trace(r["events"], r["stage"])
        assert set(grads) == set(ref_grads)
        differ = [n for n in ref_grads if not torch.equal(grads[n], ref_grads[n])]
        assert not differ, f"{schedule} pp2×dp{dp}: gradients differ for {differ[:4]}"
        if dp == 2:  # replicas hold the same averaged gradients
            by_rank = {(r["stage"], r["dp_rank"]): r["grads"] for r in (res[schedule] for res in results)}
            for s in range(2):
                for n, g in by_rank[(s, 0)].items():
                    assert torch.equal(g, by_rank[(s, 1)][n])


def _check_trace(events: list, stage: int) -> None:
    """The traced actions follow the schedule; a window's recompute runs after the gradient receive
    was posted (after the forward that sent the activations) and before its wait and backward."""
    from lynx.planner.schedule import stage_actions

    actions = [f"{w}{j}" for w, j, _t0, _t1 in events if w in ("F", "B")]
    assert actions == [str(a) for a in stage_actions("1f1b", stage=stage, stages=2, microbatches=pr.M)]
    start = {(w, j): t0 for w, j, t0, _t1 in events}
    end = {(w, j): t1 for w, j, _t0, t1 in events}
    for w, j, t0, t1 in events:
        if w in ("R", "Rx"):  # window recompute of microbatch j (stage 0 anchors recv_grad windows)
            assert end[("F", j)] <= t0 and t1 <= start[("B", j)], f"window of mb{j} outside F{j}..B{j}"
            if ("wait_grad", j) in start:
                assert t1 <= start[("wait_grad", j)] + 1e-6, f"window of mb{j} ran after waiting for its gradient"
    if stage == 0:
        assert any(w in ("R", "Rx") for w, *_ in events), "no window recompute traced"


def _load(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_pp2_dp2_equals_reference_refuses_other_plans_and_names_a_failed_rank(tmp_path: Path) -> None:
    with pytest.raises(LynxRuntimeError, match="rank 1 failed: InjectedFailure: injected failure on rank 1") as info:
        spawn_world(pr.train_then_fail, 4, str(tmp_path), 2, *_setup(2), DP_CASES, timeout_s=600)
    # every rank out within seconds of the raise: named at a wait's next slice, not after the
    # 20 s peer timeout of the failing Pipeline
    ended = time.time()
    raised = float((tmp_path / "raised").read_text())
    assert ended - raised < 15, f"the world took {ended - raised:.1f} s to end after rank 1 raised"
    assert "RankFailedError: rank 1 failed" in info.value.rank_errors[0]  # the survivor names who failed
    _check_equal(_load(tmp_path, 4), dp=2)
    # the user-loop cases of pp 2 x dp 2 this world also ran: bitwise against PyTorch
    check_cases(tmp_path, DP_CASES, nproc=4, pp=2)
    for r in range(4):
        refused = (tmp_path / f"refused{r}.txt").read_text()
        assert "compiled another plan than rank 0" in refused, f"rank {r} ran a plan rank 0 does not have"


class _NeverDone:
    """A receive whose message never comes (``wait`` blocks until the test ends)."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()

    def wait(self) -> None:
        self.release.wait(30)


def test_receive_wait_is_bounded_and_names_a_failed_peer() -> None:
    import types

    import torch.distributed as dist

    from lynx.runtime.faults import FaultMonitor, PeerTimeoutError, RankFailedError
    from lynx.runtime.p2p import Pollable
    from lynx.runtime.runner import StageRunner

    store = dist.HashStore()
    runner = types.SimpleNamespace(monitor=FaultMonitor(store, rank=0, world_size=2, timeout_s=0.3),
                                   topo=types.SimpleNamespace(rank=0))
    never = _NeverDone()
    try:
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="gradient receive of microbatch 3 from rank 1 did not complete"):
            StageRunner._wait(runner, Pollable(never), "gradient receive of microbatch 3", 1)
        assert time.monotonic() - start < 2.0
        FaultMonitor(store, rank=1, world_size=2).report(RuntimeError("boom"))
        runner.monitor = FaultMonitor(store, rank=0, world_size=2, timeout_s=60.0)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: boom"):
            StageRunner._wait(runner, Pollable(never), "gradient receive of microbatch 3", 1)
        assert time.monotonic() - start < 10.0  # seen at the next slice, not after the 60 s timeout
    finally:
        never.release.set()
