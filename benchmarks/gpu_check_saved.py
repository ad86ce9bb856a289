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


def measure_compiled(model: torch.nn.Module, inputs: tuple) -> int:
    """Bytes a compiled stage that drops nothing holds after one forward (``stage.meter``): what a
    ``cpu`` target profile counts (AOTAutograd's joint graph; its CPU dropout keeps a bool mask)."""
    from lynx.rewrite import build_stages
    from lynx.rewrite.split import op_nodes

    captured = lynx.capture(model, inputs)
    stage, = build_stages(captured.gm, [[n.name for n in op_nodes(captured.gm)]])
    batch = dict(zip(captured.input_names, inputs))
    out = stage(*[batch[n] for n in stage.spec.inputs], microbatch=0)
    held = stage.meter.live_by.get("stage", 0)
    del out
    return held


def check_saved_bytes(env: Env) -> CheckResult:
    sizes, parts, worst = env.sizes, {}, 0.0
    for attention in sizes.attentions:
        for dtype in sizes.dtypes:
            name = f"{attention}/{dtype}"
            model, inputs = build_gpt(sizes, dtype=dtype, attention=attention, device=env.device)
            profiled = lynx.profile(lynx.capture(model, inputs), target=env.target).total_saved_bytes
            saved = measure_saved(model, inputs)
            # on CPU the executor is the compiled stage, whose saves the cpu profile counts
            measured, per_layer = (saved.total if env.cuda else measure_compiled(model, inputs)), saved.per_layer
            diff = rel_diff(profiled, measured)
            worst = max(worst, abs(diff))
            parts[name] = Part({"profile_bytes": profiled, "measured_bytes": measured, "rel_diff": diff,
                                "saved_tensors": saved.tensors, "kernels": saved.kernels},
                               judged(abs(diff) <= BAR), f"profile {diff:+.3%} vs measured (bar ±{BAR:.0%})")
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
    how = ("cuda target (bool dropout masks and flash attention emulated on fake CPU tensors) vs the "
           "device's kernels" if env.cuda else
           "cpu target vs what a compiled stage keeps on this CPU; the CUDA emulation is not exercised on "
           "this device")
    return CheckResult({"max_abs_rel_diff": worst, "cases": len(sizes.attentions) * len(sizes.dtypes)},
                       f"worst case {worst:.3%} (bar {BAR:.0%}); {how}", parts)
