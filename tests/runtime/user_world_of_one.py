"""A plain ``python`` run (no torchrun): Pipeline makes a world of one; ``loss_fn`` and ``target=``.

    python user_world_of_one.py OUT_FILE

Trains a logits-only model with ``loss_fn(output, target)`` for STEPS steps and writes the
per-step losses and final parameters to OUT_FILE, and what ``step`` says of bad batches: token
ids outside the vocabulary, a 3-D input.
"""

import os
import sys

import torch
import torch.nn.functional as F

import lynx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import user_models as um  # noqa: E402


class LogitsOnly(um.TupleLM):
    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)                                                # (B, T, V)


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, um.VOCAB), target.reshape(-1))


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LogitsOnly()
    example = torch.zeros(um.MICRO, um.SEQ, dtype=torch.long)
    compiled = lynx.compile(model, (example,), pp=1, microbatches=um.MICROBATCHES, solver="full",
                            hardware="cpu-local", memory_budget="1GiB")
    pipe = lynx.runtime.Pipeline(compiled, loss_fn=loss_fn)
    opt = um.optimizer(pipe.parameters())
    losses = []
    for window in um.batches(1):
        loss = pipe.step(window[:, :-1], target=window[:, 1:])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    refused = {}
    window = um.batches(1)[0]
    for what, bad in (("vocabulary", window[:, :-1] + um.VOCAB), ("3-D", window[:, :-1].unsqueeze(0))):
        try:
            pipe.step(bad, target=window[:, 1:])
        except lynx.LynxError as err:
            refused[what] = str(err)
    torch.save({"losses": losses, "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
                "world": int(os.environ["WORLD_SIZE"]), "refused": refused}, sys.argv[1])
    pipe.close()


if __name__ == "__main__":
    main()
