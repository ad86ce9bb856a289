"""Bring your own transformer: what capture needs, what to do when it fails, and a plan that runs.

Lynx captures a model with ``torch.export`` (non-strict; ``torch.fx.symbolic_trace`` as a
fallback) into a graph of aten ops, for the example inputs you give. What that needs:

* **One microbatch of example inputs** with the shapes of training (sequence length,
  microbatch size). Real, fake or meta tensors: planning never runs the real model.
* **A forward that returns the scalar loss** to train through the runtime (the last pipeline
  stage's output is the loss). Returning logits is enough to inspect and plan.
* **No Python control flow on tensor values**: ``if x.max() > 10``, ``.item()``, ``.tolist()``
  or a shape computed from data cannot be followed. Branches on shapes or config are fine.
* **Repeated layers** are found by structure (same ops, same wiring, same shapes), wherever
  they sit — a ``ModuleList`` or, as here, plain attributes. Layers that differ are planned as
  separate classes; everything still works, HEU just has less to replicate.

When capture fails, :class:`lynx.LynxCaptureError` names the line in your code and says what
to do. The usual fixes:

* a branch on values → ``torch.where`` (both sides computed) or ``torch.cond``;
* ``.item()`` / printing / logging of tensor values in ``forward`` → move it out of
  ``forward`` (or return the value and log it outside);
* a model too large to allocate → build it on the meta device
  (``with torch.device("meta"): model = MyModel()``) with meta example inputs: capture,
  profile and plan work on shapes alone (``examples/plan_20b.py``);
* a model from ``transformers`` → wrap it so ``forward(input_ids, labels)`` returns
  ``.loss`` (``tests/test_transformers_models.py`` does this for GPT-2 and Llama).

This example

1. defines a small transformer whose blocks are not in a ``layers.N`` list,
2. shows the error a data-dependent branch produces, and the fix,
3. inspects the fixed model: its three blocks are found as one repeated class,
4. plans it for 2 pipeline stages under a budget that forces recomputation, and
5. runs the two rewritten stages in one process (1F1B, recomputation in the plan's windows
   and on demand) and checks the gradients are bitwise those of the original model.

Run it, or point the CLI at its factory::

    python examples/custom_model.py
    lynx inspect examples/custom_model.py:make_model --target cpu --hardware auto
    lynx compare examples/custom_model.py:make_model --pp 2 -m 4 --hardware auto

(``auto``: this machine, measured once by ``lynx calibrate``. The script itself plans with the
fixed ``cpu-local`` figures, so that what it prints is the same on every machine — the tests
run it; pass ``hardware="auto"`` to plan for yours.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lynx

MICROBATCHES = 4


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
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # the scalar loss


def make_model(clamp_by_value: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The factory ``lynx inspect path:make_model`` calls: (model, one microbatch of inputs)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 32))  # (B, T)
    return TinyLM(clamp_by_value=clamp_by_value), (idx, idx.roll(-1, dims=1))


def show_capture_failure() -> str:
    """Step 2: the error a value-dependent branch gives (returned, for the test)."""
    model, inputs = make_model(clamp_by_value=True)
    try:
        lynx.capture(model, inputs)
    except lynx.LynxCaptureError as err:
        return str(err)
    raise AssertionError("capture should have failed on the data-dependent branch")


def budget_forcing_recompute(graph, config: lynx.CompileConfig) -> int:
    """A budget 30% of the way from full recomputation's peak to keep-all's (as benchmarks/grid.py)."""
    from lynx.planner.loop import plan_graph

    peak = {s: max(plan_graph(graph, config.replace(solver=s), check_budget=False).predicted.peak_memory_bytes)
            for s in ("none", "full")}
    return int(peak["full"] + 0.3 * (peak["none"] - peak["full"]))


def plan_and_check(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> lynx.Plan:
    """Steps 4–5: plan for 2 stages, run the rewritten stages, compare gradients bitwise."""
    from lynx.testing import run_local

    # cpu-local: fixed figures, the same plan on every machine (tests run this); "auto" plans for yours
    config = lynx.CompileConfig(pp=2, microbatches=MICROBATCHES, hardware="cpu-local", solver="heu")
    probe = lynx.compile(model, inputs, config.replace(solver="none"))
    budget = budget_forcing_recompute(probe.analysis.graph, config)
    compiled = lynx.compile(model, inputs, config.replace(memory_budget=budget))
    plan = compiled.plan

    # The original model, eager: gradients summed over the microbatches.
    model.zero_grad(set_to_none=True)
    for _ in range(MICROBATCHES):
        model(*inputs).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}

    # The two rewritten stages in 1F1B order, each recomputing what the plan drops in its windows.
    model.zero_grad(set_to_none=True)
    stages = [compiled.stage(i) for i in range(config.pp)]
    batch = dict(zip(compiled.analysis.captured.input_names, inputs))
    schedules = [plan.stage_schedule(i) for i in range(config.pp)]
    run_local(stages, [batch] * MICROBATCHES, schedule="1f1b",
              prefetch=lambda s, j: [nodes for _window, nodes in schedules[s].prefetch.get(j, [])])
    for name, p in model.named_parameters():
        if not torch.equal(p.grad, reference[name]):
            raise AssertionError(f"gradient of {name} differs from the original model's")

    print(f"plan: {plan.solver} ({plan.status}), budget {budget / 2**20:.2f} MiB per stage, "
          f"predicted step {plan.predicted.step_time_s * 1e3:.2f} ms")
    for stage in plan.stages:
        dropped = [d for d in stage.decisions if d.action == "recompute"]
        windowed = [d for d in dropped if d.window or d.windows]
        print(f"  stage {stage.index}: blocks {', '.join(stage.blocks)}; recomputes {len(dropped)} of "
              f"{len(stage.decisions)} ops ({len(windowed)} in windows); peak {stage.peak_memory_bytes / 2**20:.2f} "
              f"of {stage.budget_bytes / 2**20:.2f} MiB")
    print(f"rewritten stages: gradients of all {len(reference)} parameters bitwise equal to the original model's")
    return plan


def main() -> None:
    print("capture failed, as it should for a value-dependent branch:\n")
    print(show_capture_failure(), "\n")

    model, inputs = make_model()
    report = lynx.inspect_model(model, inputs, target="cpu", hardware="cpu-local")
    for c in report.classes:
        print(f"{c.layer_class:10s} ×{c.count}  {c.nodes} ops  {c.saved_bytes / 1024:.1f} KiB saved per instance")
    print()
    plan_and_check(model, inputs)


if __name__ == "__main__":
    main()
