"""Issue 22, finding 8: dropout 0.1, stopped and resumed through ``pipe.state_dict``, bitwise the same.

:func:`run` is one case of the pp 2 world of tests/runtime/test_user_pipeline.py
(``user_pipeline_worker.py`` calls it in the world it owns); on its own::

    torchrun --nproc_per_node 2 dropout_resume_worker.py OUT_DIR

A nanoGPT-style model (embedding, blocks with dropout 0.1 after attention-free MLPs, head,
cross-entropy) compiled for pp 2 with full recomputation (every dropout dropped, so its masks
are replayed), trained from a user's loop with AdamW: once for STEPS steps uninterrupted; once
for STOP steps, saved through ``pipe.state_dict(opt)`` with :func:`lynx.runtime.checkpoint.save_state`
and the pipe closed; then a fresh model and pipe, loaded from that checkpoint, train the rest.
The loop draws from the process's own random state every step, a different number of times in
the two runs: the pipe's streams do not depend on it. Writes each run's losses to
OUT_DIR/dropout.resume.rank{r}.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lynx
from lynx.runtime.checkpoint import load_state, save_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import user_models as um  # noqa: E402

STEPS, STOP = 6, 3


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class DropoutLM(um.TupleLM):
    """nanoGPT's shape and conventions: dropout 0.1 on the embedding and in every block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(16) for _ in range(4))
        self.drop = nn.Dropout(0.1)

    def forward(self, idx, targets):
        x = self.drop(self.emb(idx))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, um.VOCAB), targets.view(-1))


def make_pipe():
    torch.manual_seed(0)   # the same weights on every rank
    model = DropoutLM()
    idx = torch.randint(0, um.VOCAB, (um.MICRO, um.SEQ))
    # Megatron-style full recomputation: every dropout is dropped and replayed in the backward
    compiled = lynx.compile(model, (idx, idx.roll(-1, 1)), pp=2, microbatches=um.MICROBATCHES, solver="full",
                            hardware="cpu-local", memory_budget="1GiB")
    dropped = {d.node for s in compiled.plan.stages for d in s.decisions if d.action == "recompute"}
    assert any("dropout" in n for n in dropped), f"the plan recomputes no dropout: {sorted(dropped)}"
    pipe = lynx.runtime.Pipeline(compiled, timeout_s=60, seed=7)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)


def train(pipe, opt, windows, draws):
    losses = []
    for window in windows:
        torch.rand(draws)    # the user's own randomness (shuffling, augmentation)
        losses.append(float(pipe.step(window[:, :-1], window[:, 1:])))
        opt.step()
        opt.zero_grad()
    return losses


def run(out: str) -> None:
    """The scenario of the module docstring in this process's (pp 2) process group."""
    gen = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, um.VOCAB, (um.MICROBATCHES * um.MICRO, um.SEQ + 1), generator=gen)
               for _ in range(STEPS)]
    pipe, opt = make_pipe()
    full = train(pipe, opt, windows, draws=1)
    pipe.close()

    pipe, opt = make_pipe()
    first = train(pipe, opt, windows[:STOP], draws=5)
    save_state({"pipe": pipe.state_dict(opt)}, os.path.join(out, "ckpt"))
    pipe.close()

    torch.manual_seed(12345)   # a fresh process would start elsewhere
    pipe, opt = make_pipe()
    state = load_state(os.path.join(out, "ckpt"))
    pipe.load_state_dict(state["pipe"], opt)
    assert pipe.steps_done == STOP
    rest = train(pipe, opt, windows[STOP:], draws=2)
    pipe.close()
    with open(os.path.join(out, f"dropout.resume.rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"full": full, "resumed": first + rest}, f)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
