"""Megatron-style GPT: the transformer layer Korthikanti et al. 2022 count activations for.

Layer: LayerNorm → QKV → attention → dropout → projection → dropout → residual → LayerNorm →
4h GELU MLP → dropout → residual. Attention is ``math`` (explicit softmax(QKᵀ)·V, saves the
s×s matrices) or ``sdpa`` (``F.scaled_dot_product_attention``: flash-like, saves no s×s matrix).
``forward(idx, targets)`` returns the mean cross-entropy loss, so the last pipeline stage
ends in a scalar.

Example::

    >>> import torch
    >>> from lynx.models.gpt import GPT, GPTConfig
    >>> cfg = GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, layers=2)
    >>> model = GPT(cfg)
    >>> idx = torch.randint(0, 256, (2, 16))
    >>> model(idx, idx).shape
    torch.Size([])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "GPTBlock", "GPT"]

Attention = Literal["math", "sdpa"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 51200
    seq_len: int = 2048
    hidden: int = 2048
    heads: int = 16
    layers: int = 24
    dropout: float = 0.1
    attention: Attention = "math"
    ffn_mult: int = 4


class CausalSelfAttention(nn.Module):
    future_mask: torch.Tensor   # a buffer, registered for attention="math"

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.attention = cfg.attention
        self.dropout_p = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        if cfg.attention == "math":
            # A buffer, so the mask autograd saves for masked_fill is not an activation.
            future = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)
            self.register_buffer("future_mask", future.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        if self.attention == "sdpa":
            p = self.dropout_p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hd)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
            att = att.masked_fill(self.future_mask[:, :, :T, :T], float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))  # (B, nh, T, T)
            y = att @ v  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.fc2 = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))  # (B, T, C)


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.emb_dropout(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for layer in self.layers:
            x = layer(x)  # (B, T, C)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T))
