"""Models, plans and the single-process reference of the tensor-parallel tests (tests/runtime/test_tp_pipeline.py).

Three models, dropout 0 (a sharded dropout draws per-rank masks, not the unsharded model's):
``gpt``: lynx's GPT at gpt-tiny's shape (fused q/k/v split in three, math attention, GELU MLP);
``llama``: a ``transformers`` LlamaForCausalLM from a config with sdpa attention and
grouped-query attention (4 heads, 2 key/value heads); ``plain``: a GPT written as a plain
``nn.Module`` (separate q/k/v projections, ``F.scaled_dot_product_attention``, returns
``(logits, loss)``; a key/value cache started empty, as ``transformers`` starts one, so its
constant and the cat that skips it run replicated). Each is compiled in the parent process
with an HEU plan under a budget between what full recomputation and keeping everything need
on stage 0 (so it recomputes), the tightest of a few at which it recomputes inside TP windows
too, and with solver ``none`` (the same sharded stages without recomputation).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, MICRO, MICROBATCHES, STEPS, LR = 64, 8, 2, 4, 5, 1e-2
KINDS = ("gpt", "llama", "plain")


class PlainAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        past = torch.tensor([])   # a fresh key/value cache as transformers starts one: a constant, cat skips it
        k, v = torch.cat([past, k], dim=-2), torch.cat([past, v], dim=-2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = PlainAttention(dim, heads)
        self.fc_in, self.fc_out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln2(x))))


class PlainGPT(nn.Module):
    """forward(idx, targets) -> (logits, loss)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        for p in self.parameters():   # scaled like GPT-2, so a few AdamW steps move the loss
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 if p.shape[0] != dim else 2 * layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))                                     # (B, T, V)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def build(kind: str) -> tuple[nn.Module, tuple | dict]:
    """The model (seed 0) and one microbatch of example inputs."""
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (MICRO, SEQ))
    if kind == "gpt":
        from lynx.models.gpt import GPT
        from lynx.models.presets import PRESETS

        cfg = dataclasses.replace(PRESETS["gpt-tiny"].config, vocab_size=VOCAB, seq_len=SEQ, hidden=32, dropout=0.0)
        return GPT(cfg), (idx, idx.roll(-1, 1))
    if kind == "plain":
        return PlainGPT(), (idx, idx.roll(-1, 1))
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg), {"input_ids": idx, "labels": idx.roll(-1, 1)}


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, tp: int) -> Any:
    """The model analysed and sharded once (the analysis does not depend on pp)."""
    import lynx

    model, example = build(kind)
    return lynx.compile(model, example, pp=1, tp=tp, microbatches=MICROBATCHES, solver="none",
                        hardware="cpu-local", memory_budget="1GiB")


@functools.lru_cache(maxsize=None)
def plans(kind: str, pp: int, tp: int, schedule: str = "1f1b") -> dict[str, Any]:
    """The parent's plans for ``kind`` on pp × tp: ``heu`` (recomputes, in TP windows too) and
    ``none``, with what a rank needs to run them (``captured_with_plan``'s arguments). Made once
    per process (the tp 2 world's mismatch is the pp 2 × tp 2 world's gpt); not to be changed."""
    from lynx.planner.loop import plan_graph

    compiled = _compiled(kind, tp)
    graph, config = compiled.analysis.graph, compiled.config.replace(pp=pp, schedule=schedule)
    none = plan_graph(graph, config)
    full = plan_graph(graph, config.replace(solver="full"))
    keep, lean = none.predicted.peak_memory_bytes[0], full.predicted.peak_memory_bytes[0]
    # the tightest budget (from halfway between full's peak and none's, upwards) at which HEU also
    # recomputes inside TP windows: below it prefetching does not fit (OPT agrees on these models)
    for level in (0.5, 0.7, 0.85, 0.95, 0.98):
        heu_config = config.replace(solver="heu", memory_budget=int(lean + level * (keep - lean)))
        heu = plan_graph(graph, heu_config)
        if in_tp_windows(heu):
            break
    layer_of = {n: a["layer"] for n, a in graph.nodes(data=True) if a.get("layer") is not None}
    return {"heu": (heu, heu_config), "none": (none, config), "kind": kind,
            "sharding": compiled.sharding, "layer_of": layer_of}


def in_tp_windows(plan: Any) -> list[str]:
    """The nodes a plan recomputes inside TP windows (for some microbatch)."""
    return [d.node for s in plan.stages for d in s.decisions if d.action == "recompute"
            and any(".tp." in str(w or "") for w in [d.window, *(d.windows or {}).values()])]


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (MICROBATCHES * MICRO, SEQ + 1), generator=gen) for _ in range(STEPS)]


def step_inputs(kind: str, window: torch.Tensor) -> tuple[tuple, dict]:
    if kind == "llama":
        return (), {"input_ids": window[:, :-1], "labels": window[:, 1:]}
    return (window[:, :-1], window[:, 1:]), {}


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process PyTorch on the same batches: microbatch losses scaled by 1/m, AdamW; the
    per-step mean losses and the first step's gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = build(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, first = [], {}
        for window in batches():
            args, kwargs = step_inputs(kind, window)
            mb = []
            for j in range(MICROBATCHES):
                rows = slice(j * MICRO, (j + 1) * MICRO)
                out = model(*[a[rows].contiguous() for a in args],
                            **{k: v[rows].contiguous() for k, v in kwargs.items()})
                loss = out.loss if kind == "llama" else out[1] if isinstance(out, tuple) else out
                mb.append(loss.detach())
                (loss * (1.0 / MICROBATCHES)).backward()
            losses.append(float(torch.stack(mb).mean()))
            if not first:
                first = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        return losses, first
    finally:
        torch.set_num_threads(threads)


# kind -> (model, example, initial state, capture or None): a rank captures each model once and
# every run of it in the world (both plans, another schedule, DeMo, the mismatch) starts from
# that capture, whose stage splits and joint traces are cached with it — a capture and a joint
# trace cost a rank more than its training steps
_SHARED: dict[str, tuple[nn.Module, Any, dict[str, torch.Tensor], Any]] = {}


def _compiled_on_rank(kind: str, plan: Any, config: Any, prepared: dict[str, Any]) -> Any:
    """``captured_with_plan`` of ``kind``'s shared model (reset to its initial weights) and capture."""
    from lynx.testing import captured_with_plan

    if kind not in _SHARED:
        model, example = build(kind)
        _SHARED[kind] = (model, example, {k: v.clone() for k, v in model.state_dict().items()}, None)
    model, example, initial, captured = _SHARED[kind]
    model.load_state_dict(initial)   # the same start for every run
    compiled = captured_with_plan(model, example, plan, config, sharding=prepared["sharding"],
                                  layer_of=prepared.get("layer_of"), captured=captured)
    _SHARED[kind] = (model, example, initial, compiled.analysis.captured)
    return compiled


def train_rank(kind: str, prepared: dict[str, Any]) -> dict[str, Any]:
    """On one rank: both plans through ``lynx.runtime.Pipeline``, STEPS AdamW steps each; losses,
    first-step gradients and final parameters (this rank's shards), the TP-window figures and
    the order of the generated backward code around each TP window."""
    import lynx.runtime

    out: dict[str, Any] = {}
    kind = prepared.get("kind", kind)   # "gpt/gpipe": the gpt model under another schedule
    for name in ("heu", "none"):
        plan, config = prepared[name]
        compiled = _compiled_on_rank(kind, plan, config, prepared)   # one capture, so one joint trace, for both
        pipe = lynx.runtime.Pipeline(compiled, exit_on_error=False, timeout_s=120)
        out["slices"] = thread_slices()
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
        losses, grads, hidden, exposed, peak = [], {}, 0.0, 0.0, 0
        for window in batches():
            args, kwargs = step_inputs(kind, window)
            losses.append(float(pipe.step(*args, **kwargs)))
            if not grads:
                grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
            opt.step()
            opt.zero_grad()
            hidden += pipe.last_stats.recompute_tp_hidden_s
            exposed += pipe.last_stats.recompute_tp_exposed_s
            peak = max(peak, pipe.last_stats.peak_saved_bytes)
        out[name] = {"losses": losses, "grads": grads, "hidden": hidden, "exposed": exposed, "peak": peak,
                     "predicted_peak": plan.stage(pipe.stage_index).activation_bytes,
                     "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
                     "windows": window_order(pipe.stage)}
        out["rank"], out["stage"], out["tp_rank"] = pipe.rank, pipe.stage_index, pipe.topology.tp_rank
        pipe.close()
    return out


def thread_slices() -> list[float | None]:
    """The scheduler slice of every thread of this rank (lynx.runtime.sched_slice)."""
    import os

    from lynx.runtime.sched_slice import thread_slice_s

    return [thread_slice_s(int(t)) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else []


def window_order(stage: Any) -> list[tuple[bool, int]]:
    """For each TP window in the stage's generated backward graphs: whether the wait after it
    waits on the all-reduce issued just before it, and how many ops it ran in between."""
    found = []
    for graph in stage.backward_graphs():
        nodes = list(graph.gm.graph.nodes)
        last_reduce, start = None, None
        for i, n in enumerate(nodes):
            target = str(n.target)
            if "all_reduce" in target:
                last_reduce = n
            elif "tp_segment_start" in target:
                start = i
            elif "wait_tensor" in target and start is not None:
                ops = sum(1 for m in nodes[start:i] if str(m.target).startswith("aten."))
                found.append((n.args[0] is last_reduce, ops))
                start = None
    return found


def demo_rank(prepared: dict[str, Any]) -> dict[str, Any]:
    """tp 2 × dp 2 with DeMo over the data-parallel group only: 2 steps; this rank's parameters."""
    import lynx.runtime
    from lynx.optim import DeMo

    plan, config = prepared["none"]
    compiled = _compiled_on_rank("gpt", plan, config, prepared)
    pipe = lynx.runtime.Pipeline(compiled, exit_on_error=False, timeout_s=120)
    opt = DeMo(list(pipe.parameters()), lr=1e-3, process_group=pipe.dp_group)
    pipe.use_optimizer(opt)
    window = torch.cat(batches()[:2])   # dp 2 × m × MICRO rows
    losses = []
    for _ in range(2):
        losses.append(float(pipe.step(window[:, :-1], window[:, 1:])))
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "dp_rank": pipe.topology.dp_rank, "tp_rank": pipe.topology.tp_rank,
           "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}
    pipe.close()
    return out


def plans_dp(kind: str, tp: int, dp: int) -> dict[str, Any]:
    """``plans`` for pp 1 × tp × dp (solver none)."""
    from lynx.planner.loop import plan_graph

    compiled = _compiled(kind, tp)
    config = compiled.config.replace(dp=dp, optimizer="demo")
    layer_of = {n: a["layer"] for n, a in compiled.analysis.graph.nodes(data=True) if a.get("layer") is not None}
    return {"none": (plan_graph(compiled.analysis.graph, config), config), "sharding": compiled.sharding,
            "layer_of": layer_of}


def world_main(prepared: dict[str, dict[str, Any]], mismatch: Any = None, demo: Any = None) -> dict[str, Any]:
    """One spawned rank: every model in turn (the world is shared); with ``mismatch`` (a plan for
    another world size), also the error a Pipeline raises for it; with ``demo``, a tp × dp run
    with DeMo (:func:`demo_rank`)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {kind: train_rank(kind, prep) for kind, prep in prepared.items()}
    if demo is not None:
        out["demo"] = demo_rank(demo)
    if mismatch is not None:
        import lynx.runtime
        from lynx.errors import LynxConfigError

        kind, prep = mismatch
        plan, config = prep["none"]
        compiled = _compiled_on_rank(kind, plan, config, prep)
        try:
            lynx.runtime.Pipeline(compiled, exit_on_error=False)
            out["mismatch"] = "no error"
        except LynxConfigError as err:
            out["mismatch"] = str(err)
    return out
