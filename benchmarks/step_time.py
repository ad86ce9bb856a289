"""Step time per optimizer over rate-limited links: AdamW + all-reduce vs DeMo vs DistributedLion.

Each link rate gets a fresh :class:`lynx.testbed.NetBed` (one network namespace per rank, each
rank's link limited by ``tc tbf`` in both directions); its throughput is measured with gloo
send/recv and printed. Then ONE launch of ``W`` ranks (one thread each) trains, by default,
**the convergence benchmark's model** (``benchmarks/convergence.py``: byte-level GPT, 2 layers,
hidden 128, 4 heads, seq 64, 4 sequences per rank = its global batch of 16 over 4 ranks,
0.47 M parameters) with every optimizer, in interleaved blocks: per round each optimizer runs
one untimed step and then ``--block`` (4) timed ones, so every timed step follows a step of the
same optimizer, as in training (a step right after AdamW's bulk transfer is ~20 ms slower,
whatever the optimizer; step-by-step interleaving put DeMo there 2 times in 3, Lion 1 in 3),
and the block order rotates every round so that background load hits all alike.
``--hidden 256 --layers 4`` gives the wider 3.3 M-parameter variant. A step is timed
from a barrier to the end of ``optimizer.step()``; its time is the slowest rank's. AdamW runs
under ``DistributedDataParallel`` (gloo, default buckets, fp32 all-reduce overlapped with
backward), exactly as DDP would; DeMo and DistributedLion communicate inside their ``step()``.

    .venv/bin/python benchmarks/step_time.py                      # 100 and 10 Mbit/s, 4 ranks (~2 min)
    .venv/bin/python benchmarks/step_time.py --rates 3,10,100,1000
    .venv/bin/python benchmarks/step_time.py --hidden 256 --layers 4 --out benchmarks/results/step_time_3m

Writes ``benchmarks/results/step_time.{md,json,png}``. Needs root + iproute2 for real links;
otherwise the bed falls back to loopback and the table says "unlimited (loopback)".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "LYNX_STEP_TIME "
ORDER = ["adamw", "demo", "lion"]
LABEL = {"adamw": "AdamW + fp32 all-reduce (DDP)", "demo": "DeMo", "lion": "DistributedLion"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="100,10", help="link rates in Mbit/s, comma separated")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per optimizer and rate")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per optimizer first")
    p.add_argument("--block", type=int, default=4,
                   help="timed steps per optimizer in a row, after one untimed step of the same optimizer")
    p.add_argument("--budget", type=float, default=150.0,
                   help="seconds of timed steps per rate: slow links stop early (after --min-steps)")
    p.add_argument("--min-steps", type=int, default=3, help="timed steps per optimizer at least")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds every rank sleeps before each step's barrier (outside the timed region)")
    p.add_argument("--optimizers", default="adamw,demo,lion")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4,
                   help="sequences per rank per step (convergence.py: global 16 / 4 ranks)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per rate")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_time"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker: one rank, started by NetBed.run ------------------------------------------------
def build_optimizer(name: str, model, lr: float):
    import torch

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    from lynx.optim import DeMo, DistributedLion

    if name == "demo":
        return DeMo(model.parameters(), lr=lr)
    return DistributedLion(model.parameters(), lr=lr, mode="mavo")


def wire_bytes(name: str, opt, n_params: int, world: int) -> float | None:
    """Bytes this rank sent in the last step: the optimizer's own count, or the ring formula."""
    if name == "adamw":
        return 2 * (world - 1) / world * 4 * n_params
    counted = getattr(opt, "last_step_bytes", None)  # lynx.optim: {"sent": .., "received": ..}
    return float(counted["sent"]) if isinstance(counted, dict) else None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lynx.optim  # noqa: F401  (before the process group: lynx.process_group_guard)
    from lynx.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden,
                    heads=args.heads, layers=args.layers, dropout=0.0, attention="sdpa")
    names = args.optimizers.split(",")
    runs = {}
    for name in names:
        torch.manual_seed(0)  # the same initial model on every rank and for every optimizer
        model = GPT(cfg)
        net = DistributedDataParallel(model) if name == "adamw" else model
        lr = {"adamw": 3e-3, "demo": 3e-3, "lion": 1e-3}[name]  # convergence.py's peaks
        runs[name] = (net, build_optimizer(name, model, lr))
    n_params = sum(p.numel() for p in runs[names[0]][0].parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    times: dict[str, list[float]] = {n: [] for n in names}
    in_step: dict[str, list[float]] = {n: [] for n in names}  # of which optimizer.step()
    sent: dict[str, float | None] = {}
    timed_since = time.perf_counter()
    stop = torch.zeros(1, dtype=torch.int64)

    def one_step(name: str, timed: bool) -> None:
        net, opt = runs[name]
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen)
        if args.settle > 0:
            time.sleep(args.settle)  # let the previous step's traffic drain (untimed)
        dist.barrier()
        start = time.perf_counter()
        loss = net(tokens[:, :-1], tokens[:, 1:])  # () mean cross-entropy
        loss.backward()
        before_step = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if timed:
            end = time.perf_counter()
            times[name].append(end - start)
            in_step[name].append(end - before_step)
        sent[name] = wire_bytes(name, opt, n_params, world)

    # Blocks: per round, each optimizer runs one untimed lead step (--warmup on the first round)
    # and then --block timed steps, so that every timed step follows a step of the same
    # optimizer, as in training (a step right after AdamW's bulk transfer is slower, whatever
    # the optimizer). The block order rotates every round so that background load hits all alike.
    rounds = -(-args.steps // args.block)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            for _ in range(max(args.warmup, 1) if r == 0 else 1):
                one_step(name, timed=False)
            for _ in range(min(args.block, args.steps - len(times[name]))):
                one_step(name, timed=True)
        # Slow links: stop after --budget seconds (at least --min-steps timed steps each), as
        # rank 0 decides — one 8-byte broadcast per round, outside the timed region.
        if min(len(v) for v in times.values()) >= args.min_steps:
            stop[0] = int(rank == 0 and time.perf_counter() - timed_since > args.budget)
            dist.broadcast(stop, src=0)
            if stop.item():
                break
    # Step time = the slowest rank's: gather every rank's times (one small collective).
    # optimizer.step() share: rank 0's own (ranks differ in how long they wait for others).
    mine = torch.tensor([times[n] for n in names], dtype=torch.float64)  # (optimizers, steps)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    slowest = torch.stack(gathered).amax(dim=0)  # (optimizers, steps)
    if rank == 0:
        out = {"n_params": n_params, "tokens_per_rank": args.batch * cfg.seq_len,
               "steps": {n: slowest[i].tolist() for i, n in enumerate(names)},
               "optimizer_step_rank0": in_step,
               "wire_bytes_sent": sent}
        print(MARKER + json.dumps(out), flush=True)
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------
def available_optimizers(requested: list[str]) -> list[str]:
    wanted = [n for n in requested if n != "adamw"]
    if wanted:
        try:
            from lynx.optim import DeMo, DistributedLion  # noqa: F401
        except ImportError as exc:
            print(f"NOTE: lynx.optim DeMo/DistributedLion not importable ({exc}); "
                  f"timing AdamW only", flush=True)
            return [n for n in requested if n == "adamw"]
    return requested


def run_rate(args: argparse.Namespace, rate: float, names: list[str]) -> dict:
    from lynx.testbed import NetBed, measure_link
    from lynx.testbed.netbed import LynxTestbedError

    with NetBed(world_size=args.world_size, rate_mbit=rate) as bed:
        link = measure_link(bed)
        print(f"[{rate:g} Mbit/s] link: {link}; {bed}", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
               "--optimizers", ",".join(names)]
        for key in ("steps", "warmup", "block", "budget", "min_steps", "settle", "vocab", "seq", "hidden", "heads",
                    "layers", "batch"):
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        env = {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        for attempt in (1, 2):  # a rank dying in gloo's start-up (seen once) costs one retry, not the run
            started = time.perf_counter()
            load_before = os.getloadavg()[0]
            try:
                results = bed.run(cmd, env=env, timeout_s=args.timeout)
                break
            except LynxTestbedError as exc:
                if attempt == 2:
                    raise
                print(f"[{rate:g} Mbit/s] launch failed, retrying once: {str(exc)[:300]}", flush=True)
        wall = time.perf_counter() - started
        limited = bed.rate_limited
    for line in results[0].stdout.splitlines():
        if line.startswith(MARKER):
            data = json.loads(line[len(MARKER) :])
            break
    else:
        raise SystemExit(f"rank 0 printed no result; stderr:\n{results[0].stderr[-3000:]}")
    data.update(
        rate_mbit=rate,
        rate_limited=limited,
        measured_mbit=link.measured_mbit,
        wall_s=wall,
        load=[load_before, os.getloadavg()[0]],
    )
    mean = {n: statistics.mean(v) for n, v in data["steps"].items()}
    print(
        f"[{rate:g} Mbit/s] mean step: "
        + ", ".join(f"{n} {mean[n]:.3f} s" for n in names)
        + f"  ({wall:.0f} s for the run)",
        flush=True,
    )
    return data


def render(rows: list[dict], names: list[str], args: argparse.Namespace) -> str:
    first = rows[0]
    head = (
        f"# Step time per optimizer over rate-limited links\n\n"
        f"`{' '.join(['benchmarks/step_time.py', *sys.argv[1:]])}` — {args.world_size} ranks "
        f"(one thread each, {os.cpu_count()} CPU cores), GPT {args.layers} layers × hidden "
        f"{args.hidden} ({first['n_params'] / 1e6:.2f} M parameters), "
        f"{first['tokens_per_rank']} tokens per rank per step, up to {args.steps} timed steps per "
        f"optimizer (column `steps`: slow links stop after {args.budget:g} s of timed steps, "
        f"at least {args.min_steps}) after {args.warmup} warm-up, optimizers interleaved in blocks of "
        f"one untimed + {args.block} timed steps, the block order rotated every round. "
        f"Step time: barrier → forward → backward → `optimizer.step()`, slowest rank.\n\n"
    )
    cols = [f"{LABEL[n]} (s)" for n in names] + [f"{LABEL[n]} / AdamW" for n in names if n != "adamw"]
    lines = ["| link (nominal) | measured | steps | " + " | ".join(cols) + " |", "|" + " --- |" * (3 + len(cols))]
    for row in rows:
        mean = {n: statistics.mean(row["steps"][n]) for n in names}
        nominal = f"{row['rate_mbit']:g} Mbit/s" if row["rate_limited"] else "unlimited (loopback)"
        cells = [nominal, f"{row['measured_mbit']:.1f} Mbit/s", str(len(row["steps"][names[0]]))]
        cells += [f"{mean[n]:.3f} ± {statistics.pstdev(row['steps'][n]):.3f}" for n in names]
        if "adamw" in mean:
            cells += [f"{mean[n] / mean['adamw']:.3f}×" for n in names if n != "adamw"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Medians (a step's time is the slowest rank's; CPU load from other jobs on the shared "
        "machine inflates DeMo's and DistributedLion's compute-bound steps, not AdamW's "
        "link-bound ones, and comes in bursts), with the 1-min load average before and after "
        "each rate:",
        "",
        "| link (nominal) | load | "
        + " | ".join(f"{LABEL[n]} median (s)" for n in names)
        + " | "
        + " | ".join(f"{LABEL[n]} / AdamW (medians)" for n in names if n != "adamw")
        + " |",
        "|" + " --- |" * (2 + len(names) + len([n for n in names if n != "adamw"])),
    ]
    for row in rows:
        med = {n: statistics.median(row["steps"][n]) for n in names}
        nominal = f"{row['rate_mbit']:g} Mbit/s" if row["rate_limited"] else "unlimited"
        load = f"{row['load'][0]:.1f} → {row['load'][1]:.1f}" if "load" in row else "?"
        cells = [nominal, load] + [f"{med[n]:.3f}" for n in names]
        if "adamw" in med:
            cells += [f"{med[n] / med['adamw']:.3f}×" for n in names if n != "adamw"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Of which inside `optimizer.step()` (rank 0, mean; DeMo's and DistributedLion's "
        "communication happens here, AdamW's all-reduce during backward under DDP):",
        "",
        "| link (nominal) | " + " | ".join(f"{LABEL[n]} (s)" for n in names) + " |",
        "|" + " --- |" * (1 + len(names)),
    ]
    for row in rows:
        nominal = f"{row['rate_mbit']:g} Mbit/s" if row["rate_limited"] else "unlimited"
        lines.append(
            f"| {nominal} | "
            + " | ".join(f"{statistics.mean(row['optimizer_step_rank0'][n]):.3f}" for n in names)
            + " |"
        )
    sent = first.get("wire_bytes_sent", {})
    wire = ", ".join(f"{LABEL[n]} {sent[n] / 1e6:.3f} MB" for n in names if sent.get(n))
    return head + "\n".join(lines) + (f"\n\nBytes sent per rank per step: {wire}.\n" if wire else "\n")


def bar_check(rows: list[dict], names: list[str], rate: float = 100.0, bar: float = 0.25) -> str:
    """The issue's bar: at 100 Mbit/s with 4 ranks, DeMo and Lion step <= 0.25x AdamW's."""
    row = next((r for r in rows if r["rate_mbit"] == rate and r["rate_limited"]), None)
    if row is None or "adamw" not in names or len(names) < 2:
        return ""
    adamw = statistics.mean(row["steps"]["adamw"])
    ratios = {n: statistics.mean(row["steps"][n]) / adamw for n in names if n != "adamw"}
    adamw_med = statistics.median(row["steps"]["adamw"])
    medians = {n: statistics.median(row["steps"][n]) / adamw_med for n in names if n != "adamw"}
    verdict = "met" if all(v <= bar for v in [*ratios.values(), *medians.values()]) else "NOT met"
    load = f"1-min load {row['load'][0]:.1f} -> {row['load'][1]:.1f}" if "load" in row else "load ?"
    return (
        f"\nBar at {rate:g} Mbit/s (measured {row['measured_mbit']:.1f}), {row['world_size']} ranks, "
        f"{row['n_params'] / 1e6:.2f} M-parameter GPT, {load} (step time <= {bar}x AdamW's): "
        "ratios of mean step times "
        + ", ".join(f"{LABEL[n]} {v:.3f}x" for n, v in ratios.items())
        + "; ratios of medians "
        + ", ".join(f"{LABEL[n]} {v:.3f}x" for n, v in medians.items())
        + f" -> {verdict}.\n"
    )


def plot(rows: list[dict], names: list[str], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        means = [statistics.mean(r["steps"][n]) for r in rows]
        xs = [x + i * width for x in range(len(rows))]
        ax.bar(xs, means, width, label=LABEL[n])
        if n != "adamw" and "adamw" in names:
            for x, r, m in zip(xs, rows, means):
                ratio = m / statistics.mean(r["steps"]["adamw"])
                ax.annotate(f"{ratio:.2f}×", (x, m), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(
        [x + width * (len(names) - 1) / 2 for x in range(len(rows))],
        [f"{r['rate_mbit']:g} Mbit/s\n(measured {r['measured_mbit']:.0f})" for r in rows],
    )
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylabel("mean step time (s, log)")
    ax.set_title(
        f"Step time per optimizer, {rows[0]['n_params'] / 1e6:.1f} M-param GPT, "
        f"{rows[0]['world_size']} ranks over tbf links"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    names = available_optimizers([n for n in args.optimizers.split(",") if n])
    unknown = set(names) - set(ORDER)
    if unknown:
        raise SystemExit(f"--optimizers: unknown {sorted(unknown)}; choose from {ORDER}")
    rows = []
    load_before = os.getloadavg()[0]
    for rate in [float(r) for r in args.rates.split(",")]:
        rows.append(run_rate(args, rate, names) | {"world_size": args.world_size})
    table = render(rows, names, args)
    table += bar_check(rows, names)
    table += (
        f"\nMachine load (1-min load average) {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores.\n"
    )
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    plot(rows, names, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}, .json, .png")


if __name__ == "__main__":
    main()
