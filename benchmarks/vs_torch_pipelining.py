"""Lynx's runtime against ``torch.distributed.pipelining``'s ``Schedule1F1B``, same model, same split.

A GPT written here (not Lynx's preset: 8 layers, hidden 256, seq 128, 4 heads, explicit softmax
attention; ``forward(idx) -> logits``) is split in two at the layer boundary Lynx's planner
picks for pp 2. Each of the 2 ranks (one thread, one core each) builds both runtimes over its
own copy of the model: Lynx (``lynx.runtime.Pipeline`` with plan ``none``: nothing recomputed)
and torch (``PipelineStage`` + ``Schedule1F1B``, no activation checkpointing), 8 microbatches,
the same loss (cross entropy, scaled by 1/m) and data, and they alternate step by step in one
run (the order rotating), each step started by a barrier; a step's time is its slowest rank's.
A third variant, ``lynx_whole``, is Lynx with each backward run whole (its input gradients sent
after its weight gradients, as torch's schedule does: ``StageRunner.send_grads_first = False``),
so the gain of sending them first is measured in the same run.
Links: loopback, and the network-namespace test bed rate-limited to 100 Mbit/s where root
allows (``lynx.testbed.NetBed``).

Prints per link the median step time of each, the ratio Lynx/torch (median of per-repetition
ratios, and its quartiles), how many repetitions Lynx was slower, and where Lynx's step time
goes on each rank (forward, backward, waits, and the host work outside them). Results go to
``benchmarks/results/vs_torch_pipelining.json``.

    .venv/bin/python benchmarks/vs_torch_pipelining.py              # loopback and 100 Mbit/s
    .venv/bin/python benchmarks/vs_torch_pipelining.py --reps 4 --links loopback
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_rows import print_rows, rows_from_stdout  # noqa: E402
from shared_machine import renice_session  # noqa: E402

CFG = {"vocab": 512, "seq": 128, "hidden": 256, "heads": 4, "layers": 8}
MICROBATCH, MICROBATCHES = 4, 8


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, d)
        att = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5                           # (B, h, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        h = CFG["hidden"]
        self.tok, self.pos = nn.Embedding(CFG["vocab"], h), nn.Embedding(CFG["seq"], h)
        self.layers = nn.ModuleList(Block(h, CFG["heads"]) for _ in range(CFG["layers"]))
        self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, CFG["vocab"], bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


class Part(nn.Module):
    """Layers ``[lo, hi)`` of ``model``, with the embeddings first / the head last."""

    def __init__(self, model: GPT, lo: int, hi: int) -> None:
        super().__init__()
        self.model, self.lo, self.hi = model, lo, hi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        if self.lo == 0:
            x = m.tok(x) + m.pos(torch.arange(x.shape[1], device=x.device))
        for layer in m.layers[self.lo:self.hi]:
            x = layer(x)
        return m.head(m.ln_f(x)) if self.hi == len(m.layers) else x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CFG["vocab"]), target.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CFG["vocab"], (MICROBATCHES * MICROBATCH, CFG["seq"] + 1), generator=gen)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def worker(reps: int, nice: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import lynx

    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    renice_session(nice)   # before gloo starts its threads (they inherit it)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ours, theirs = GPT(), GPT()
    theirs.load_state_dict(ours.state_dict())
    example = batch(0)[0][:MICROBATCH]
    compiled = lynx.compile(ours, (example,), pp=2, microbatches=MICROBATCHES, solver="none", hardware="cpu-local",
                            memory_budget=1 << 40, loss_fn=loss_fn)
    pipe = lynx.runtime.Pipeline(compiled, loss_fn=loss_fn, timeout_s=300, exit_on_error=False)
    split = sum(b.startswith("layers.") for b in compiled.plan.stage(0).blocks)   # Lynx's boundary, for torch too
    lo, hi = (0, split) if rank == 0 else (split, CFG["layers"])
    part = Part(theirs, lo, hi)
    probe = example if rank == 0 else torch.zeros(MICROBATCH, CFG["seq"], CFG["hidden"])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), input_args=(probe,))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=True)

    def run_lynx(idx: torch.Tensor, tgt: torch.Tensor) -> None:
        pipe.runner.send_grads_first = True
        pipe.step(idx, target=tgt)

    def run_lynx_whole(idx: torch.Tensor, tgt: torch.Tensor) -> None:
        pipe.runner.send_grads_first = False   # each B whole, its input gradients sent after it
        pipe.step(idx, target=tgt)

    def run_torch(idx: torch.Tensor, tgt: torch.Tensor) -> None:
        theirs.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(idx)
        else:
            schedule.step(target=tgt, losses=[])

    variants = {"lynx": run_lynx, "torch": run_torch, "lynx_whole": run_lynx_whole}
    rows = []
    for rep in range(reps + 1):   # rep 0 warms up
        idx, tgt = batch(rep)
        names = list(variants)
        order = names[rep % len(names):] + names[:rep % len(names)]   # each variant first, middle, last in turn
        for name in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            variants[name](idx, tgt)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            if rep > 0:
                row = {"variant": name, "rep": rep, "rank": rank, "step_s": elapsed, "cpu_s": cpu}
                if name != "torch":
                    s = pipe.last_stats
                    row.update(forward_s=s.forward_s, backward_s=s.backward_s, wait_s=s.wait_s,
                               runner_step_s=s.step_s)
                rows.append(row)
    print_rows(rows)
    pipe.close()
    dist.destroy_process_group()


def _ratio(step: dict, a: str, b: str, reps: list[int]) -> tuple[float, float, float, int]:
    """Median of the per-repetition ratios a/b, its quartiles, and in how many a was slower."""
    ratios = [step[a][k] / step[b][k] for k in reps]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), q[0], q[2], sum(x > 1 for x in ratios)


def summarise(rows: list[dict]) -> dict:
    reps = sorted({r["rep"] for r in rows})
    variants = [v for v in ("lynx", "torch", "lynx_whole") if any(r["variant"] == v for r in rows)]
    step = {v: {k: max(r["step_s"] for r in rows if r["variant"] == v and r["rep"] == k) for k in reps}
            for v in variants}
    median, q1, q3, slower = _ratio(step, "lynx", "torch", reps)
    # CPU seconds of the process (every thread: compute, gloo's copies, host work), summed over the
    # ranks: what each engine costs the machine, much less sensitive to the load than the wall clock
    cpu = {v: {k: sum(r["cpu_s"] for r in rows if r["variant"] == v and r["rep"] == k) for k in reps}
           for v in ("lynx", "torch")}
    cpu_ratios = [cpu["lynx"][k] / cpu["torch"][k] for k in reps]
    cq = statistics.quantiles(cpu_ratios, n=4) if len(cpu_ratios) > 1 else cpu_ratios * 3
    out = {"lynx_step_s": statistics.median(step["lynx"].values()),
           "torch_step_s": statistics.median(step["torch"].values()),
           "ratio_median": median, "ratio_q1": q1, "ratio_q3": q3, "lynx_slower_reps": slower, "reps": len(reps),
           "lynx_cpu_s": statistics.median(cpu["lynx"].values()),
           "torch_cpu_s": statistics.median(cpu["torch"].values()),
           "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_q1": cq[0], "cpu_ratio_q3": cq[2],
           "ranks": {}}
    if "lynx_whole" in step:   # the same engine with each B whole (input gradients sent after it)
        w = _ratio(step, "lynx_whole", "torch", reps)
        g = _ratio(step, "lynx", "lynx_whole", reps)
        out.update(lynx_whole_step_s=statistics.median(step["lynx_whole"].values()),
                   whole_ratio_median=w[0], whole_ratio_q1=w[1], whole_ratio_q3=w[2], whole_slower_reps=w[3],
                   first_vs_whole_median=g[0], first_vs_whole_q1=g[1], first_vs_whole_q3=g[2])
    for rank in sorted({r["rank"] for r in rows}):
        mine = [r for r in rows if r["variant"] == "lynx" and r["rank"] == rank]
        med = {k: statistics.median(r[k] for r in mine) for k in ("step_s", "cpu_s", "runner_step_s", "forward_s",
                                                                   "backward_s", "wait_s")}
        theirs = [r for r in rows if r["variant"] == "torch" and r["rank"] == rank]
        med["torch_step_s"] = statistics.median(r["step_s"] for r in theirs)
        med["torch_cpu_s"] = statistics.median(r["cpu_s"] for r in theirs)
        med["host_outside_s"] = med["runner_step_s"] - med["forward_s"] - med["backward_s"] - med["wait_s"]
        med["outside_runner_s"] = med["step_s"] - med["runner_step_s"]
        out["ranks"][rank] = med
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--links", default="loopback,100", help="loopback and/or a rate in Mbit/s")
    ap.add_argument("--out", default="vs_torch_pipelining.json")
    ap.add_argument("--nice", type=int, default=-10, help="niceness increment of the ranks (negative needs root)")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.reps, args.nice)
        return
    from lynx.testbed import NetBed

    results = {"when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": CFG,
               "microbatch": MICROBATCH, "microbatches": MICROBATCHES, "reps": args.reps, "links": {}}
    for link in args.links.split(","):
        rate = None if link == "loopback" else float(link)
        load = os.getloadavg()
        with NetBed(world_size=2, rate_mbit=rate) as bed:
            limited = bed.rate_limited
            out = bed.run([sys.executable, __file__, "--worker", "--reps", str(args.reps), "--nice", str(args.nice)],
                          env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, timeout_s=3600)
        res = summarise(rows_from_stdout(out[0].stdout))
        res.update(rate_mbit=rate, rate_limited=limited, loadavg_start=load, loadavg_end=os.getloadavg())
        results["links"][link] = res
        print(f"{link}{'' if rate is None or limited else ' (NOT rate-limited here)'}: Lynx "
              f"{res['lynx_step_s'] * 1e3:.1f} ms, torch {res['torch_step_s'] * 1e3:.1f} ms, Lynx/torch "
              f"{res['ratio_median']:.3f} [IQR {res['ratio_q1']:.3f}–{res['ratio_q3']:.3f}], Lynx slower in "
              f"{res['lynx_slower_reps']} of {res['reps']}; CPU seconds (both ranks) Lynx/torch "
              f"{res['cpu_ratio_median']:.3f} [IQR {res['cpu_ratio_q1']:.3f}–{res['cpu_ratio_q3']:.3f}]; load "
              f"{load[0]:.1f} at start, {res['loadavg_end'][0]:.1f} at end")
        if "whole_ratio_median" in res:
            print(f"  B whole (input gradients sent after the weight gradients): Lynx/torch "
                  f"{res['whole_ratio_median']:.3f} [IQR {res['whole_ratio_q1']:.3f}–{res['whole_ratio_q3']:.3f}], "
                  f"slower in {res['whole_slower_reps']} of {res['reps']}; input gradients first / B whole "
                  f"{res['first_vs_whole_median']:.3f} [IQR {res['first_vs_whole_q1']:.3f}–"
                  f"{res['first_vs_whole_q3']:.3f}]")
        for rank, med in res["ranks"].items():
            print(f"  rank {rank}: Lynx step {med['step_s'] * 1e3:.1f} ms = forward {med['forward_s'] * 1e3:.1f} + "
                  f"backward {med['backward_s'] * 1e3:.1f} + waits {med['wait_s'] * 1e3:.1f} + host in the runner "
                  f"{med['host_outside_s'] * 1e3:.1f} + outside the runner (batching, loss) "
                  f"{med['outside_runner_s'] * 1e3:.1f}; CPU {med['cpu_s'] * 1e3:.0f} ms | torch step "
                  f"{med['torch_step_s'] * 1e3:.1f} ms, CPU {med['torch_cpu_s'] * 1e3:.0f} ms")
    path = ROOT / "benchmarks" / "results" / args.out
    path.write_text(json.dumps(results, indent=1))
    print(f"written {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
