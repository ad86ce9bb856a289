"""Wire bytes per rank per step: fp32 ring all-reduce vs DeMo vs DistributedLion, gpt-1.3b.

The parameter shapes come from ``lynx.models`` (``gpt-1.3b`` built on the meta device: no
weights are allocated). Payload sizes are computed analytically by the same planning code
the optimizers size their real payloads with (``demo_wire_bytes``, ``lion_wire_bytes``);
before the table, a real 2-process gloo run on ``gpt-tiny`` checks that the analytic bytes
equal the bytes the optimizers count on their actual payload tensors.

Bytes are what one rank sends per step (it receives the same, up to one byte of shard
rounding): ring all-reduce ``2(W−1)/W·n``, all-gather ``(W−1)·n``, all-to-all the splits that
leave the rank.

Run::

    .venv/bin/python benchmarks/comm_bytes.py            # table + results/optim_comm_bytes.{md,png}
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lynx
from lynx.optim import DeMo, DistributedLion
from lynx.optim.demo_payload import demo_wire_bytes
from lynx.optim.lion import lion_wire_bytes

RESULTS = Path(__file__).resolve().parent / "results"
WORLDS = (2, 4, 8, 16, 32, 64)
TOPKS = (8, 16, 32, 64)


def model_shapes(name: str) -> list[tuple[int, ...]]:
    model, _ = lynx.models.build_preset(name, device="meta")
    return [tuple(p.shape) for p in model.parameters()]


def analytic(shapes: list[tuple[int, ...]], world: int) -> dict[str, float]:
    """Bytes one rank sends per step, per method."""
    n = sum(torch.Size(s).numel() for s in shapes)
    numels = [torch.Size(s).numel() for s in shapes]
    row = {"allreduce_fp32": 2 * (world - 1) / world * 4 * n}
    for k in TOPKS:
        row[f"demo_k{k}"] = demo_wire_bytes(shapes, world, topk=k)["sent"]
    row["lion_mavo"] = lion_wire_bytes(numels, world, "mavo")["sent"]
    row["lion_avg"] = lion_wire_bytes(numels, world, "avg")["sent"]
    return row


# ----------------------------------------------------------------- real-run check
def _verify_worker(rank: int, world: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model, (idx, targets) = lynx.models.build_preset("gpt-tiny", device="cpu", dropout=0.0)
    params = list(model.parameters())
    shapes = [tuple(p.shape) for p in params]
    numels = [p.numel() for p in params]
    checks = []
    optimizers = {
        "demo_k32": (DeMo(params, lr=1e-3), demo_wire_bytes(shapes, world)),
        "demo_k8": (DeMo(params, lr=1e-3, compression_topk=8), demo_wire_bytes(shapes, world, topk=8)),
        "lion_mavo": (DistributedLion(params, mode="mavo"), lion_wire_bytes(numels, world, "mavo", rank=rank)),
        "lion_avg": (DistributedLion(params, mode="avg"), lion_wire_bytes(numels, world, "avg", rank=rank)),
    }
    for name, (opt, expect) in optimizers.items():
        model.zero_grad()
        model(idx, targets).backward()
        opt.step()
        checks.append((name, opt.last_step_bytes["sent"], expect["sent"], opt.last_step_bytes["received"],
                       expect["received"], opt.last_step_collectives, len(opt.buckets)))
    if rank == 0:
        queue.put(checks)
    dist.destroy_process_group()


def verify_real(world: int = 2) -> list[tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_verify_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    checks = queue.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
    return checks


# ----------------------------------------------------------------- output
def fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument("--no-verify", action="store_true", help="skip the real 2-process check")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    if not args.no_verify:
        print("real 2-rank gloo run on gpt-tiny: counted bytes vs analytic (rank 0, one step)")
        ok = True
        for name, sent, want, recv, want_recv, colls, buckets in verify_real():
            match = sent == want and recv == want_recv
            ok &= match
            print(f"  {name:10s} sent {sent:10.0f} analytic {want:10.0f}  received {recv:10.0f} "
                  f"analytic {want_recv:10.0f}  collectives {colls} (buckets {buckets})  "
                  f"{'OK' if match else 'MISMATCH'}")
        if not ok:
            sys.exit("analytic and counted bytes differ")

    shapes = model_shapes(args.model)
    n = sum(torch.Size(s).numel() for s in shapes)
    columns = ["allreduce_fp32", *[f"demo_k{k}" for k in TOPKS], "lion_mavo", "lion_avg"]
    rows = {w: analytic(shapes, w) for w in WORLDS}
    title = (
        f"Wire bytes sent per rank per step, {args.model} ({n / 1e9:.3f} B parameters, {len(shapes)} tensors; "
        "DeMo chunk 64, bf16 values, 12-bit indices; ratio = all-reduce bytes / method bytes)"
    )
    print(title)
    head = f"{'W':>3} " + " ".join(f"{c:>20s}" for c in columns)
    print(head)
    lines = ["| W | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for w, row in rows.items():
        base = row["allreduce_fp32"]
        cells = [fmt_bytes(base)] + [f"{fmt_bytes(row[c])} ({base / row[c]:.1f}×)" for c in columns[1:]]
        print(f"{w:>3} " + " ".join(f"{c:>20s}" for c in cells))
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    demo8 = rows[8]["allreduce_fp32"] / rows[8]["demo_k32"]
    mavo = {w: rows[w]["allreduce_fp32"] / rows[w]["lion_mavo"] for w in (2, 4, 8, 16)}
    verdict = [
        f"DeMo (default top-k 32) at W=8: {demo8:.2f}× fewer bytes than fp32 all-reduce (bar ≥ 32×): "
        f"{'PASS' if demo8 >= 32 else 'FAIL'}",
        "DistributedLion majority vote at W=2,4,8,16: "
        + ", ".join(f"{r:.2f}×" for r in mavo.values())
        + f" (bar ≥ 32×): {'PASS' if all(r >= 32 for r in mavo.values()) else 'FAIL'}",
    ]
    for v in verdict:
        print(v)

    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "optim_comm_bytes.md"
    md.write_text(
        f"# {title}\n\nCommand: `.venv/bin/python benchmarks/comm_bytes.py`\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n".join(f"- {v}" for v in verdict)
        + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in columns:
        ax.plot(list(rows), [rows[w][c] for w in rows], marker="o", label=c)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel ranks W")
    ax.set_ylabel("bytes sent per rank per step")
    ax.set_title(f"{args.model}: wire bytes per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "optim_comm_bytes.png", dpi=120)
    print(f"wrote {md} and {args.out / 'optim_comm_bytes.png'}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
