"""Overlapped vs on-demand recomputation, measured on real processes over rate-limited links.

Runs a GPT over ``pp`` × ``dp`` CPU ranks (one thread each) in the test bed's network
namespaces (``lynx.testbed.NetBed``: veth links limited with ``tc tbf``), 8 microbatches per
step, 1F1B, and in the same processes and run alternates four variants step by step:

* ``none``        keep every saved tensor (no recomputation; needs the most memory);
* ``checkpoint``  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around each
                  run of the plan's dropped nodes (for the hand plan: each layer but its final
                  residual add) — the baseline users compare against (Megatron full recompute);
* ``on-demand``   the same drops through Lynx's own hooks, recomputed when backward unpacks
                  them (the mechanism of non-reentrant checkpoint; only *when* differs from lynx);
* ``lynx``        the same drops, recomputed in the plan's windows while the gradient is on
                  the wire (whatever a window cannot hold stays on demand).

It prints, per topology, the median step time of each variant, the ratios (median over
repetitions of the per-repetition ratio: variants of one repetition run back to back), the
exposed and hidden recompute and the measured peak saved-activation bytes per stage, the link
rate and what a boundary transfer costs next to a stage's compute, the load average, and
what the no-noise event model (``overlap_model.py``) gives for the single-thread costs measured
before the run and for the run's own costs (the best ratio they allow). The model, data,
plans and cost measurement are in ``overlap_setup.py``, the checkpoint stage in
``overlap_baseline.py``; method and figures in ``docs/runtime.md``.
Results go to ``benchmarks/results/overlap_cpu.json`` (``--out``).

Usage::

    python benchmarks/overlap_cpu.py                       # pp 2 and pp 2 × dp 2, hand plan
    python benchmarks/overlap_cpu.py --dps 2 --rates 75 --optimizer allreduce   # AdamW all-reduce
    python benchmarks/overlap_cpu.py --plan opt --dps 1 --save-plan my_plan.json   # OPT, calibrated here
    python benchmarks/overlap_cpu.py --plan overlap_cpu_plan_opt.json   # a saved plan
    python benchmarks/overlap_cpu.py --dps 1 --reps 2 --trace   # print each rank's timeline
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overlap_baseline import CheckpointStage
from rank_rows import print_rows, rows_from_stdout
from shared_machine import renice_session
from overlap_model import Stage, best_transfer_ms, simulate
from overlap_setup import (
    CFG,
    MICROBATCH,
    build_model,
    lynx_plan,
    make_schedules,
    stage_costs,
    token_batches,
)

VARIANTS = ("none", "checkpoint", "on-demand", "lynx")


# ------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import lynx
    from lynx.plan import StageSchedule
    from lynx.rewrite.build import split_cached
    from lynx.testing import with_stages

    torch.set_num_threads(1)
    spec = json.loads(Path(args.spec).read_text())
    # Before gloo starts its threads (affinity and niceness are per thread; new ones inherit).
    # A core per rank where there are enough; else a stage's replicas share one core (they run
    # in step, so a core idles exactly when its stage waits; a core shared by the two stages of
    # one pipeline would hand stage 0's window to stage 1's compute, on the critical path).
    rank, world = int(os.environ["RANK"]), spec["pp"] * spec["dp"]
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(
        0, {cores[rank % len(cores)] if world <= len(cores) else cores[rank // spec["dp"] % len(cores)]}
    )
    renice_session(spec["nice"])
    dist.init_process_group("gloo")   # the script's: four Pipelines share it
    model, inputs = build_model()
    model.train()
    # every variant runs the same split through lynx.runtime.Pipeline; the plans differ
    base = lynx.compile(model, inputs, pp=spec["pp"], dp=spec["dp"], microbatches=spec["microbatches"],
                        solver="none", hardware="cpu-local", memory_budget=1 << 40)
    schedules = [
        StageSchedule(dropped=frozenset(sch["dropped"]),
                      prefetch={int(j): [(w, n) for w, n in v] for j, v in sch["prefetch"].items()})
        for sch in spec["schedules"]
    ]
    keep = [StageSchedule(dropped=frozenset()) for _ in schedules]
    hand = with_stages(base, schedules, stage_nodes=spec["nodes"], schedule=spec["schedule"])
    plain = with_stages(base, keep, stage_nodes=spec["nodes"], schedule=spec["schedule"])
    parts = split_cached(base.analysis.captured.gm, spec["nodes"])
    optimizer = None
    common = {"timeout_s": 300, "bucket_bytes": 256 << 10, "trace": spec.get("trace", False), "exit_on_error": False}
    none = lynx.runtime.Pipeline(plain, **common)
    topo = none.topology
    s = topo.stage
    # torch.utils.checkpoint around the same drops, as this rank's stage
    baseline = CheckpointStage(parts[s], schedules[s].dropped) if schedules[s].dropped else None
    pipes = {
        "none": none,
        "checkpoint": lynx.runtime.Pipeline(hand, prefetch=False, stage=baseline, **common),
        "on-demand": lynx.runtime.Pipeline(hand, prefetch=False, **common),
        "lynx": lynx.runtime.Pipeline(hand, **common),
    }
    if spec["optimizer"] == "lion" and topo.dp > 1:
        from lynx.optim import DistributedLion

        optimizer = DistributedLion(
            list(parts[s].gm.parameters()), lr=1e-5, process_group=topo.dp_group, bucket_bytes=256 << 10
        )
        for pipe in pipes.values():
            pipe.use_optimizer(optimizer)   # buckets sent during the last backward; step() finishes them
    # each pipe draws dropout from its rank's own stream, seeded 1009·replica + stage (lynx.runtime.rank_rng)
    rows = []
    block = spec.get("block", 0)
    m = spec["microbatches"]
    for rep in range(spec["reps"] + 1):  # rep 0 warms up
        order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]  # rotate: no fixed order
        parts_of_step = [mb for d in range(topo.dp) for mb in token_batches(base.analysis.captured.input_names,
                                                                             rep, d, m)]
        batch = [torch.cat([mb[n] for mb in parts_of_step]) for n in base.analysis.captured.input_names]
        for variant in order:
            # with blocks, a variant's first step (after another variant's) is not timed: what a
            # step leaves behind (allocator, caches) then comes from the same variant, as in training
            for i in range(block + 1):
                dist.barrier()
                pipes[variant].step(*batch)
                stats = pipes[variant].last_stats
                if optimizer is not None:   # the step as before: the compressed optimizer's update included
                    t0 = time.perf_counter()
                    optimizer.step()
                    optimizer.zero_grad()
                    stats.step_s += time.perf_counter() - t0
                    stats.wait_sync_s += time.perf_counter() - t0
                if rep > 0 and (block == 0 or i > 0):
                    rows.append({"variant": variant, "rep": rep, "i": i, **stats.as_dict()})
    print_rows(rows)
    for pipe in pipes.values():
        pipe.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver
def summarize(rows: list[dict], pp: int, dp: int) -> dict:
    out: dict = {"pp": pp, "dp": dp, "variants": {}}
    reps = sorted({r["rep"] for r in rows})

    def rep_step(v: str, k: int) -> float:
        # a step ends when its slowest rank does; a block's steps: their median
        mine = [r for r in rows if r["variant"] == v and r["rep"] == k]
        return statistics.median(max(r["step_s"] for r in mine if r["i"] == i) for i in {r["i"] for r in mine})

    steps = {v: {k: rep_step(v, k) for k in reps} for v in VARIANTS}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        per_stage = {}
        for s in range(pp):
            st = [r for r in mine if r["stage"] == s]
            per_stage[s] = {
                "exposed_recompute_s": statistics.median(r["exposed_recompute_s"] for r in st),
                "hidden_recompute_s": statistics.median(r["recompute_hidden_s"] for r in st),
                "wait_s": statistics.median(r["wait_s"] for r in st),
                "forward_s": statistics.median(r["forward_s"] for r in st),
                "backward_s": statistics.median(r["backward_s"] for r in st),
                "peak_saved_bytes": max(r["peak_saved_bytes"] for r in st),
                "peak_held_bytes": max(r["peak_held_bytes"] for r in st),
            }
        out["variants"][variant] = {
            "step_s": statistics.median(steps[variant].values()),
            "step_s_per_rep": [steps[variant][k] for k in reps],
            "stages": per_stage,
        }

    def ratio(a: str, b: str) -> dict:
        per_rep = [steps[a][k] / steps[b][k] for k in reps]
        qs = statistics.quantiles(per_rep, n=4) if len(per_rep) > 1 else per_rep * 3
        return {
            "median": statistics.median(per_rep),
            "q1": qs[0],
            "q3": qs[2],
            "of_medians": out["variants"][a]["step_s"] / out["variants"][b]["step_s"],
        }

    out["ratios"] = {
        f"{a}/{b}": ratio(a, b)
        for a, b in (
            ("lynx", "checkpoint"),
            ("lynx", "on-demand"),
            ("lynx", "none"),
            ("checkpoint", "none"),
            ("on-demand", "none"),
            ("on-demand", "checkpoint"),
        )
    }
    return out


def print_trace(rows: list[dict]) -> None:
    """Each rank's timeline of the last repetition, ms from the variant's earliest start."""
    last = max((r["rep"], r["i"]) for r in rows)
    mine = [r for r in rows if (r["rep"], r["i"]) == last]
    zero = {v: min(r["events"][0][2] for r in mine if r["variant"] == v) for v in {r["variant"] for r in mine}}
    for r in sorted(mine, key=lambda r: (r["variant"], r["rank"])):
        merged: list[list] = []
        for what, j, t0, t1 in r["events"]:
            t0, t1 = t0 - zero[r["variant"]], t1 - zero[r["variant"]]
            if merged and merged[-1][0] == what and merged[-1][1] == j and t0 - merged[-1][3] < 2e-3:
                merged[-1][3] = t1
            else:
                merged.append([what, j, t0, t1])
        cells = " ".join(f"{w}{j}[{t0 * 1e3:.0f}-{t1 * 1e3:.0f}]" for w, j, t0, t1 in merged if t1 - t0 > 5e-4)
        print(f"{r['variant']:>10} rank {r['rank']} step {r['step_s']:.3f}: {cells}")


def print_summary(res: dict) -> None:
    print(f"\n== pp {res['pp']} × dp {res['dp']}, {res['link']} ==")
    print(f"{'variant':>10} {'step s':>8} | per stage: exposed s / hidden s / wait s / peak saved MiB")
    for variant, v in res["variants"].items():
        cells = "  ".join(
            f"s{s}: {x['exposed_recompute_s']:.3f}/{x['hidden_recompute_s']:.3f}/{x['wait_s']:.3f}/"
            f"{x['peak_saved_bytes'] / 2**20:.2f}"
            for s, x in v["stages"].items()
        )
        print(f"{variant:>10} {v['step_s']:>8.3f} | {cells}")
    print("ratios (median of per-repetition ratios [quartiles]; ratio of medians):")
    for name, r in res["ratios"].items():
        print(f"  {name:>22} = {r['median']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}]; {r['of_medians']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rates",
        default="150,60",
        help="link rate in Mbit/s per entry of --dps (on 2 cores a dp-2 rank shares its core with "
        "its stage's other replica, so computes about half as fast: a lower rate keeps "
        "transfer / compute comparable)",
    )
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dps", default="1,2")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument(
        "--block",
        type=int,
        default=0,
        help="timed steps of each variant in a row per repetition, after an untimed one "
        "(0: one timed step each, variants interleaved)",
    )
    ap.add_argument(
        "--optimizer",
        default="lion",
        choices=("allreduce", "lion"),
        help="data-parallel sync: allreduce (mean of gradients, AdamW's) or DistributedLion (1 bit)",
    )
    ap.add_argument(
        "--plan",
        default="hand",
        help="a solver for Lynx's plan (opt, heu), 'hand' (Megatron-full "
        "drops, the stage's last layer in every gradient window), or a plan saved with --save-plan "
        "(NAME.json under benchmarks/results/)",
    )
    ap.add_argument("--save-plan", help="write the plan used to benchmarks/results/SAVE_PLAN (reuse with --plan)")
    ap.add_argument("--nice", type=int, default=-10, help="niceness increment of the ranks (negative needs root)")
    ap.add_argument("--trace", action="store_true", help="print each rank's timeline of the last repetition")
    ap.add_argument("--out", default="overlap_cpu.json", help="results file under benchmarks/results/")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--plan-worker", action="store_true")
    ap.add_argument("--spec")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.plan_worker:
        spec = json.loads(Path(args.spec).read_text())
        renice_session(spec["nice"])
        if spec["solver"] == "hand":
            plan = make_schedules(spec["pp"], spec["microbatches"])
        elif spec["solver"].endswith(".json"):
            saved = json.loads(Path(spec["solver"]).read_text())
            plan = (saved["nodes"], saved["schedules"], saved["source"] + f" (saved in {Path(spec['solver']).name})")
        else:
            plan = lynx_plan(spec["pp"], spec["microbatches"], spec["schedule"], spec["rate_mbit"], spec["solver"])
        Path(args.spec).write_text(json.dumps({"plan": [plan, stage_costs(plan[0], plan[1])]}))
        return
    run(args)


def prepare(args: argparse.Namespace, rate: float) -> tuple[list, list, str, dict]:
    """The plan and the stage costs, in a session of their own niced like the ranks (measured
    times see fewer of the machine's other jobs)."""
    solver = str((ROOT / "benchmarks" / "results" / args.plan).resolve()) if args.plan.endswith(".json") else args.plan
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {
                "pp": args.pp,
                "microbatches": args.microbatches,
                "schedule": args.schedule,
                "rate_mbit": rate,
                "solver": solver,
                "nice": args.nice,
            },
            f,
        )
    subprocess.run(
        [sys.executable, __file__, "--plan-worker", "--spec", f.name],
        check=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    (nodes, schedules, source), costs = json.loads(Path(f.name).read_text())["plan"]
    os.unlink(f.name)
    if args.save_plan:
        path = ROOT / "benchmarks" / "results" / args.save_plan
        path.write_text(json.dumps({"nodes": nodes, "schedules": schedules, "source": source}, indent=1))
        print(f"plan written to {os.path.relpath(path, ROOT)}")
    return nodes, schedules, source, costs


def run_costs(rows: list[dict], pp: int, m: int) -> list[Stage]:
    """Per-microbatch costs (ms) of each stage as this run measured them (wall clock, the
    machine's load included): forward and backward of ``none``, recompute of ``on-demand``."""
    out = []
    for s in range(pp):
        none = [r for r in rows if r["variant"] == "none" and r["stage"] == s]
        od = [r for r in rows if r["variant"] == "on-demand" and r["stage"] == s]
        out.append(
            Stage(
                statistics.median(r["forward_s"] for r in none) / m * 1e3,
                statistics.median(r["backward_s"] for r in none) / m * 1e3,
                statistics.median(r["recompute_on_demand_s"] for r in od) / m * 1e3,
            )
        )
    return out


def run(args: argparse.Namespace) -> None:
    from lynx.testbed import NetBed, measure_link

    dps = [int(x) for x in args.dps.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    rates = rates if len(rates) == len(dps) else [rates[0]] * len(dps)
    nodes, schedules, source, costs = prepare(args, rates[0])
    quiet = [Stage(c["forward_ms"], c["backward_ms"], c["recompute_ms"]) for c in costs["stages"]]
    print(f"model: GPT {CFG}, microbatch {MICROBATCH}, {args.microbatches} microbatches, {args.schedule}")
    print(f"plan: {source}")
    for s, c in enumerate(quiet):
        print(
            f"stage {s}, one microbatch, 1 thread, CPU time: forward {c.f:.1f} ms, backward {c.b:.1f} ms, "
            f"recompute of its drops {c.r:.1f} ms"
        )
    if args.pp == 2:
        x = best_transfer_ms(quiet)
        print(
            f"event model: Lynx gains most at {x:.1f} ms per transfer (round trip = S0 + 2R), i.e. "
            f"{costs['boundary_bytes'] * 8 / (x * 1e3):.0f} Mbit/s on a core per rank"
        )
    results = {
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_start": os.getloadavg(),
        "cores": len(os.sched_getaffinity(0)),
        "schedule": args.schedule,
        "microbatches": args.microbatches,
        "reps": args.reps,
        "block": args.block,
        "optimizer": args.optimizer,
        "nice": args.nice,
        "model": CFG,
        "microbatch": MICROBATCH,
        "plan": source,
        "stage_costs": costs,
        "runs": [],
    }
    for dp, rate in zip(dps, rates):
        world = args.pp * dp
        spec = {
            "pp": args.pp,
            "dp": dp,
            "nodes": nodes,
            "schedules": schedules,
            "microbatches": args.microbatches,
            "schedule": args.schedule,
            "reps": args.reps,
            "trace": args.trace,
            "optimizer": args.optimizer,
            "nice": args.nice,
            "block": args.block,
        }
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        load = os.getloadavg()
        with NetBed(world_size=world, rate_mbit=rate) as bed:
            limited = bed.rate_limited  # read inside: a closed bed reports False
            link = measure_link(bed) if limited else None
            transfer_ms = costs["boundary_bytes"] * 8 / (link.measured_mbit * 1e3) if link else 0.0
            print(
                f"\nbed: {world} ranks, rate-limited={limited}, "
                + (f"{link}" if link else f"({bed.fallback_reason})")
                + f"; boundary {costs['boundary_bytes'] / 1024:.0f} KiB = {transfer_ms:.1f} ms each way "
                f"({transfer_ms / (quiet[0].f + quiet[0].b):.0%} of stage 0's forward+backward on a core of its own)"
            )
            out = bed.run(
                [sys.executable, __file__, "--worker", "--spec", f.name],
                env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                timeout_s=1800,
            )
        os.unlink(f.name)
        rows = rows_from_stdout(out[0].stdout)
        if args.trace:
            print_trace(rows)
        res = summarize(rows, args.pp, dp)
        res.update(
            rate_mbit=rate,
            rate_limited=limited,
            link=str(link) if link else "loopback, not limited",
            transfer_ms=transfer_ms,
            loadavg_start=load,
            loadavg_end=os.getloadavg(),
        )
        if args.schedule == "1f1b" and transfer_ms:
            shared = 2.0 if world > len(os.sched_getaffinity(0)) else 1.0
            own = run_costs(rows, args.pp, args.microbatches)
            res["run_costs_ms"] = [vars(c) for c in own]
            res["model_quiet_ms"] = simulate([c.scaled(shared) for c in quiet], transfer_ms, args.microbatches)
            res["model_run_ms"] = simulate(own, transfer_ms, args.microbatches)
        print_summary(res)
        for key, what in (("model_quiet_ms", "single-thread costs"), ("model_run_ms", "this run's own costs")):
            if key in res:
                print(
                    f"no-noise event model, {what} (ms): "
                    + ", ".join(f"{k} {v:.3f}" if "/" in k else f"{k} {v:.0f}" for k, v in res[key].items())
                )
        print(f"load average (1, 5, 15 min): {load} at start, {res['loadavg_end']} at end")
        results["runs"].append(res)
    results["loadavg_end"] = os.getloadavg()
    path = ROOT / "benchmarks" / "results" / args.out
    path.write_text(json.dumps(results, indent=1))
    print(f"written {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
