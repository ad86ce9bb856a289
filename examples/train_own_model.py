"""Train your own ``nn.Module`` across processes with a Lynx plan, from your own training loop.

The model is plain PyTorch — a small byte-level transformer whose ``forward(idx, targets)``
returns ``(logits, loss)`` as nanoGPT's does — and the loop, optimizer (AdamW), learning-rate
schedule, data and checkpoints are ordinary PyTorch too. Lynx plans which activations each
pipeline stage keeps or recomputes (``lynx.compile``) and runs the stages
(``lynx.runtime.Pipeline``)::

    torchrun --nproc_per_node 2 examples/train_own_model.py                 # pp 2
    torchrun --nproc_per_node 4 examples/train_own_model.py                 # pp 2 × dp 2
    torchrun --nproc_per_node 2 examples/train_own_model.py --steps 20 --save ckpt   # then go on:
    torchrun --nproc_per_node 2 examples/train_own_model.py --steps 40 --load ckpt

The data is byte windows of the Python standard library's sources (``lynx.data``: nothing to
download). See docs/train_your_model.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import lynx
from lynx.data import stdlib_corpus
from lynx.runtime.checkpoint import load_state, save_state

VOCAB = 256


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)                                                   # (B, T, C)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """forward(idx, targets) -> (logits, loss), nanoGPT's convention."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        logits = self.head(self.norm(x))                                   # (B, T, V)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def batches(rows: int, seq: int, seed: int, start: int = 0):
    """Step ``i``'s batch of byte windows (a function of ``i``: resuming continues the stream)."""
    data = stdlib_corpus(1 << 22)
    step = start
    while True:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(data) - seq - 1, (rows,), generator=gen).tolist()
        window = torch.stack([data[s:s + seq + 1] for s in starts]).long()  # (rows, seq + 1)
        yield window[:, :-1], window[:, 1:]                                 # slices: Lynx copies them
        step += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (dp = processes / pp)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch", type=int, default=8, help="sequences per microbatch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument(
        "--memory-budget", default="7MiB", help="per device; stage 0 recomputes under it (10.2 MiB without)"
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save", default=None, help="write a checkpoint here after the last step")
    ap.add_argument("--load", default=None, help="continue from this checkpoint")
    ap.add_argument("--hardware", default="auto",
                    help="the cost model the plan is made for: auto (this machine, measured once by `lynx calibrate`),"
                         " a preset or a hardware file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    torch.manual_seed(0)  # the same weights on every rank
    model = TinyLM(seq=args.seq)
    example = torch.zeros(args.microbatch, args.seq, dtype=torch.long)  # one microbatch
    compiled = lynx.compile(
        model,
        (example, example.clone()),
        pp=args.pp,
        dp=world // args.pp,
        microbatches=args.microbatches,
        memory_budget=args.memory_budget,
        hardware=args.hardware,
        solver="heu",
    )
    pipe = lynx.runtime.Pipeline(compiled)  # joins the job: group, mesh, this stage
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
    start = 0
    if args.load:  # each rank reads its own part: safetensors and JSON, checked against the manifest
        state = load_state(args.load)
        pipe.load_state_dict(state["pipe"], opt)   # weights, AdamW state, this rank's dropout stream
        schedule.load_state_dict(state["schedule"])
        start = int(state["step"])
    if pipe.rank == 0:
        recomputed = sum(d.action == "recompute" for s in compiled.plan.stages for d in s.decisions)
        print(f"{compiled.loss.description}; plan {compiled.plan.solver}: {recomputed} nodes recomputed", flush=True)

    rows = pipe.topology.dp * args.microbatches * args.microbatch  # the whole step's batch
    data = batches(rows, args.seq, seed=0, start=start)
    for step in range(start, args.steps):
        idx, targets = next(data)
        loss = pipe.step(idx, targets)  # the mean loss, on every rank
        opt.step()
        opt.zero_grad()
        schedule.step()
        if pipe.rank == 0:
            print(f"step {step + 1:>3}  loss {loss.item():.4f}", flush=True)
    if args.save:
        state = {"pipe": pipe.state_dict(opt), "schedule": schedule.state_dict(), "step": args.steps}
        save_state(state, args.save)   # every rank its part; nothing in it unpickles when read
    pipe.close()


if __name__ == "__main__":
    main()
