"""1F1B, interleaved 1F1B and zero bubble (ZB-H1) at one memory budget, measured against the plan.

A small GPT (``CFG``: 4 layers, so 2 chunks per rank fit under interleaving) runs on pp 2 CPU
ranks (one thread, one core each, niced as ``benchmarks/overlap_cpu.py`` does) in the test
bed's network namespaces, the pipeline link rate-limited with ``tc tbf`` where root allows
(``lynx.testbed.NetBed``). Per schedule Lynx plans with node times measured on this machine
(``lynx.analyze(times="measure")``) and the bed's pipeline link as measured before planning
(``measure_bed_link``: α, β at the boundary's message size, the host's CPU cost per byte of
traffic — ``lynx.testbed.host_probe``), under **one** memory budget for
every schedule (``--level`` of the way from the largest ``full`` peak to 1F1B's ``none``
peak), and three variants run through ``lynx.runtime.Pipeline``:

* ``lynx``       HEU's plan: recomputation in the windows it chose;
* ``on-demand``  Checkmate's plan at the same budget: the least on-demand recomputation that
                 fits, every dropped value recomputed when the backward needs it (HEU's own drops
                 cannot all run on demand: where a dropped value feeds a dropped value of a later
                 layer, HEU regenerates it in a window, and on demand the earlier layer comes
                 back only after the later one needs it);
* ``none``       keep everything (its own plan; it may not fit the budget).

All nine (schedule, variant) pipelines are built in the same processes and alternate step by
step, the order rotating every repetition; each step ends with an AdamW step. Per schedule and
variant it prints the measured step time (its slowest rank's, median over repetitions) and
bubble (mean over ranks of the step — the slowest rank's, as the plan's — not spent computing:
forward, backward, recomputation, optimizer) next to the plan's prediction, and each rank's
measured peak activation bytes (the runtime's meter) next to the plan's. Results go to
``benchmarks/results/schedules_cpu.json``.

Last, ZB-H1 + Lynx against 1F1B + Lynx (:func:`zb_verdict`): the predicted and measured step
ratios, and whether they agree. A predicted difference within ``TIE_BAND`` (±1%) of the
predicted 1F1B step is reported as a **tie** (the plan does not say which is faster), and a
measurement within the same band of 1 agrees with any prediction: a near-tie is not called a
disagreement on the sign of a difference smaller than the band. Outside the band, the
measurement agrees when it is on the prediction's side of 1.

    .venv/bin/python benchmarks/schedules_cpu.py                 # 100 Mbit/s, 8 repetitions
    .venv/bin/python benchmarks/schedules_cpu.py --rate 0 --reps 3   # loopback, quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_cpu import cpu_delta, cpu_sample  # noqa: E402
from rank_rows import print_rows, rows_from_stdout  # noqa: E402
from shared_machine import renice_session  # noqa: E402

CFG = {"vocab_size": 512, "seq_len": 128, "hidden": 256, "heads": 4, "layers": 4, "dropout": 0.0}
MICROBATCH, MICROBATCHES, PP = 2, 8, 2
SCHEDULES = ("1f1b", "interleaved1f1b", "zbh1")
VARIANTS = ("lynx", "on-demand", "none")
TIE_BAND = 0.01   # ZB vs 1F1B: a predicted difference within 1% of the predicted step is a tie


def zb_verdict(predicted: float, measured: float, band: float = TIE_BAND) -> tuple[str, str]:
    """ZB-H1's step over 1F1B's, predicted and measured: what the prediction says (``"tie"``
    within ``band`` of 1, else ``"faster"`` or ``"slower"``) and ``"agrees"`` or ``"DISAGREES"``:
    the measured ratio agrees within ``band`` of 1 or on the prediction's side of 1.

    >>> zb_verdict(1.005, 1.009), zb_verdict(1.005, 1.04), zb_verdict(1.013, 1.053), zb_verdict(0.95, 1.02)
    (('tie', 'agrees'), ('tie', 'agrees'), ('slower', 'agrees'), ('faster', 'DISAGREES'))
    """
    said = "tie" if abs(predicted - 1) <= band else "slower" if predicted > 1 else "faster"
    agrees = abs(measured - 1) <= band or (measured > 1) == (predicted > 1)
    return said, "agrees" if agrees else "DISAGREES"


def build_model() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from lynx.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    idx = torch.randint(0, CFG["vocab_size"], (MICROBATCH, CFG["seq_len"]))  # (B, T)
    return model, (idx, idx.roll(-1, dims=1))


def step_batch(rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rep)
    idx = torch.randint(0, CFG["vocab_size"], (MICROBATCHES * MICROBATCH, CFG["seq_len"]), generator=gen)
    return idx, idx.roll(-1, dims=1)


# ------------------------------------------------------------------------------- plans
def measure_bed_link(bed, nbytes: int) -> tuple[object, dict]:
    """The bed's pipeline link as this pipeline uses it (each the best of its repeats): α half a
    rested 1-byte round trip, β from a rested ``nbytes`` message (the boundary's; a tbf bucket
    full again), the token bucket
    (``LinkSpec.burst_s``: what a rested message skips of its time at the rate the link streams,
    that rate from a rested ``8 × nbytes`` message's time beyond the ``nbytes`` one's — interleaved
    1F1B sends its messages back to back, on an emptied bucket), the host's cost per byte with
    traffic both ways (lynx.testbed.host_probe)."""
    from lynx.planner.hardware import LinkSpec
    from lynx.testbed import measure_link
    from lynx.testbed.host_probe import measure_link_host

    small = measure_link(bed, nbytes=1, repeats=5, pause_s=0.05)
    large = measure_link(bed, nbytes=nbytes, repeats=5, pause_s=0.05)
    longer = measure_link(bed, nbytes=8 * nbytes, repeats=3, pause_s=0.05)
    host = measure_link_host(bed, message_bytes=nbytes)
    # the best of the repeats, as `lynx calibrate` takes a link's (CALIBRATION_METHOD 6): a repeat
    # that found the bucket not yet full, or a rank descheduled, is slower, never faster
    one, rested, eight = min(small.seconds), min(large.seconds), min(longer.seconds)
    alpha = one / 2
    rested_s = max(rested - one, 1e-9)        # nbytes' time beyond α, rested
    streamed_s = (eight - rested) / 7         # nbytes' time at the streaming rate
    burst = max(0.0, streamed_s - rested_s)
    link = LinkSpec(alpha_s=alpha, beta_bytes_per_s=nbytes / rested_s,
                    host_s_per_byte=host.host_s_per_byte, burst_s=burst)
    return link, {"round_trip_1B_s": small.seconds, "message_bytes": nbytes, "message_s": large.seconds,
                  "message_x8_s": longer.seconds, "host": str(host), "alpha_s": link.alpha_s,
                  "beta_bytes_per_s": link.beta_bytes_per_s, "host_s_per_byte": link.host_s_per_byte,
                  "burst_s": link.burst_s}


def make_plans(link_for, level: float) -> dict:
    """Per schedule the three plans (JSON) and their predictions, at one budget; ``link_for(nbytes)``
    gives the pipeline link measured with the boundary's message size (``measure_bed_link``)."""
    import lynx
    from lynx.config import CompileConfig
    from lynx.planner.hardware import get_hardware
    from lynx.planner.loop import plan_graph
    from lynx.planner.problems import build_pipeline
    from lynx.planner.simulator import simulate

    torch.set_num_threads(1)
    model, inputs = build_model()
    base = get_hardware("cpu-local")
    analysis = lynx.analyze(model, inputs, target="cpu", hardware=base, times="measure")
    graph = analysis.graph
    nbytes = build_pipeline(graph, pp=PP, microbatches=MICROBATCHES, hardware=base).boundary_bytes[0]
    link, measured = link_for(nbytes)
    hw = base.model_copy(update={"links": {**base.links, "pp": link, "dp": link}})
    common = {"pp": PP, "microbatches": MICROBATCHES, "hardware": hw, "target": "cpu", "virtual_stages": 2}
    peaks = {}
    for schedule in SCHEDULES:
        for solver in ("none", "full"):
            p = plan_graph(graph, CompileConfig(solver=solver, memory_budget=1 << 40, schedule=schedule, **common))
            peaks[(schedule, solver)] = max(p.predicted.peak_memory_bytes)
    floor = max(peaks[(s, "full")] for s in SCHEDULES)
    budget = int(floor + level * max(0, peaks[("1f1b", "none")] - floor))
    out = {"budget": budget, "schedules": {}, "link": measured, "graph": graph}
    for schedule in SCHEDULES:
        cfg = CompileConfig(solver="heu", memory_budget=budget, schedule=schedule, time_limit_s=30, **common)
        plans = {"lynx": plan_graph(graph, cfg, check_budget=False),
                 "on-demand": plan_graph(graph, cfg.replace(solver="checkmate"), check_budget=False),
                 "none": plan_graph(graph, cfg.replace(solver="none"), check_budget=False)}
        predicted = {}
        for variant, plan in plans.items():
            sim = simulate(plan, graph)
            # per rank, each compute action as the replay timed it (start of its host work → end)
            actions = [[[f"{a.kind}{'' if sim.timeline.pipeline.virtual == 1 else f'.c{a.chunk}'}", a.microbatch,
                         a.ready, a.start, a.end] for a in acts] for acts in sim.timeline.actions]
            predicted[variant] = {"step_s": sim.step_time_s, "bubble_s": sim.bubble_s, "fits": sim.fits_budget,
                                  "busy_s": list(sim.timeline.busy_s), "actions": actions,
                                  "activation_bytes": list(sim.activation_bytes),
                                  "recomputed": sum(d.action == "recompute" for st in plan.stages
                                                    for d in st.decisions)}
        out["schedules"][schedule] = {"plans": {v: p.to_json() for v, p in plans.items()}, "predicted": predicted}
    return out


# ------------------------------------------------------------------------------- worker
def worker(spec_path: str) -> None:
    import torch.distributed as dist

    import lynx
    from lynx.plan import Plan
    from lynx.planner.simulator import config_from_record
    from lynx.testing import captured_with_plan

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    renice_session(spec["nice"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")   # the script's: nine Pipelines share it
    model, inputs = build_model()
    model.train()
    # the parent planned for this very model: capture once, pair it with each plan
    first = Plan.from_json(spec["schedules"]["1f1b"]["plans"]["none"])
    base = captured_with_plan(model, inputs, first, config_from_record(first.config))
    pipes = {}
    for schedule in SCHEDULES:
        for variant in VARIANTS:
            plan = Plan.from_json(spec["schedules"][schedule]["plans"][variant])
            pipes[(schedule, variant)] = lynx.runtime.Pipeline(dataclasses.replace(base, plan=plan), timeout_s=600,
                                                               exit_on_error=False, trace=spec["trace"])
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-5)
    keys = list(pipes)
    rows = []
    for rep in range(spec["reps"] + 1):   # rep 0 warms up
        idx, tgt = step_batch(rep)
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            dist.barrier()
            cpu0 = cpu_sample() if spec["trace"] else None   # /proc read only where a trace keeps it
            pipes[key].step(idx, tgt)
            cpu1 = cpu_sample() if spec["trace"] else None
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            opt_s = time.perf_counter() - t0
            s = pipes[key].last_stats
            if rep > 0:
                busy = s.forward_s + s.backward_s + s.recompute_hidden_s + s.recompute_window_exposed_s + opt_s
                rows.append({"schedule": key[0], "variant": key[1], "rep": rep, "rank": rank,
                             "step_s": s.step_s + opt_s, "bubble_s": s.step_s + opt_s - busy,
                             "peak_saved_bytes": s.peak_saved_bytes, "hidden_s": s.recompute_hidden_s,
                             "exposed_s": s.exposed_recompute_s})
                if spec["trace"]:   # each action's (what, microbatch, start, end) from the step's start
                    rows[-1]["events"] = [(w, j, a - s.events[0][2], b - s.events[0][2]) for w, j, a, b in s.events]
                    assert cpu0 is not None and cpu1 is not None
                    rows[-1]["cpu"] = cpu_delta(cpu0, cpu1)   # the core's time: gloo's threads, softirqs
    print_rows(rows)
    for pipe in pipes.values():
        pipe.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver
def summarise(rows: list[dict], plans: dict) -> dict:
    out: dict = {}
    for schedule in SCHEDULES:
        for variant in VARIANTS:
            mine = [r for r in rows if r["schedule"] == schedule and r["variant"] == variant]
            reps = sorted({r["rep"] for r in mine})
            per_rep = [max(r["step_s"] for r in mine if r["rep"] == k) for k in reps]   # slowest rank's
            step = statistics.median(per_rep)
            q = statistics.quantiles(per_rep, n=4) if len(per_rep) > 1 else per_rep * 3
            # per rank, the step (its slowest rank's, as the plan's step is its last device's end) less
            # the rank's compute: a rank done early idles until the step ends, as the plan counts it
            bubble = statistics.median(statistics.mean(step_k - r["step_s"] + r["bubble_s"] for r in mine
                                                       if r["rep"] == k)
                                       for k, step_k in zip(reps, per_rep))
            peaks = [max(r["peak_saved_bytes"] for r in mine if r["rank"] == s) for s in range(PP)]
            pred = plans["schedules"][schedule]["predicted"][variant]
            out[f"{schedule}/{variant}"] = {
                "step_s": step, "step_q1_s": q[0], "step_q3_s": q[2], "predicted_step_s": pred["step_s"],
                "step_ratio": step / pred["step_s"],
                "bubble_s": bubble, "predicted_bubble_s": pred["bubble_s"],
                "bubble_ratio": bubble / pred["bubble_s"] if pred["bubble_s"] else None,
                # compute (the step less its bubble) against the plan's: how much slower the ranks
                # computed than the profile measured (the load), apart from the schedule
                "busy_ratio": (step - bubble) / (pred["step_s"] - pred["bubble_s"]),
                "peak_saved_bytes": peaks, "predicted_activation_bytes": pred["activation_bytes"],
                "peak_ratio": [m / p if p else None for m, p in zip(peaks, pred["activation_bytes"])],
                "fits": pred["fits"], "recomputed_nodes": pred["recomputed"],
                "hidden_s": statistics.median(r["hidden_s"] for r in mine),
                "exposed_s": statistics.median(r["exposed_s"] for r in mine)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0, help="pipeline link Mbit/s (0: loopback, not limited)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--level", type=float, default=0.3, help="budget: from the largest full peak (0) to 1F1B none (1)")
    ap.add_argument("--nice", type=int, default=-10, help="niceness increment of the ranks (negative needs root)")
    ap.add_argument("--out", default="schedules_cpu.json")
    ap.add_argument("--worker")
    ap.add_argument("--plans-only", action="store_true", help="print the plans' predictions and stop")
    ap.add_argument("--trace", help="also write every rank's per-action timestamps, the plan's and the plans to this "
                    "JSON file, and the timed graph they were made for to FILE.graph.pkl (to replay them otherwise)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from lynx.testbed import NetBed, measure_link

    renice_session(args.nice)
    started = time.perf_counter()
    with NetBed(world_size=PP, rate_mbit=args.rate or None) as bed:
        limited = bed.rate_limited
        plans = make_plans(lambda nbytes: measure_bed_link(bed, nbytes), args.level)
        print(f"pipeline link as measured: {plans['link']}")
        for schedule in SCHEDULES:
            for variant, p in plans["schedules"][schedule]["predicted"].items():
                print(f"plan {schedule:>15}/{variant:<9}: predicted step {p['step_s'] * 1e3:7.1f} ms, bubble "
                      f"{p['bubble_s'] * 1e3:6.1f} ms, activations "
                      f"{[round(b / 2**20, 2) for b in p['activation_bytes']]} MiB, "
                      f"{'fits' if p['fits'] else 'does NOT fit'} {plans['budget'] / 2**20:.1f} MiB, "
                      f"{p['recomputed']} nodes recomputed")
        graph = plans.pop("graph")
        if args.trace:   # the node times measured here: simulate(plan, graph) replays a plan again
            Path(args.trace + ".graph.pkl").write_bytes(pickle.dumps(graph))
        if args.plans_only:
            return
        spec = {"schedules": plans["schedules"], "reps": args.reps, "nice": args.nice, "trace": bool(args.trace)}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        load = os.getloadavg()
        link = measure_link(bed) if limited else None
        out = bed.run([sys.executable, __file__, "--worker", f.name],
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, timeout_s=3600)
    os.unlink(f.name)
    rows = rows_from_stdout(out[0].stdout)
    res = summarise(rows, plans)
    if args.trace:
        Path(args.trace).write_text(json.dumps({"rows": rows, "predicted": {
            k: {v: {"actions": p["actions"], "busy_s": p["busy_s"], "step_s": p["step_s"]}
                for v, p in sch["predicted"].items()} for k, sch in plans["schedules"].items()},
            "plans": {k: sch["plans"] for k, sch in plans["schedules"].items()}}))
    print(f"\nbed: rate-limited={limited}" + (f", {link}" if link else "") + f"; load {load} at start, "
          f"{os.getloadavg()} at end")
    print(f"{'schedule/variant':>26} {'step ms [IQR]':>21} {'pred':>7} {'ratio':>6} | {'bubble ms':>9} {'pred':>7} "
          f"{'ratio':>6} | {'busy ratio':>10} | peak/plan per rank")
    for key, r in res.items():
        bub = f"{r['bubble_ratio']:.2f}" if r["bubble_ratio"] is not None else "-"
        iqr = f"{r['step_s'] * 1e3:.1f} [{r['step_q1_s'] * 1e3:.0f}–{r['step_q3_s'] * 1e3:.0f}]"
        print(f"{key:>26} {iqr:>21} {r['predicted_step_s'] * 1e3:7.1f} {r['step_ratio']:6.2f} | "
              f"{r['bubble_s'] * 1e3:9.1f} {r['predicted_bubble_s'] * 1e3:7.1f} {bub:>6} | {r['busy_ratio']:10.2f} | "
              + " ".join(f"{x:.3f}" if x else "-" for x in r["peak_ratio"]))
    if args.trace:   # per rank and step, what took the rank's core besides its compute (rank_cpu.py)
        print(f"{'core time per step, ms':>26} gloo threads · softirqs · main thread waited runnable, rank 0 | 1")
        for key in res:
            mine = [r for r in rows if f"{r['schedule']}/{r['variant']}" == key and "cpu" in r]
            per = [[statistics.mean(r["cpu"][f] for r in mine if r["rank"] == q) * 1e3 for q in range(PP)]
                   for f in ("other_threads_s", "softirq_s", "main_waited_s")]
            print(f"{key:>26} " + " | ".join(" · ".join(f"{per[f][q]:5.1f}" for f in range(3)) for q in range(PP)))
    zb, base = res["zbh1/lynx"], res["1f1b/lynx"]
    ratios = (zb["predicted_step_s"] / base["predicted_step_s"], zb["step_s"] / base["step_s"])
    said, verdict = zb_verdict(*ratios)
    print(f"zero bubble + Lynx vs 1F1B + Lynx: predicted {ratios[0]:.3f}× ({said}, band ±{TIE_BAND:.0%}), "
          f"measured {ratios[1]:.3f}× ({verdict})")
    result = {"when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": CFG, "pp": PP,
              "microbatch": MICROBATCH, "microbatches": MICROBATCHES, "reps": args.reps, "level": args.level,
              "budget_bytes": plans["budget"], "rate_mbit": args.rate, "rate_limited": limited,
              "link": str(link) if link else "loopback, not limited", "planned_link": plans["link"],
              "loadavg_start": load,
              "loadavg_end": os.getloadavg(), "wall_s": time.perf_counter() - started, "results": res,
              "zb_vs_1f1b": {"predicted": ratios[0], "measured": ratios[1], "band": TIE_BAND, "predicted_says": said,
                             "verdict": verdict}}
    path = ROOT / "benchmarks" / "results" / args.out
    path.write_text(json.dumps(result, indent=1))
    print(f"written {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
