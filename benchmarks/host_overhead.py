"""Host time of a compiled stage against plain PyTorch: plan ``none`` / eager, plan ``full`` / checkpoint.

One forward + backward of a GPT through ``compiled.stage(0)`` (pp 1, one microbatch) is timed
against the same model run eagerly (plan ``none``: nothing dropped) and against the model with
``torch.utils.checkpoint`` around every layer (plan ``full``: every layer recomputed), at a
launch-bound size (hidden 64, seq 8, batch 1; 4 and 8 layers: per-op host cost dominates, as on
a GPU whose kernels are short) and a compute-bound one (hidden 256, seq 128, batch 4). All
variants of all sizes run interleaved in one loop (each round runs every variant once, in a
rotating order), so a shared machine's drift hits them alike; the ratio is the median over
rounds of the per-round ratio.

Bars (issue 12): none ≤ 1.25× eager at the launch-bound sizes and ≤ 1.05× at the
compute-bound one; full ≤ 1.05× checkpoint at every size.

Run::

    .venv/bin/python benchmarks/host_overhead.py            # ~2 min on 1 thread
    .venv/bin/python benchmarks/host_overhead.py --rounds 5 --quick
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

import lynx
from lynx.models.gpt import GPT, GPTConfig

SIZES = {  # name: (hidden, heads, seq, batch, layers)
    "launch-bound 4L": (64, 4, 8, 1, 4),
    "launch-bound 8L": (64, 4, 8, 1, 8),
    "compute-bound": (256, 8, 128, 4, 4),
}
BARS = {"launch-bound 4L": 1.25, "launch-bound 8L": 1.25, "compute-bound": 1.05}


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


@dataclass
class Case:
    size: str
    variant: str
    step: object


def _model(size: str) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    hidden, heads, seq, batch, layers = SIZES[size]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=seq, hidden=hidden, heads=heads, layers=layers, dropout=0.1))
    idx = torch.randint(0, 512, (batch, seq))  # (B, T)
    return model.train(), (idx, idx.roll(-1, dims=1))


def _cases(size: str) -> list[Case]:
    model, inputs = _model(size)
    eager = copy.deepcopy(model)
    ckpt = copy.deepcopy(model)
    ckpt.layers = torch.nn.ModuleList(_Checkpointed(b) for b in ckpt.layers)
    stages = {}
    for solver in ("none", "full"):
        copy_ = copy.deepcopy(model)
        compiled = lynx.compile(copy_, inputs, pp=1, microbatches=1, solver=solver, hardware="cpu-local",
                                target="cpu")
        stages[solver] = (copy_, compiled.stage(0))

    def run_module(m):
        def step():
            m.zero_grad(set_to_none=True)
            m(*inputs).backward()
        return step

    def run_stage(pair):
        m, stage = pair
        args = [dict(zip(("idx", "targets"), inputs))[n] for n in stage.spec.inputs]

        def step():
            m.zero_grad(set_to_none=True)
            stage(*args, microbatch=0).backward()
            stage.release(0)
        return step

    return [Case(size, "eager", run_module(eager)), Case(size, "none", run_stage(stages["none"])),
            Case(size, "checkpoint", run_module(ckpt)), Case(size, "full", run_stage(stages["full"]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="fewer inner repetitions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = [c for size in SIZES for c in _cases(size)]
    inner = {size: (2 if args.quick else 5) * (10 if size.startswith("launch") else 1) for size in SIZES}
    for c in cases:  # warm up: traces, lowers, allocator
        for _ in range(3):
            c.step()
    times: dict[tuple[str, str], list[float]] = {(c.size, c.variant): [] for c in cases}
    for r in range(args.rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        for c in order:
            n = inner[c.size]
            t0 = time.perf_counter()
            for _ in range(n):
                c.step()
            times[(c.size, c.variant)].append((time.perf_counter() - t0) / n)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} interleaved rounds")
    print(f"{'size':<18}{'eager ms':>10}{'none ms':>10}{'none/eager':>12}{'ckpt ms':>10}{'full ms':>10}"
          f"{'full/ckpt':>11}  bars")
    ok = True
    for size in SIZES:
        t = {v: times[(size, v)] for v in ("eager", "none", "checkpoint", "full")}
        none_ratio = statistics.median(a / b for a, b in zip(t["none"], t["eager"]))
        full_ratio = statistics.median(a / b for a, b in zip(t["full"], t["checkpoint"]))
        bar_none, bar_full = none_ratio <= BARS[size], full_ratio <= 1.05
        ok &= bar_none and bar_full
        med = {v: statistics.median(x) * 1e3 for v, x in t.items()}
        print(f"{size:<18}{med['eager']:>10.2f}{med['none']:>10.2f}{none_ratio:>11.3f}x{med['checkpoint']:>10.2f}"
              f"{med['full']:>10.2f}{full_ratio:>10.3f}x  none<={BARS[size]} {'ok' if bar_none else 'MISSED'}, "
              f"full<=1.05 {'ok' if bar_full else 'MISSED'}")
    print("all bars met" if ok else "some bars missed")


if __name__ == "__main__":
    main()
