"""Plan a 20B-parameter GPT on a laptop: meta device, no weights allocated.

Builds GPT-NeoX-20B's shape (44 layers, hidden 6144, 20.6 B parameters) on the meta device —
no weight is allocated, the whole run stays under 1 GiB of RAM — plans it for 8 pipeline
stages on 80 GB H100s (mixed-precision AdamW: 16 bytes of static state per parameter) under a
budget below what keeping every activation needs, prints the plan per stage beside Megatron's
full recomputation, saves it and draws the timeline picture.

    python examples/plan_20b.py [--pp 8] [--budget 70GiB] [--microbatches 16] [--out plan_20b]
    lynx show plan_20b.json          # the saved plan's table per stage
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import lynx
from lynx.planner.loop import plan_graph
from lynx.viz import draw_timeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=8, help="pipeline stages")
    parser.add_argument("--budget", default="70GiB", help="memory budget per device")
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--out", default="plan_20b", help="output stem for plan JSON and pictures")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model, inputs = lynx.models.build_preset("gpt-20b", seq=2048, microbatch=1)  # meta device
    compiled = lynx.compile(model, inputs, pp=args.pp, microbatches=args.microbatches, schedule="1f1b",
                            memory_budget=args.budget, hardware="h100-sxm", optimizer="adamw", solver="heu")
    elapsed = time.perf_counter() - start
    plan = compiled.plan
    full = plan_graph(compiled.analysis.graph, compiled.config.replace(solver="full"), check_budget=False)

    print(f"gpt-20b, pp {args.pp}, {args.microbatches} microbatches, budget {args.budget} per H100 "
          f"(planned in {elapsed:.1f} s, HEU search {plan.search_time_s * 1e3:.1f} ms, "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB)")
    print(f"{'stage':>5} {'layers':>10} {'recomputed':>10} {'in windows':>10} {'peak GiB':>9} {'full GiB':>9}")
    for stage, full_stage in zip(plan.stages, full.stages):
        dropped = [d for d in stage.decisions if d.action == "recompute"]
        windowed = [d for d in dropped if d.window or d.windows]
        print(f"{stage.index:>5} {f'{stage.layers[0]}-{stage.layers[-1]}' if stage.layers else '-':>10} "
              f"{len(dropped):>10} {len(windowed):>10} {stage.peak_memory_bytes / 2**30:>9.2f} "
              f"{full_stage.peak_memory_bytes / 2**30:>9.2f}")
    p, f = plan.predicted, full.predicted
    print(f"step time: Lynx {p.step_time_s * 1e3:.1f} ms vs full recomputation {f.step_time_s * 1e3:.1f} ms "
          f"({f.step_time_s / p.step_time_s:.2f}x); exposed recompute {p.exposed_recompute_s * 1e3:.1f} ms, "
          f"hidden {p.hidden_recompute_s * 1e3:.1f} ms; fits budget: {p.fits_budget}")
    out = Path(args.out)
    plan.save(out.with_suffix(".json"))
    pictures = draw_timeline(plan.timeline, p.step_time_s, out, title=f"gpt-20b pp{args.pp}, budget {args.budget}")
    print("wrote", out.with_suffix(".json"), *pictures)
    print(f"look at it: lynx show {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
