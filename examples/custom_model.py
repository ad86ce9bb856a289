"""Bring your own transformer: what capture needs, and what to do when it fails.

Lynx captures a model with ``torch.export`` (non-strict): the forward must be traceable for the
example inputs you give — one microbatch, the shapes of training. Python control flow on
*shapes* or config is fine; control flow on tensor *values* is not. This example

1. defines a small transformer whose blocks are not in a ``layers.N`` list,
2. shows the clear error a data-dependent branch produces, and the fix (``torch.where``),
3. inspects the fixed model: its repeated blocks are found by structure.

Run it, or point the CLI at its factory:

    python examples/custom_model.py
    lynx inspect examples/custom_model.py:make_model --target cpu --hardware cpu-local
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lynx


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, clamp_by_value: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.clamp_by_value = clamp_by_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).unbind(2)  # 3 × (B, T, nh, hd)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)
        h = self.ff(self.norm2(x))  # (B, T, C)
        if self.clamp_by_value:
            if h.abs().max() > 10:  # data-dependent: export cannot follow this branch
                h = h.clamp(-10, 10)
        else:
            h = torch.where(h.abs() > 10, h.clamp(-10, 10), h)  # the same, without a Python branch
        return x + h


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, clamp_by_value: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # Not a `layers.N` list: Lynx finds the repetition by structure.
        self.encoder_a = Block(dim, heads, clamp_by_value)
        self.encoder_b = Block(dim, heads, clamp_by_value)
        self.encoder_c = Block(dim, heads, clamp_by_value)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.encoder_c(self.encoder_b(self.encoder_a(self.embed(idx))))  # (B, T, C)
        logits = self.head(x)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(clamp_by_value: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The factory ``lynx inspect path:make_model`` calls: (model, one microbatch of inputs)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 32))  # (B, T)
    return TinyLM(clamp_by_value=clamp_by_value), (idx, idx.roll(-1, dims=1))


def main() -> None:
    model, inputs = make_model(clamp_by_value=True)
    try:
        lynx.capture(model, inputs)
    except lynx.LynxCaptureError as err:
        print("capture failed, as it should for a value-dependent branch:\n")
        print(err, "\n")
    model, inputs = make_model()
    report = lynx.inspect_model(model, inputs, target="cpu", hardware="cpu-local")
    for c in report.classes:
        print(f"{c.layer_class:10s} ×{c.count}  {c.nodes} ops  {c.saved_bytes / 1024:.1f} KiB saved per instance")


if __name__ == "__main__":
    main()
