"""Models and data shared by the Pipeline tests' torchrun worker and their single-process reference.

``tuple``: a plain ``nn.Module`` whose forward returns ``(logits, loss)`` (nanoGPT's
convention, with ``targets.view(-1)``, which needs contiguous targets); ``gpt``: the same with
causal self-attention in every block (a plain ``nn.Module`` GPT, explicit softmax attention).
``qwen2`` and ``llama``: ``transformers`` models built from a config with eager attention,
taking ``input_ids`` and ``labels`` by keyword and returning a ``ModelOutput`` whose ``.loss``
is the loss. ``gpt-tiny``: Lynx's preset, returning the loss. Dropout is 0 in all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, MICRO, STEPS, MICROBATCHES = 64, 8, 2, 3, 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))   # (B, T, C)


class TupleLM(nn.Module):
    """forward(idx, targets) -> (logits, loss)."""

    def __init__(self, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(idx)                                                  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)                                              # (B, T, V)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class AttentionBlock(nn.Module):
    """Pre-norm causal self-attention (explicit softmax) and an MLP, with residuals."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = Block(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).split(C, dim=2)                   # (B, T, C) each
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, d)
        att = (q @ k.transpose(-2, -1)) / (C // self.heads) ** 0.5          # (B, h, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v      # (B, h, T, d)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return self.mlp(x)


class TupleGPT(TupleLM):
    """TupleLM with attention in every block: a plain nn.Module GPT."""

    def __init__(self, dim: int = 16, layers: int = 4) -> None:
        super().__init__(dim, layers)
        self.blocks = nn.ModuleList(AttentionBlock(dim) for _ in range(layers))


POSITIONAL = ("tuple", "gpt", "gpt-tiny")


def build(kind: str) -> tuple[nn.Module, tuple | dict]:
    """The model (seed 0) and one microbatch of example inputs."""
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (MICRO, SEQ))                           # (b, T)
    if kind == "tuple":
        return TupleLM(), (idx, idx.roll(-1, 1))
    if kind == "gpt":
        return TupleGPT(), (idx, idx.roll(-1, 1))
    if kind == "gpt-tiny":
        import lynx

        model, _ = lynx.models.build_preset("gpt-tiny", device="cpu", dropout=0.0, seq=SEQ, microbatch=MICRO)
        return model, (idx, idx.roll(-1, 1))
    if kind == "llama":
        return llama(), {"input_ids": idx, "labels": idx.roll(-1, 1)}
    return qwen2("eager"), {"input_ids": idx, "labels": idx.roll(-1, 1)}


def loss_of(kind: str, out: Any) -> torch.Tensor:
    """The loss in a model's output."""
    if kind in ("tuple", "gpt"):
        return out[1]
    return out if kind == "gpt-tiny" else out.loss


def llama() -> nn.Module:
    """A transformers Llama from a config, eager attention (what torch.export captures as eager runs)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


def qwen2(attention: str) -> nn.Module:
    """A 4-layer ``transformers`` Qwen2 from a config, with ``attention`` (``"eager"``: the same
    ops eagerly and under torch.export; ``"sdpa"``, transformers' default, takes another branch
    under tracing — see docs/runtime.md, "Where gradients are bitwise")."""
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, attention_dropout=0.0)
    cfg._attn_implementation = attention
    return transformers.Qwen2ForCausalLM(cfg)


def compile_recomputing(model: nn.Module, example: tuple | dict, *, pp: int, dp: int, schedule: str = "1f1b",
                        analysis: Any = None) -> Any:
    """An HEU plan under a budget halfway between what full recomputation and keeping
    everything need on stage 0 (so it recomputes, whatever the cost model's figures).

    ``schedule="1f1b+offload"``: under 1F1B, PipeOffload's policy (``offload-all``: every
    activation of a stage with more than one microbatch in flight goes to host memory, each
    brought back in a window or when the backward reaches it).

    ``analysis``: :func:`analyze`'s of this model, planned from (``lynx.compiler.compile_analysis``)
    instead of capturing it again."""
    from lynx.planner.loop import plan_graph

    if schedule == "1f1b+offload":
        return _compile(model, example, analysis, pp=pp, dp=dp, microbatches=MICROBATCHES, solver="offload-all",
                        offload=True, memory_budget="1GiB")

    compiled = _compile(model, example, analysis, pp=pp, dp=dp, microbatches=MICROBATCHES, solver="none",
                        memory_budget="1GiB", schedule=schedule, virtual_stages=2)
    graph, config = compiled.analysis.graph, compiled.config
    full = plan_graph(graph, config.replace(solver="full"))
    keep, lean = compiled.plan.predicted.peak_memory_bytes[0], full.predicted.peak_memory_bytes[0]
    config = config.replace(solver="heu", memory_budget=(keep + lean) // 2)
    return dataclasses.replace(compiled, plan=plan_graph(graph, config), config=config)


def compile_with(model: nn.Module, example: tuple | dict, plan: Any, analysis: Any = None) -> Any:
    """``lynx.compile`` with a plan :func:`compile_recomputing` made (checked against this model;
    from ``analysis`` when given, as there)."""
    from lynx.config import FINGERPRINT_FIELDS

    extra = {k: plan.config[k] for k in ("offload", "host_memory_budget") if k in plan.config}
    return _compile(model, example, analysis, plan=plan, **{k: plan.config[k] for k in FINGERPRINT_FIELDS}, **extra)


def analyze(model: nn.Module, example: tuple | dict) -> Any:
    """The capture and profile ``lynx.compile`` makes of ``model`` on this machine
    (``hardware="cpu-local"``): a process compiling one model under several plans captures it
    once (``torch.export``, ~2 CPU-s a model) and plans each from it."""
    import lynx

    return lynx.analyze(model, example, hardware="cpu-local")


def _compile(model: nn.Module, example: tuple | dict, analysis: Any, **settings: Any) -> Any:
    """``lynx.compile`` on ``hardware="cpu-local"``, from ``analysis`` when given."""
    import lynx
    from lynx.compiler import compile_analysis

    settings.setdefault("hardware", "cpu-local")
    if analysis is None:
        return lynx.compile(model, example, **settings)
    return compile_analysis(analysis, **settings)


def batches(dp: int) -> list[torch.Tensor]:
    """Per step, the whole job's batch of token windows (dp × microbatches × MICRO rows, SEQ + 1)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (dp * MICROBATCHES * MICRO, SEQ + 1), generator=gen) for _ in range(STEPS)]


def step_inputs(kind: str, window: torch.Tensor) -> tuple[tuple, dict]:
    """(positional, keyword) inputs of a step: non-contiguous slices, as a loader gives them."""
    if kind in POSITIONAL:
        return (window[:, :-1], window[:, 1:]), {}
    return (), {"input_ids": window[:, :-1], "labels": window[:, 1:]}


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def reference(kind: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process PyTorch training of the same batches: per replica, the microbatch losses
    scaled by 1/m and accumulated; the replicas' gradients averaged; AdamW. Returns the
    per-step mean microbatch losses, the first step's gradients and the final parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as torchrun's workers: LayerNorm's weight gradient sums per thread
    try:
        return _reference(kind, dp)
    finally:
        torch.set_num_threads(threads)


def _reference(kind: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model, _ = build(kind)
    model.train()
    opt = optimizer(model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    losses, first_grads = [], {}
    for window in batches(dp):
        args, kwargs = step_inputs(kind, window)
        replica_grads, mb_losses = [], []
        for d in range(dp):
            for p in params:
                p.grad = None
            for j in range(MICROBATCHES):
                rows = slice((d * MICROBATCHES + j) * MICRO, (d * MICROBATCHES + j + 1) * MICRO)
                out = model(*[a[rows].contiguous() for a in args],
                            **{k: v[rows].contiguous() for k, v in kwargs.items()})
                loss = loss_of(kind, out)
                mb_losses.append(loss.detach())
                (loss * (1.0 / MICROBATCHES)).backward()
            replica_grads.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            total = replica_grads[0][i]
            for d in range(1, dp):
                total = total + replica_grads[d][i]
            p.grad = total / dp if dp > 1 else total
        losses.append(float(torch.stack(mb_losses).mean()))
        if not first_grads:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}
