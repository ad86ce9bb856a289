"""``torchrun`` entry: run a saved plan across machines through :class:`lynx.runtime.Pipeline`.

Every rank builds the same model (seed 0), compiles it with the plan — refused if the plan
was made for another model or settings, and checked against rank 0's before anything runs —
joins the job through :class:`~lynx.runtime.Pipeline`, trains ``--steps`` steps on the model's
example inputs (no optimizer: the measured step is forward, backward and the gradient sync)
and rank 0 prints every rank's measured statistics beside the plan's predictions. For
training with an optimizer, data and checkpoints see ``examples/train_gpt.py``.

Usage::

    lynx plan gpt-tiny --pp 2 --microbatches 8 -o plan.json          # once
    torchrun --nproc-per-node 2 -m lynx.runtime.torchrun gpt-tiny --plan plan.json --steps 3
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

__all__ = ["main"]


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
    import lynx
    from lynx.config import FINGERPRINT_FIELDS
    from lynx.models import resolve_model
    from lynx.plan import Plan
    from lynx.runtime.stats import format_stats

    torch.set_num_threads(args.threads)
    plan = Plan.load(args.plan)
    torch.manual_seed(0)   # the same weights on every rank
    resolved = resolve_model(args.model, seq=args.seq, microbatch=args.microbatch, device="cpu")
    settings = {k: plan.config[k] for k in FINGERPRINT_FIELDS if k in plan.config}
    if plan.config.get("tp_plan"):   # tp > 1: shard as the plan was made for
        settings["tp_plan"] = plan.config["tp_plan"]
    compiled = lynx.compile(resolved.model, resolved.example_inputs, plan=plan, **settings)
    with lynx.runtime.Pipeline(compiled, timeout_s=args.timeout_s) as pipe:
        # the example inputs as every microbatch of every replica
        repeat = pipe.topology.dp * pipe.microbatches
        example = resolved.example_inputs
        named = example if isinstance(example, dict) else {}
        batch = {k: torch.cat([x] * repeat) if isinstance(x, torch.Tensor) else x for k, x in named.items()}
        rows = [torch.cat([x] * repeat) if isinstance(x, torch.Tensor) else x for x in ([] if named else example)]
        for _ in range(args.steps):
            pipe.step(*rows, **batch)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pipe.last_stats)
        if pipe.rank == 0:
            print(format_stats(gathered, plan))


if __name__ == "__main__":
    main()
