"""What each rank of tests/runtime/test_runtime_pipeline.py's spawned world runs (through Pipeline).

A hand-made plan of gpt-tiny (dropout 0.1) split at its middle op node, dropping two nodes in
three on each stage (the last three kept), with windows of both kinds: part of microbatch 0's
drops in its gradient window (the rest on demand), microbatch 1's in a forward's wait, and
microbatch 2's in its gradient window. :func:`train` runs it under each schedule in turn
(one :class:`lynx.runtime.Pipeline` each, sharing the world) and writes this rank's losses,
gradients and statistics; :func:`train_then_fail` then runs the user-loop cases of
tests/runtime/test_user_pipeline.py's pp 2 x dp 2 layout, has ranks disagree on the plan, and
finally injects a failure on rank 1.
"""

from __future__ import annotations

import functools
import os
import time

import torch

import lynx
from lynx.plan import StageSchedule
from lynx.testing import InjectedFailure, TokenBatches, captured_with_plan, with_stages

M = 4
SEED = 7
SCHEDULES = ("1f1b", "gpipe")
BUILD = functools.partial(lynx.models.build_preset, "gpt-tiny", device="cpu", dropout=0.1, seq=16, microbatch=2)
SETTINGS = dict(pp=2, microbatches=M, solver="none", hardware="cpu-local", memory_budget="1GiB")


def batches() -> TokenBatches:
    return TokenBatches(vocab=256, batch=2, seq=16, seed=SEED)


def hand_split(names: list[str]) -> tuple[list[list[str]], list[StageSchedule]]:
    """The split and drops of the module docstring, from the captured graph's op node names."""
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
    return nodes, schedules


def config(dp: int) -> lynx.CompileConfig:
    return lynx.CompileConfig(**dict(SETTINGS, dp=dp))


def _compiled(dp: int, plan: lynx.Plan, nodes, schedules):
    torch.manual_seed(SEED)   # the same weights on every rank
    model, inputs = BUILD()
    model.train()
    base = captured_with_plan(model, inputs, plan, config(dp))
    return {s: with_stages(base, schedules, stage_nodes=nodes, schedule=s) for s in SCHEDULES}


def _run(compiled, dp: int) -> dict:
    # seed: each rank its own dropout stream, rank_seed(SEED, stage, replica) (lynx.runtime.rank_rng)
    pipe = lynx.runtime.Pipeline(compiled, timeout_s=60, exit_on_error=False, trace=True, bucket_bytes=64 << 10,
                                 seed=SEED)
    topo = pipe.topology
    pipe.step(*batches()(0, dp, M))
    stats = pipe.last_stats
    out = {"stage": topo.stage, "dp_rank": topo.dp_rank, "losses": stats.losses, "events": stats.events,
           "window_recompute_s": stats.recompute_hidden_s + stats.recompute_window_exposed_s,
           "peak_saved_bytes": stats.peak_saved_bytes,
           "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}}
    pipe.close()
    return out


def train(out_dir: str, dp: int, plan: lynx.Plan, nodes, schedules) -> dict:
    """Every schedule in turn; this rank's results to ``out_dir/rank{r}.pt``. Returns the
    compilations (one capture for all of them)."""
    compiled = _compiled(dp, plan, nodes, schedules)
    results = {s: _run(compiled[s], dp) for s in SCHEDULES}
    torch.save(results, os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.pt"))
    return compiled


def train_then_fail(out_dir: str, dp: int, plan: lynx.Plan, nodes, schedules, user_cases=()) -> None:
    """:func:`train`; then ``user_cases`` (tests/runtime/test_user_pipeline.py's pp 2 x dp 2 cases,
    ``user_pipeline_worker.run_cases``: this world saves them a torchrun of their own); then rank 1
    brings another plan (every rank must refuse it); then rank 1 raises before its first step
    (writing when to ``out_dir/raised``) while the others wait for it."""
    compiled = train(out_dir, dp, plan, nodes, schedules)
    if user_cases:
        import user_pipeline_worker

        user_pipeline_worker.run_cases(out_dir, 2, list(user_cases), exit_on_error=False)
    rank = torch.distributed.get_rank()
    try:
        lynx.runtime.Pipeline(compiled["gpipe" if rank == 1 else "1f1b"], exit_on_error=False)
        refused = ""
    except lynx.LynxFingerprintError as err:
        refused = str(err)
    with open(os.path.join(out_dir, f"refused{rank}.txt"), "w") as f:
        f.write(refused)
    pipe = lynx.runtime.Pipeline(compiled["1f1b"], timeout_s=20, exit_on_error=False)
    if rank == 1:
        with open(os.path.join(out_dir, "raised"), "w") as f:
            f.write(repr(time.time()))
        raise InjectedFailure(f"injected failure on rank {rank}")
    pipe.step(*batches()(0, dp, M))
