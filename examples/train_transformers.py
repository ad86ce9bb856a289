"""Train a ``transformers`` causal LM, built from a config, across processes with a Lynx plan.

Nothing is downloaded: the model is ``Qwen2ForCausalLM`` (or ``LlamaForCausalLM``) from a small
config with random weights, trained on byte windows of the Python standard library's sources.
The model takes ``input_ids`` and ``labels`` by keyword and returns a ``ModelOutput`` whose
``.loss`` Lynx trains; the loop, AdamW, cosine schedule and gradient clipping are yours::

    torchrun --nproc_per_node 2 examples/train_transformers.py               # pp 2
    torchrun --nproc_per_node 4 examples/train_transformers.py --arch llama  # pp 2 × dp 2

See docs/train_your_model.md.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import transformers

import lynx
from lynx.data import stdlib_corpus


def build(arch: str, layers: int, seq: int) -> torch.nn.Module:
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, use_cache=False)
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (dp = processes / pp)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--memory-budget", default="5MiB", help="per device (stage 0 needs 7.3 MiB keeping everything)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hardware", default="auto",
                    help="the cost model the plan is made for: auto (this machine, measured once by `lynx calibrate`),"
                         " a preset or a hardware file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    torch.manual_seed(0)                                    # the same weights on every rank
    model = build(args.arch, args.layers, args.seq)
    ids = torch.zeros(args.microbatch, args.seq, dtype=torch.long)   # one microbatch, by keyword
    compiled = lynx.compile(model, {"input_ids": ids, "labels": ids.clone()}, pp=args.pp, dp=world // args.pp,
                            microbatches=args.microbatches, memory_budget=args.memory_budget,
                            hardware=args.hardware, solver="heu")
    pipe = lynx.runtime.Pipeline(compiled)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.1)
    cosine = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min((step + 1) / 4, 0.5 * (1 + math.cos(math.pi * step / args.steps))))
    if pipe.rank == 0:
        recomputed = sum(d.action == "recompute" for s in compiled.plan.stages for d in s.decisions)
        print(f"{compiled.loss.description}; plan {compiled.plan.solver}: {recomputed} nodes recomputed", flush=True)

    data = stdlib_corpus(1 << 22)
    rows = pipe.topology.dp * args.microbatches * args.microbatch      # the whole step's batch
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq, (rows,), generator=gen).tolist()
        ids = torch.stack([data[s:s + args.seq] for s in starts]).long()   # (rows, seq)
        loss = pipe.step(input_ids=ids, labels=ids)        # the model shifts the labels itself
        # clipping by the global norm: each stage holds some of the parameters
        local = torch.stack([p.grad.norm() for p in pipe.parameters() if p.grad is not None]).square().sum()
        total = local.clone()
        torch.distributed.all_reduce(total)
        total /= pipe.topology.dp                         # dp replicas hold the same (averaged) gradients
        scale = min(1.0, 1.0 / (total.sqrt().item() + 1e-6))
        for p in pipe.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        opt.step()
        opt.zero_grad()
        cosine.step()
        if pipe.rank == 0:
            print(f"step {step + 1:>3}  loss {loss.item():.4f}  grad norm {total.sqrt().item():.3f}", flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
