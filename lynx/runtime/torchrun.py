"""``torchrun`` entry: run a planned model across machines (gloo or the env's backend via env://).

Every rank loads the same plan, builds the same model, checks the plan's fingerprint against
it (and against rank 0's) before anything runs, then trains ``--steps`` steps of its stage and
prints its measured statistics beside the plan's predictions (rank 0 prints the table). No
optimizer, data or checkpoints: for training with those see ``examples/train_gpt.py``.

Usage::

    lynx plan gpt-tiny --pp 2 --microbatches 8 -o plan.json          # once
    torchrun --nproc-per-node 2 -m lynx.runtime.torchrun gpt-tiny --plan plan.json --steps 3
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.distributed as dist

from lynx.runtime.launch import WorkerSpec, run_rank
from lynx.runtime.pipeline import RuntimeConfig
from lynx.runtime.stats import format_stats

__all__ = ["main"]


def _build(model: str, seq: int | None, microbatch: int | None) -> tuple[torch.nn.Module, tuple]:
    from lynx.models import resolve_model

    resolved = resolve_model(model, seq=seq, microbatch=microbatch, device="cpu")
    return resolved.model, resolved.example_inputs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="preset name or module:factory returning (model, example_inputs)")
    ap.add_argument("--plan", required=True, help="plan JSON made for this model (lynx plan ... --output/-o)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--microbatch", type=int)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from lynx.plan import Plan

    plan = Plan.load(args.plan)
    cfg = plan.config
    build = functools.partial(_build, args.model, args.seq, args.microbatch)
    spec = WorkerSpec(
        build=build, pp=int(cfg.get("pp", 1)), dp=int(cfg.get("dp", 1)), plan=plan, steps=args.steps,
        threads=args.threads,
        runtime=RuntimeConfig(schedule=cfg.get("schedule", "1f1b"), microbatches=int(cfg.get("microbatches", 1)),
                              timeout_s=args.timeout_s))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = run_rank(spec, rank, world, init="env://")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result.stats[-1])
    if rank == 0:
        print(format_stats(gathered, plan))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
