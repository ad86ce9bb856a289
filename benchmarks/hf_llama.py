"""A `transformers` LlamaForCausalLM with Llama 2 7B's sizes, built from a config on meta.

A model nobody here wrote, for the search-time benchmark: bf16, ``sdpa`` attention, sequence
4096, one sequence per microbatch, no weights allocated (meta device), nothing downloaded.
Usable as a ``MODEL`` argument::

    lynx plan benchmarks/hf_llama.py:llama_7b --pp 4 -m 8 --hardware h100-sxm -b 40GiB

``transformers`` is not a Lynx dependency: install it to run this (``pip install transformers``).
"""

from __future__ import annotations

import torch

__all__ = ["LossOf", "llama_7b"]


class LossOf(torch.nn.Module):
    """``forward(input_ids, labels)`` → the scalar loss, as Lynx's runtime expects."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def llama_7b(seq: int = 4096, microbatch: int = 1) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """``(model, (input_ids, labels))``: Llama 2 7B's config (32 layers, hidden 4096, 32 heads,
    FFN 11008, vocab 32000) in bf16 with sdpa attention, on the meta device."""
    import transformers

    config = transformers.LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        ids = torch.zeros(microbatch, seq, dtype=torch.long)  # (B, T)
    return LossOf(model), (ids, ids)
