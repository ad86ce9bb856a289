"""Recomputation inside tensor-parallel windows, measured: lynx vs on-demand vs none over a slow TP link.

Runs a GPT over ``pp × tp`` CPU ranks (one thread each, tp 2) in the test bed's network
namespaces (``lynx.testbed.NetBed``: veth links limited with ``tc tbf``; without root, gloo on
loopback as it is, and the output says so), 8 microbatches per step, 1F1B, and in the same
processes and run alternates three variants step by step (rotating their order):

* ``none``       keep every saved tensor (no recomputation);
* ``on-demand``  the plan's drops, recomputed when the backward needs them (``prefetch=False``);
* ``lynx``       the same drops, recomputed inside the plan's TP windows: between a backward
                 all-reduce of the layer above and its ``wait_tensor``.

The plan (``--plan hand``, the default) drops every layer of a stage but its top one, whole
but for the layer's output (Megatron's full recomputation, layer by layer), and puts layer
``l``'s recomputation in the window of layer ``l + 1``'s backward all-reduces, for every
microbatch: the recomputation a stage's TP windows can hold. ``--plan heu`` asks Lynx's HEU
for a plan under a budget between ``full``'s and ``none``'s peaks, priced with the bed's link.

It prints, per topology, the median step time of each variant, the ratios lynx/none and
on-demand/none (median over repetitions of the per-repetition ratio), and the recomputation
lynx hid in TP windows (the wait after it still blocked: the all-reduce outlasted it) and
exposed. Results go to ``benchmarks/results/tp_overlap.json`` (``--out``); method and figures
in ``docs/tensor_parallel.md``.

Usage::

    python benchmarks/tp_overlap.py                   # pp 1 × tp 2 and pp 2 × tp 2 at 200 Mbit/s
    python benchmarks/tp_overlap.py --pps 1 --rate 100 --reps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_rows import print_rows, rows_from_stdout
from shared_machine import renice_session

VARIANTS = ("none", "on-demand", "lynx")
CFG = {"vocab_size": 512, "seq_len": 128, "hidden": 256, "heads": 8, "layers": 4, "dropout": 0.0}
MICROBATCH, TP = 4, 2


def build_model() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from lynx.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    idx = torch.randint(0, CFG["vocab_size"], (MICROBATCH, CFG["seq_len"]))  # (B, T)
    return model, (idx, idx.roll(-1, dims=1))


def batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CFG["vocab_size"], (m * MICROBATCH, CFG["seq_len"]), generator=gen)  # (m·B, T)
    return idx, idx.roll(-1, dims=1)


def hand_schedules(compiled) -> list:
    """Per stage: every layer but the stage's top one dropped whole (its output kept), layer l
    recomputed in layer l + 1's TP window for every microbatch."""
    from lynx.plan import StageSchedule
    from lynx.planner.windows import WindowId

    graph, plan = compiled.analysis.graph, compiled.plan
    blocks = graph.graph["blocks"]
    out = []
    for stage in plan.stages:
        layers = [b for b in blocks if b["kind"] == "layer" and b["layer"] in stage.layers]
        dropped, prefetch = set(), {j: [] for j in range(plan.microbatches)}
        for block, above in zip(layers, layers[1:]):
            nodes = list(block["nodes"][:-1])   # the layer's output is the next one's input: kept
            dropped |= set(nodes)
            for j in range(plan.microbatches):
                prefetch[j].append((str(WindowId.tp(stage.index, layer=above["layer"], microbatch=j)), nodes))
        out.append(StageSchedule(dropped=frozenset(dropped), prefetch=prefetch))
    return out


def compile_here(pp: int, m: int, rate_mbit: float, plan: str):
    """The model compiled for pp × tp 2 (sharding resolved, plan made) on this process."""
    import lynx
    from lynx.planner.hardware import LinkSpec, get_hardware
    from lynx.planner.loop import plan_graph
    from lynx.testing import with_stages

    model, inputs = build_model()
    base = get_hardware("cpu-local")
    link = LinkSpec(alpha_s=3e-4, beta_bytes_per_s=rate_mbit * 0.955e6 / 8)   # the bed's link
    hardware = base.model_copy(update={"name": f"cpu-local-{rate_mbit:g}mbit", "links": {"pp": link, "tp": link,
                                                                                         "dp": link}})
    compiled = lynx.compile(model, inputs, pp=pp, tp=TP, microbatches=m, solver="none", hardware=hardware,
                            memory_budget=1 << 40)
    if plan == "hand":
        return with_stages(compiled, hand_schedules(compiled)), "hand: layers below each stage's top in TP windows"
    graph, config = compiled.analysis.graph, compiled.config
    keep = compiled.plan.predicted.peak_memory_bytes[0]
    full = plan_graph(graph, config.replace(solver="full")).predicted.peak_memory_bytes[0]
    config = config.replace(solver="heu", memory_budget=(keep + full) // 2)
    import dataclasses

    return dataclasses.replace(compiled, plan=plan_graph(graph, config), config=config), "heu, budget halfway"


# ------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import lynx
    from lynx.testing import with_stages
    from lynx.plan import StageSchedule

    torch.set_num_threads(1)
    spec = json.loads(Path(args.spec).read_text())
    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    renice_session(spec["nice"])
    dist.init_process_group("gloo")   # the script's: the three Pipelines share it
    compiled, _ = compile_here(spec["pp"], spec["microbatches"], spec["rate_mbit"], spec["plan"])
    plain = with_stages(compiled, [StageSchedule(dropped=frozenset()) for _ in compiled.plan.stages])
    common = {"timeout_s": 600, "exit_on_error": False}
    pipes = {"none": lynx.runtime.Pipeline(plain, **common),
             "on-demand": lynx.runtime.Pipeline(compiled, prefetch=False, **common),
             "lynx": lynx.runtime.Pipeline(compiled, **common)}
    rows = []
    for rep in range(spec["reps"] + 1):  # rep 0 warms up
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
        idx, targets = batch(rep, spec["microbatches"])
        for variant in order:
            dist.barrier()
            pipes[variant].step(idx, targets)
            if rep > 0:
                rows.append({"variant": variant, "rep": rep, **pipes[variant].last_stats.as_dict()})
    print_rows(rows)
    for pipe in pipes.values():
        pipe.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver
def summarize(rows: list[dict]) -> dict:
    reps = sorted({r["rep"] for r in rows})

    def step(v: str, k: int) -> float:   # a step ends when its slowest rank does
        return max(r["step_s"] for r in rows if r["variant"] == v and r["rep"] == k)

    steps = {v: {k: step(v, k) for k in reps} for v in VARIANTS}
    out: dict = {"variants": {}}
    for v in VARIANTS:
        mine = [r for r in rows if r["variant"] == v]
        per_rep = [[r for r in mine if r["rep"] == k] for k in reps]
        out["variants"][v] = {
            "step_s": statistics.median(steps[v].values()),
            "step_s_per_rep": [steps[v][k] for k in reps],
            # per rank and step, averaged over the ranks; medians over the repetitions
            "tp_hidden_s": statistics.median(statistics.mean(r["recompute_tp_hidden_s"] for r in rs) for rs in per_rep),
            "tp_exposed_s": statistics.median(statistics.mean(r["recompute_tp_exposed_s"] for r in rs)
                                              for rs in per_rep),
            "on_demand_s": statistics.median(statistics.mean(r["recompute_on_demand_s"] for r in rs) for rs in per_rep),
            "peak_saved_bytes": max(r["peak_saved_bytes"] for r in mine),
        }
    lynx = out["variants"]["lynx"]
    recompute = lynx["tp_hidden_s"] + lynx["tp_exposed_s"] + lynx["on_demand_s"]
    out["hidden_share"] = lynx["tp_hidden_s"] / recompute if recompute else 0.0
    for a in ("lynx", "on-demand"):
        per = [steps[a][k] / steps["none"][k] for k in reps]
        out[f"{a}/none"] = statistics.median(per)
    out["lynx/on-demand"] = statistics.median(steps["lynx"][k] / steps["on-demand"][k] for k in reps)
    return out


def run(args: argparse.Namespace) -> None:
    from lynx.testbed import NetBed, measure_link

    results = {"when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": CFG,
               "microbatch": MICROBATCH, "tp": TP, "microbatches": args.microbatches, "reps": args.reps,
               "rate_mbit": args.rate, "plan": args.plan, "cores": len(os.sched_getaffinity(0)), "runs": []}
    print(f"model: GPT {CFG}, microbatch {MICROBATCH}, {args.microbatches} microbatches, 1f1b, tp {TP}, "
          f"plan {args.plan}")
    for pp in [int(x) for x in args.pps.split(",")]:
        world = pp * TP
        spec = {"pp": pp, "microbatches": args.microbatches, "reps": args.reps, "rate_mbit": args.rate,
                "plan": args.plan, "nice": args.nice}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        load = os.getloadavg()
        with NetBed(world_size=world, rate_mbit=args.rate) as bed:
            limited = bed.rate_limited
            link = measure_link(bed) if limited else None
            print(f"\npp {pp} × tp {TP}: {world} ranks, rate-limited={limited}, "
                  + (f"{link}" if link else f"({bed.fallback_reason}: gloo on loopback as it is)"))
            out = bed.run([sys.executable, __file__, "--worker", "--spec", f.name],
                          env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, timeout_s=1800)
        os.unlink(f.name)
        res = summarize(rows_from_stdout(out[0].stdout))
        res.update(pp=pp, rate_limited=limited, link=str(link) if link else "loopback, not limited",
                   loadavg_start=load, loadavg_end=os.getloadavg())
        for v in VARIANTS:
            r = res["variants"][v]
            print(f"  {v:>9}: step {r['step_s'] * 1e3:8.1f} ms; recompute per rank: hidden in TP windows "
                  f"{r['tp_hidden_s'] * 1e3:.1f} ms, exposed there {r['tp_exposed_s'] * 1e3:.1f} ms, on demand "
                  f"{r['on_demand_s'] * 1e3:.1f} ms; peak saved {r['peak_saved_bytes'] / 2**20:.2f} MiB")
        print(f"  lynx/none {res['lynx/none']:.3f}, on-demand/none {res['on-demand/none']:.3f}, lynx/on-demand "
              f"{res['lynx/on-demand']:.3f}; recompute hidden in TP windows {res['hidden_share']:.0%}")
        print(f"  load average {load} at start, {res['loadavg_end']} at end")
        results["runs"].append(res)
    path = ROOT / "benchmarks" / "results" / args.out
    path.write_text(json.dumps(results, indent=1))
    print(f"written {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--pps", default="1,2", help="pipeline depths to run, each with tp 2 (default 1,2)")
    ap.add_argument("--rate", type=float, default=200.0, help="link rate in Mbit/s (default 200)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=8, help="timed repetitions of each variant (after one warm-up)")
    ap.add_argument("--plan", choices=("hand", "heu"), default="hand")
    ap.add_argument("--nice", type=int, default=0, help="renice the ranks (a busy shared machine)")
    ap.add_argument("--out", default="tp_overlap.json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
