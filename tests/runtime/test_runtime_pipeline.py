"""Multi-process pipeline (× data parallel) on gloo equals the single-process reference bitwise."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from lynx.frontend.capture import capture
from lynx.errors import LynxFingerprintError, LynxRuntimeError
from lynx.models import build_preset
from lynx.plan import StageSchedule
from lynx.rewrite import build_stages
from lynx.rewrite.split import op_nodes
from lynx.runtime.launch import TokenBatches, WorkerSpec, rank_seed, spawn
from lynx.runtime.local import run_local
from lynx.runtime.pipeline import RuntimeConfig

M = 4
SEED = 7
BUILD = functools.partial(build_preset, "gpt-tiny", device="cpu", dropout=0.1, seq=16, microbatch=2)


@functools.lru_cache(maxsize=1)
def _split() -> tuple[list[list[str]], list[StageSchedule], TokenBatches]:
    torch.manual_seed(SEED)
    model, inputs = BUILD()
    captured = capture(model, inputs)
    names = [n.name for n in op_nodes(captured.gm)]
    half = len(names) // 2
    nodes = [names[:half], names[half:]]
    schedules = []
    for s, stage_nodes in enumerate(nodes):
        dropped = [n for i, n in enumerate(stage_nodes) if i % 3 != 0 and i < len(stage_nodes) - 3]
        prefetch = {
            0: [(f"s{s}.recv_grad.mb0", dropped[: len(dropped) // 2])],     # part prefetched, part on demand
            1: [(f"s{s}.recv_act.mb2", dropped)],                            # a forward's wait (GPipe stage 1)
            2: [(f"s{s}.recv_grad.mb2", dropped)],
        }
        schedules.append(StageSchedule(dropped=frozenset(dropped), prefetch=prefetch))
    vocab = model.config.vocab_size
    batches = TokenBatches(tuple(captured.input_names), vocab, batch=2, seq=16, seed=SEED)
    return nodes, schedules, batches


def _reference(schedule: str, dp: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    nodes, schedules, batches = _split()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: identical kernels, identical rounding
    try:
        torch.manual_seed(SEED)
        model, inputs = BUILD()
        model.train()
        stages = build_stages(capture(model, inputs).gm, nodes, [s.dropped for s in schedules])
        losses, grads = [], []
        for d in range(dp):
            model.zero_grad(set_to_none=True)
            seeds = [rank_seed(SEED, s, d) for s in range(len(nodes))]
            out = run_local(stages, batches(0, d, M), schedule=schedule, stage_seeds=seeds)
            losses.append([float(x) for x in out])
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)
    if dp == 1:
        return losses, grads[0]
    return losses, {n: (grads[0][n] + grads[1][n]).div_(dp) for n in grads[0]}


def _spec(dp: int, **kw) -> WorkerSpec:
    nodes, schedules, batches = _split()
    runtimes = [RuntimeConfig(schedule="1f1b", microbatches=M, timeout_s=60, bucket_bytes=64 << 10, trace=True),
                RuntimeConfig(schedule="gpipe", microbatches=M, timeout_s=60, bucket_bytes=64 << 10)]
    return WorkerSpec(build=BUILD, pp=2, dp=dp, runtime=runtimes, stage_nodes=nodes, schedules=schedules,
                      batches=batches, seed=SEED, return_grads=True, **kw)


@pytest.mark.parametrize("dp", [1, 2])
def test_pipeline_equals_single_process_reference(dp: int) -> None:
    results = spawn(_spec(dp), timeout_s=240)
    for k, schedule in enumerate(["1f1b", "gpipe"]):
        ref_losses, ref_grads = _reference(schedule, dp)
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            stats, rank_grads = r.runs[k]
            if r.stage == 1:
                assert stats[0].losses == ref_losses[r.dp_rank], f"{schedule} dp{r.dp_rank} losses"
            grads.update(rank_grads)
            if r.stage == 0:
                assert stats[0].recompute_hidden_s + stats[0].recompute_window_exposed_s > 0, "no window recompute ran"
            assert stats[0].peak_saved_bytes > 0
            if schedule == "1f1b":
                _check_trace(stats[0].events, r.stage)
        assert set(grads) == set(ref_grads)
        differ = [n for n in ref_grads if not torch.equal(grads[n], ref_grads[n])]
        assert not differ, f"{schedule} pp2×dp{dp}: gradients differ for {differ[:4]}"
        if dp == 2:  # replicas hold the same averaged gradients
            by_rank = {(r.stage, r.dp_rank): r.runs[k][1] for r in results}
            for s in range(2):
                for n, g in by_rank[(s, 0)].items():
                    assert torch.equal(g, by_rank[(s, 1)][n])


def _check_trace(events: list, stage: int) -> None:
    """The traced actions follow the schedule; a window's recompute runs after the gradient receive
    was posted (after the forward that sent the activations) and before its wait and backward."""
    from lynx.planner.schedule import stage_actions

    actions = [f"{w}{j}" for w, j, _t0, _t1 in events if w in ("F", "B")]
    assert actions == [str(a) for a in stage_actions("1f1b", stage=stage, stages=2, microbatches=M)]
    start = {(w, j): t0 for w, j, t0, _t1 in events}
    end = {(w, j): t1 for w, j, _t0, t1 in events}
    for w, j, t0, t1 in events:
        if w in ("R", "Rx"):  # window recompute of microbatch j (stage 0 anchors recv_grad windows)
            assert end[("F", j)] <= t0 and t1 <= start[("B", j)], f"window of mb{j} outside F{j}..B{j}"
            if ("wait_grad", j) in start:
                assert t1 <= start[("wait_grad", j)] + 1e-6, f"window of mb{j} ran after waiting for its gradient"
    if stage == 0:
        assert any(w in ("R", "Rx") for w, *_ in events), "no window recompute traced"


def _small_gpt():
    from lynx.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=2, layers=2, dropout=0.1)
    idx = torch.randint(0, 64, (1, 8))  # (B, T)
    return GPT(cfg), (idx, idx.roll(-1, dims=1))


def test_failed_rank_is_named_quickly() -> None:
    torch.manual_seed(SEED)
    model, inputs = _small_gpt()
    names = [n.name for n in op_nodes(capture(model, inputs).gm)]
    spec = WorkerSpec(build=_small_gpt, pp=2, stage_nodes=[names[:30], names[30:]], seed=SEED, fail_rank=1,
                      runtime=RuntimeConfig(schedule="1f1b", microbatches=2, timeout_s=20))
    start = time.monotonic()
    with pytest.raises(LynxRuntimeError, match="rank 1 failed: RuntimeError: injected failure") as info:
        spawn(spec, timeout_s=120)
    errors = info.value.rank_errors
    assert "RankFailedError: rank 1 failed" in errors[0]  # the survivor names who failed, it does not hang
    assert time.monotonic() - start < 90


def test_plan_fingerprint_mismatch_refused_before_running() -> None:
    import torch.distributed as dist

    from lynx.runtime.launch import _check_fingerprints

    store = dist.HashStore()
    _check_fingerprints(WorkerSpec(build=_small_gpt, pp=2, fingerprint="aaaa"), store, 0, 2)
    _check_fingerprints(WorkerSpec(build=_small_gpt, pp=2, fingerprint="aaaa"), store, 1, 2)
    with pytest.raises(LynxFingerprintError, match="rank 1 has plan fingerprint bbbb but rank 0 has aaaa"):
        _check_fingerprints(WorkerSpec(build=_small_gpt, pp=2, fingerprint="bbbb"), store, 1, 2)


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
    from lynx.runtime.pipeline import PipelineRunner

    store = dist.HashStore()
    runner = types.SimpleNamespace(monitor=FaultMonitor(store, rank=0, world_size=2, timeout_s=0.3),
                                   topo=types.SimpleNamespace(rank=0))
    never = _NeverDone()
    try:
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="gradient receive of microbatch 3 from rank 1 did not complete"):
            PipelineRunner._wait(runner, Pollable(never), "gradient receive of microbatch 3", 1)
        assert time.monotonic() - start < 2.0
        FaultMonitor(store, rank=1, world_size=2).report(RuntimeError("boom"))
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: boom"):
            PipelineRunner._wait(runner, Pollable(never), "gradient receive of microbatch 3", 1)
        assert time.monotonic() - start < 0.25  # seen at the next slice, not after the timeout
    finally:
        never.release.set()
