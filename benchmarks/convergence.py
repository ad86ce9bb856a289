"""Convergence: AdamW vs Lion vs DeMo vs DistributedLion on a byte-level GPT, same steps.

The corpus is the Python standard library's own sources (``sysconfig.get_paths()["stdlib"]``,
``*.py`` files in sorted order), read as bytes: every machine with Python has it. The model is
``lynx.models.gpt.GPT`` (vocab 256). Every method sees the same global batch per step:
AdamW and Lion (``DistributedLion`` at W=1, which is exactly Lion) train in one process on
the whole batch; DeMo and DistributedLion train on 4 gloo processes, each on a quarter of it.
The same warm-up + cosine learning-rate schedule scales every method's peak rate.

Reported: held-out loss (fixed evaluation batches from the last 10% of the corpus) at the
end, the mean training loss of the last 20 steps, and the ratio to AdamW's held-out loss.

Run::

    .venv/bin/python benchmarks/convergence.py --parallel  # all methods at once
    .venv/bin/python benchmarks/convergence.py --steps 100 --methods adamw demo --lr demo=3e-3
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lynx.models.gpt import GPT, GPTConfig
from lynx.optim import DeMo, DistributedLion

RESULTS = Path(__file__).resolve().parent / "results"
# Peak learning rates, tuned per method on this benchmark (see docs/optimizers.md).
DEFAULT_LR = {"adamw": 6e-3, "lion": 2e-3, "demo": 6e-3, "dlion": 2e-3}
DISTRIBUTED = {"demo", "dlion", "dlion_avg"}


def corpus(max_bytes: int) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    raw = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)  # (n,)


def batch(data: torch.Tensor, step: int, size: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
    idx = torch.stack([data[s : s + seq] for s in starts.tolist()])  # (B, T)
    tgt = torch.stack([data[s + 1 : s + seq + 1] for s in starts.tolist()])  # (B, T)
    return idx, tgt


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers,
                    dropout=0.0, attention="sdpa")
    return GPT(cfg)


def make_optimizer(method: str, model: GPT, lr: float, args: argparse.Namespace) -> torch.optim.Optimizer:
    if method == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if method in ("lion", "dlion", "dlion_avg"):
        mode = "avg" if method == "dlion_avg" else "mavo"
        return DistributedLion(model.named_parameters(), lr=lr, betas=tuple(args.lion_betas),
                               weight_decay=args.weight_decay, mode=mode)
    if method == "demo":
        return DeMo(model.named_parameters(), lr=lr, compression_topk=args.topk, compression_chunk=args.chunk,
                    compression_decay=args.decay, weight_decay=args.weight_decay)
    raise ValueError(f"unknown method {method!r}")


@torch.no_grad()
def evaluate(model: GPT, held_out: torch.Tensor, args: argparse.Namespace) -> float:
    losses = [float(model(*batch(held_out, i, args.batch, args.seq, seed=999))) for i in range(args.eval_batches)]
    return sum(losses) / len(losses)


def train(method: str, lr: float, args: argparse.Namespace, rank: int = 0, world: int = 1) -> dict:
    data = corpus(args.corpus_bytes)
    split = int(0.9 * data.numel())
    train_data, held_out = data[:split], data[split:]
    model = make_model(args)
    opt = make_optimizer(method, model, lr, args)
    local = args.batch // world
    losses, evals, sent = [], [], 0.0
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, lr, args.warmup)
        idx, tgt = batch(train_data, step, args.batch, args.seq, seed=args.seed)
        idx, tgt = idx[rank * local : (rank + 1) * local], tgt[rank * local : (rank + 1) * local]
        opt.zero_grad(set_to_none=True)
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)  # the global batch's loss, for the curve (not part of training)
            value /= world
        losses.append(float(value))
        sent += getattr(opt, "last_step_bytes", {"sent": 0.0})["sent"]
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append((step + 1, evaluate(model, held_out, args)))
    return {"method": method, "lr": lr, "losses": losses, "evals": evals, "seconds": time.perf_counter() - start,
            "sent_per_step": sent / args.steps}


def _worker(rank: int, world: int, port: int, method: str, lr: float, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    result = train(method, lr, args, rank, world)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def train_distributed(method: str, lr: float, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, method, lr, args, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=args.timeout)
    for p in procs:
        p.join(timeout=60)
    return result


def _run_method(method: str, lr: float, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1 if args.parallel else 2)
    run = train_distributed if method in DISTRIBUTED else train
    res = run(method, lr, args)
    res["ranks"] = args.world if method in DISTRIBUTED else 1
    return res


def _run_method_into(method: str, lr: float, args: argparse.Namespace, queue) -> None:
    queue.put(_run_method(method, lr, args))


def run_methods(args: argparse.Namespace, lrs: dict[str, float]) -> list[dict]:
    """Every method, one after another, or all at once (``--parallel``: same results, less wall time)."""
    if not args.parallel:
        results = []
        for method in args.methods:
            results.append(_run_method(method, lrs[method], args))
            _report(results[-1])
        return results
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_run_method_into, args=(m, lrs[m], args, queue)) for m in args.methods]
    for p in procs:
        p.start()
    by_method = {}
    for _ in procs:
        res = queue.get(timeout=args.timeout)
        by_method[res["method"]] = res
        _report(res)
    for p in procs:
        p.join(timeout=60)
    return [by_method[m] for m in args.methods]


def _tail(losses: list[float], n: int = 20) -> float:
    """Mean training loss of the last ``n`` steps."""
    last = losses[-n:]
    return sum(last) / len(last)


def _report(res: dict) -> None:
    print(
        f"{res['method']:10s} lr {res['lr']:.0e}  held-out {res['evals'][-1][1]:.4f}  "
        f"train(last 20) {_tail(res['losses']):.4f}  {res['seconds']:.0f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["adamw", "lion", "demo", "dlion"],
        choices=["adamw", "lion", "demo", "dlion", "dlion_avg"],
    )
    parser.add_argument("--lr", nargs="*", default=[], help="overrides, e.g. demo=1e-3 adamw=3e-3")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--lion-betas", type=float, nargs=2, default=[0.9, 0.9])
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--decay", type=float, default=0.999)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--parallel", action="store_true", help="run the methods at the same time")
    parser.add_argument("--tag", default="", help="suffix of the result files (tuning runs)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    lrs = dict(DEFAULT_LR, dlion_avg=DEFAULT_LR["dlion"])
    for item in args.lr:
        k, v = item.split("=")
        lrs[k] = float(v)
    results = run_methods(args, lrs)

    base = next((r["evals"][-1][1] for r in results if r["method"] == "adamw"), None)
    title = (
        f"byte-level GPT (layers {args.layers}, hidden {args.hidden}, seq {args.seq}), stdlib corpus, "
        f"{args.steps} steps, global batch {args.batch}, warm-up {args.warmup} + cosine to 10%"
    )
    lines = [
        f"# Convergence: {title}",
        "",
        f"Command: `.venv/bin/python benchmarks/convergence.py {' '.join(os.sys.argv[1:])}`".rstrip(),
        "",
        "| method | ranks | peak lr | held-out loss | train loss (last 20) | vs AdamW | bytes sent/rank/step "
        "| wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        held = r["evals"][-1][1]
        ratio = f"{held / base:.3f}×" if base else "—"
        lines.append(
            f"| {r['method']} | {r['ranks']} | {r['lr']:.0e} | {held:.4f} | {_tail(r['losses']):.4f} "
            f"| {ratio} | {r['sent_per_step']:.0f} | {r['seconds']:.0f} |"
        )
    if args.methods and "demo" in args.methods:
        lines.append(f"\nDeMo settings: top-k {args.topk}, chunk {args.chunk}, decay {args.decay}.")
    lines.append(
        f"Lion / DistributedLion betas {tuple(args.lion_betas)}; AdamW betas (0.9, 0.95); "
        f"weight decay {args.weight_decay} for all."
    )
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"optim_convergence{args.tag}"
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(results))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        smooth = [
            sum(r["losses"][max(0, i - 9) : i + 1]) / len(r["losses"][max(0, i - 9) : i + 1])
            for i in range(len(r["losses"]))
        ]
        (line,) = ax.plot(range(1, len(smooth) + 1), smooth, label=f"{r['method']} (lr {r['lr']:.0e}, W={r['ranks']})")
        ax.plot([s for s, _ in r["evals"]], [v for _, v in r["evals"]], "o", color=line.get_color(), ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (line: train, 10-step mean; dots: held-out)")
    ax.set_title("byte-level GPT on Python stdlib sources")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)
    print(f"wrote {args.out / (stem + '.md')} and {args.out / (stem + '.png')}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
