"""Llama-style decoder: RMSNorm, rotary position embedding, grouped-query attention, SwiGLU.

``forward(idx, targets)`` returns the mean cross-entropy loss.

Example::

    >>> import torch
    >>> from lynx.models.llama import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=256, seq_len=16, hidden=32, heads=4, kv_heads=2,
    ...                   layers=2, ffn_hidden=64)
    >>> idx = torch.randint(0, 256, (2, 16))
    >>> Llama(cfg)(idx, idx).shape
    torch.Size([])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "RMSNorm", "LlamaAttention", "SwiGLU", "LlamaBlock", "Llama"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    seq_len: int = 4096
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 32
    layers: int = 32
    ffn_hidden: int = 11008
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # (B, T, C)


def _rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, nh, T, hd/2) each
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)  # (B, nh, T, hd)


class LlamaAttention(nn.Module):
    rope_cos: torch.Tensor   # buffers: the rotary tables (seq_len, head_dim / 2)
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)
        cos, sin = _rope_tables(cfg.seq_len, self.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = self.rope_cos[:T].to(q.dtype), self.rope_sin[:T].to(q.dtype)  # (T, hd/2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
        v = v.repeat_interleave(groups, dim=1)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, C)
        return x + self.ffn(self.ffn_norm(x))  # (B, T, C)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.heads % cfg.kv_heads:
            raise ValueError(f"heads ({cfg.heads}) must be a multiple of kv_heads ({cfg.kv_heads})")
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok_emb(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)  # (B, T, C)
        logits = self.head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T))
