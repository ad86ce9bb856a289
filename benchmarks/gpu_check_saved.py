"""Check 1 of ``gpu_check.py``: the profile's saved bytes vs what a real forward saves.

For each attention (math, sdpa) and dtype, the GPT at the run's sizes (dropout 0.1, train
mode) is profiled for the device's target (``lynx.profile(lynx.capture(...), target=...)``:
on ``cuda`` the CPU-run emulation of bool dropout masks and flash attention) and run forward
for real on the device inside ``torch.autograd.graph.saved_tensors_hooks``: every saved
tensor's storage is counted once, parameters and buffers left out — the profile's own
definition, measured by the device's kernels instead of emulated. Bar: within 1%.

Math attention in 2-byte dtypes is also held against Korthikanti et al. 2022,
``s·b·h·(34 + 5·a·s/h)`` bytes per layer, with the measured bytes of layer 0 (each saved
storage counted in the layer that first saved it, so the layer's input belongs to it). The
formula assumes 1-byte dropout masks, which only CUDA's fused dropout saves.

On CUDA each case is also held against what runs — the compiled stage (its meter, and the
allocator's growth over a forward) — and lynx's Llama (RMSNorm, rotary, SwiGLU) is added in
bf16, with every node whose profile differs from the compiled stage's holdings listed.

Example::

    >>> import torch
    >>> from gpu_check_common import SIZES, build_gpt
    >>> model, inputs = build_gpt(SIZES["tiny"], dtype="float32", attention="math")
    >>> saved = measure_saved(model, inputs)
    >>> saved.total > sum(saved.per_layer) > 0 and saved.tensors > 10
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import lynx
from gpu_check_common import CheckResult, Env, Part, build_gpt, free_memory, judged, rel_diff

__all__ = ["check_saved_bytes", "measure_saved", "korthikanti_layer_bytes", "Saved"]

BAR = 0.01


def korthikanti_layer_bytes(seq: int, microbatch: int, hidden: int, heads: int) -> int:
    """Activation bytes of one GPT layer (math attention, dropout, 2-byte activations)."""
    return seq * microbatch * hidden * 34 + 5 * heads * seq * seq * microbatch


@dataclass
class Saved:
    """What one real forward saved for backward."""

    total: int                # bytes, each storage once, parameters and buffers excluded
    per_layer: list[int]      # bytes first saved inside ``model.layers[i]``
    tensors: int              # pack-hook calls
    kernels: list[str]        # attention / softmax / dropout backward nodes (which SDPA backend ran)


def measure_saved(model: torch.nn.Module, inputs: tuple) -> Saved:
    """Bytes autograd saves in one real forward of ``model`` (see :class:`Saved`)."""
    excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, tuple[int, Any]] = {}   # storage address -> (bytes, layer); tensors stay alive
    current: list[Any] = [None]
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in excluded and key not in seen:
            seen[key] = (storage.nbytes(), current[0])
        return t

    hooks = []
    for i, layer in enumerate(getattr(model, "layers", [])):
        hooks.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*inputs)  # the graph (and so every saved tensor) lives until `loss` goes
            total = sum(nbytes for nbytes, _ in seen.values())
            per_layer = [sum(n for n, layer in seen.values() if layer == i) for i in range(len(hooks) // 2)]
            kernels = _backward_kernels(loss, ("Attention", "Softmax", "Dropout"))
    finally:
        for h in hooks:
            h.remove()
    del loss
    return Saved(total, per_layer, count[0], kernels)


def _backward_kernels(loss: torch.Tensor, words: tuple[str, ...]) -> list[str]:
    """Names of the autograd nodes behind ``loss`` that contain one of ``words``."""
    names, stack, seen = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if any(w in node.name() for w in words):
            names.add(node.name())
        stack.extend(fn for fn, _ in node.next_functions)
    return sorted(names)


def measure_compiled(model: torch.nn.Module, inputs: tuple) -> dict[str, int]:
    """What a compiled stage that drops nothing holds after one forward of ``model``.

    ``meter``: Lynx's own count (``stage.meter``, storages of the values the lowered backward
    reads); on a CUDA device also ``allocator``: ``torch.cuda.memory_allocated`` after the
    forward less before it (the held values plus the small outputs)."""
    from lynx.rewrite import build_stages
    from lynx.rewrite.split import op_nodes

    captured = lynx.capture(model, inputs)
    stage, = build_stages(captured.gm, [[n.name for n in op_nodes(captured.gm)]])
    batch = dict(zip(captured.input_names, inputs))
    args = [batch[n] for n in stage.spec.inputs]
    warm = stage(*args, microbatch=0)  # the joint trace and workspaces happen outside the count
    device = inputs[0].device
    free_memory(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    held_before = stage.meter.live_by.get("stage", 0)
    out = stage(*args, microbatch=1)  # microbatch 0 stays held (no backward): both figures are deltas
    figures = {"meter": stage.meter.live_by.get("stage", 0) - held_before}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        figures["allocator"] = torch.cuda.memory_allocated(device) - before
    del out, warm
    return figures


def _compiled_by_node(captured: Any) -> dict[str, int]:
    """Bytes the compiled executor keeps per captured node, from the joint graph traced on the
    real (device) tensors: :func:`lynx.frontend.joint.saved_by_node`, as the CPU profile counts."""
    from lynx.frontend.capture import quiet_torch
    from lynx.frontend.joint import profile_saved
    from lynx.frontend.profile import _named_attrs

    with quiet_torch():
        saved, _ops = profile_saved(captured.gm, _named_attrs(captured.gm), list(captured.example_inputs))
    return {name: entry[0] for name, entry in saved.items()}


def _llama_case(env: Env) -> dict[str, Part]:
    """lynx's Llama (RMSNorm, rotary, SwiGLU, sdpa) at the run's sizes in bf16: the family whose
    compiled stages held more than eager autograd saves on the CPU (silu kept whole)."""
    from lynx.models.llama import Llama, LlamaConfig

    sizes = env.sizes
    cfg = LlamaConfig(vocab_size=sizes.vocab, seq_len=sizes.seq, hidden=sizes.hidden, heads=sizes.heads,
                      kv_heads=sizes.heads, layers=sizes.layers, ffn_hidden=sizes.hidden * 11 // 4)
    torch.manual_seed(0)
    with torch.device(env.device):
        model = Llama(cfg).to(torch.bfloat16).train()
    idx = torch.randint(0, sizes.vocab, (sizes.microbatch, sizes.seq), device=env.device)  # (B, T)
    inputs = (idx, idx.roll(-1, dims=1))
    captured = lynx.capture(model, inputs)
    prof = lynx.profile(captured, target=env.target)
    profiled = prof.total_saved_bytes
    eager = measure_saved(model, inputs).total
    compiled = measure_compiled(model, inputs)
    by_node = _compiled_by_node(captured)
    differing = sorted(((name, prof.nodes[name].saved_bytes if name in prof.nodes else None, held)
                        for name, held in by_node.items()
                        if name not in prof.nodes or prof.nodes[name].saved_bytes != held),
                       key=lambda t: -abs((t[1] or 0) - t[2]))
    missing = [(n, r.saved_bytes) for n, r in prof.nodes.items() if r.saved_bytes and n not in by_node]
    diff = rel_diff(profiled, compiled["meter"])
    figure = {"profile_bytes": profiled, "eager_bytes": eager, "compiled_meter_bytes": compiled["meter"],
              "compiled_allocator_bytes": compiled.get("allocator"), "rel_diff": diff,
              "eager_vs_compiled": rel_diff(eager, compiled["meter"]),
              "allocator_vs_meter": rel_diff(compiled.get("allocator", 0), compiled["meter"]),
              "by_node_total": sum(by_node.values()),
              "nodes_differing": [(n, prof.nodes[n].op if n in prof.nodes else "?", p, h)
                                  for n, p, h in differing[:40]],
              "profiled_not_held": missing[:40]}
    del model, inputs, idx
    free_memory(env.device)
    return {"llama/bfloat16/compiled": Part(
        figure, judged(abs(diff) <= BAR),
        f"profile {diff:+.3%} vs the compiled stage's meter (eager saves {figure['eager_vs_compiled']:+.3%}, "
        f"allocator {figure['allocator_vs_meter']:+.3%} of it; bar ±{BAR:.0%})")}


def check_saved_bytes(env: Env) -> CheckResult:
    sizes, parts, worst = env.sizes, {}, 0.0
    for attention in sizes.attentions:
        for dtype in sizes.dtypes:
            name = f"{attention}/{dtype}"
            model, inputs = build_gpt(sizes, dtype=dtype, attention=attention, device=env.device)
            profiled = lynx.profile(lynx.capture(model, inputs), target=env.target).total_saved_bytes
            saved = measure_saved(model, inputs)
            compiled = measure_compiled(model, inputs)
            # on CPU the executor is the compiled stage, whose saves the cpu profile counts
            measured, per_layer = (saved.total if env.cuda else compiled["meter"]), saved.per_layer
            diff = rel_diff(profiled, measured)
            worst = max(worst, abs(diff))
            parts[name] = Part({"profile_bytes": profiled, "measured_bytes": measured, "rel_diff": diff,
                                "saved_tensors": saved.tensors, "kernels": saved.kernels},
                               judged(abs(diff) <= BAR), f"profile {diff:+.3%} vs measured (bar ±{BAR:.0%})")
            if env.cuda:  # what runs is the compiled stage: how far is the profile from what it holds?
                cdiff = rel_diff(profiled, compiled["meter"])
                figure = {"profile_bytes": profiled, "eager_bytes": saved.total, "compiled_meter_bytes":
                          compiled["meter"], "compiled_allocator_bytes": compiled.get("allocator"),
                          "rel_diff": cdiff,
                          "eager_vs_compiled": rel_diff(saved.total, compiled["meter"]),
                          "allocator_vs_meter": rel_diff(compiled.get("allocator", 0), compiled["meter"])}
                parts[f"{name}/compiled"] = Part(
                    figure, judged(abs(cdiff) <= BAR),
                    f"profile {cdiff:+.3%} vs the compiled stage's meter (eager saves "
                    f"{figure['eager_vs_compiled']:+.3%}, allocator {figure['allocator_vs_meter']:+.3%} of it; "
                    f"bar ±{BAR:.0%})")
            if attention == "math" and dtype in ("float16", "bfloat16") and per_layer:
                formula = korthikanti_layer_bytes(sizes.seq, sizes.microbatch, sizes.hidden, sizes.heads)
                kdiff = rel_diff(per_layer[0], formula)
                if env.cuda:
                    parts[f"korthikanti/{dtype}"] = Part(
                        {"layer0_measured_bytes": per_layer[0], "formula_bytes": formula, "rel_diff": kdiff},
                        judged(abs(kdiff) <= BAR), f"layer 0 measured {kdiff:+.3%} vs s·b·h·(34+5as/h)")
                else:
                    parts[f"korthikanti/{dtype}"] = Part(
                        {"layer0_measured_bytes": per_layer[0], "formula_bytes": formula, "rel_diff": kdiff},
                        "skipped", "the formula assumes CUDA's 1-byte dropout masks; a CPU dropout saves "
                                   "its mask in the input's dtype")
            del model, inputs
            free_memory(env.device)
    if env.cuda:
        parts.update(_llama_case(env))
    how = ("cuda target (bool dropout masks and flash attention emulated on fake CPU tensors) vs the "
           "device's kernels" if env.cuda else
           "cpu target vs what a compiled stage keeps on this CPU; the CUDA emulation is not exercised on "
           "this device")
    return CheckResult({"max_abs_rel_diff": worst, "cases": len(sizes.attentions) * len(sizes.dtypes)},
                       f"worst case {worst:.3%} (bar {BAR:.0%}); {how}", parts)
