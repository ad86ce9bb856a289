"""Plans that offload run: gradients bitwise equal to the un-rewritten model, memory as planned.

On a CPU device an offloaded value is copied into a separate host buffer after its forward
(the device's storage released) and copied back into a fresh one before its backward — the
same code path as CUDA's pinned buffers and copy stream, synchronously. So:

* gpt-tiny, a ``transformers`` Llama (eager attention) and GPT-2 built from configs (dropout
  on), 1 and 2 stages: a recomputing plan with every other kept node offloaded — brought back
  in a window for even microbatches, else when the backward reaches a node three places later
  or at its start — gives the original model's losses and gradients bitwise;
* gpt-tiny, pp 2 under 1F1B: the offload baselines (PipeOffload's offload-all, Megatron's
  offload-modules) and OPT planning for a host link beside compute: each stage's measured peak
  of saved bytes is within 5% of the plan's prediction.

Multi-process pp 2 × dp 2 under a plan that offloads: ``tests/runtime/test_user_pipeline.py``;
a zero-bubble split backward: ``tests/test_zero_bubble_split.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

import lynx
from lynx.plan import Decision
from lynx.testing import run_local

transformers = pytest.importorskip("transformers")


class _Loss(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


def _model(name: str):
    torch.manual_seed(0)
    if name == "llama-hf":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                       attention_dropout=0.0)
        cfg._attn_implementation = "eager"   # (sdpa runs another program under export)
        model = _Loss(transformers.LlamaForCausalLM(cfg))
        ids = torch.randint(0, 128, (2, 16))
        return model, (ids, ids)
    if name == "gpt2-hf":
        from test_rewrite import _gpt2_from_config  # pytest puts tests/ on sys.path (no package)

        return _gpt2_from_config()
    return lynx.models.build_preset(name, device="cpu", dropout=0.1, seq=16)


@functools.lru_cache(maxsize=None)
def _analysis(name: str):
    """The model analysed once for every pp and microbatch count (an analysis depends on neither)."""
    model, inputs = _model(name)
    model.train()
    hardware = lynx.CompileConfig(hardware="cpu-local", target="cpu").hardware_spec()
    return model, inputs, lynx.analyze(model, inputs, target="cpu", hardware=hardware)


def _with_offload(plan):
    """``plan`` with every other kept node of each stage offloaded (the stage's last three kept):
    prefetched in its stage's first window for microbatch 0, else where the backward reaches
    the node three places later (every third: at the backward's start)."""
    stages = []
    for sp in plan.stages:
        names = [d.node for d in sp.decisions]
        decisions, k = [], 0
        for i, d in enumerate(sp.decisions):
            if d.action == "keep" and i < len(names) - 3:
                k += 1
                if k % 2:
                    at = names[i + 3] if k % 3 else None
                    d = Decision(node=d.node, action="offload", windows={0: f"s{sp.index}.recv_grad.mb0"},
                                 prefetch_at=at)
            decisions.append(d)
        stages.append(sp.model_copy(update={"decisions": decisions}))
    return plan.model_copy(update={"stages": stages})


def _prefetch(plan):
    """run_local's windows: per (stage, microbatch) the nodes recomputed and brought back."""
    schedules = [plan.stage_schedule(s) for s in range(len(plan.stages))]

    def prefetch(s: int, j: int) -> list[list[str]]:
        sched = schedules[s]
        return [nodes for _w, nodes in sched.prefetch.get(j, []) + sched.offload_prefetch.get(j, [])]

    return prefetch


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-hf", "gpt2-hf"])
def test_offloading_plans_give_bitwise_gradients(name: str, pp: int) -> None:
    from lynx.compiler import Compiled
    from lynx.planner.loop import plan_graph

    m = 2
    model, inputs, analysis = _analysis(name)
    config = lynx.CompileConfig(pp=pp, microbatches=m, hardware="cpu-local", target="cpu", solver="selective")
    plan = _with_offload(plan_graph(analysis.graph, config, check_budget=False))
    assert all(any(d.action == "offload" for d in sp.decisions) for sp in plan.stages)
    compiled = Compiled(plan=plan, config=config, analysis=analysis)
    batch = dict(zip(analysis.captured.input_names, inputs))

    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    ref_losses = []
    for _ in range(m):
        loss = model(*inputs)
        loss.backward()
        ref_losses.append(loss.detach())
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = [compiled.stage(s) for s in range(pp)]
    torch.manual_seed(7)
    losses = run_local(stages, [batch] * m, schedule="sequential", prefetch=_prefetch(plan))
    where = f"{name} pp {pp}"
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses)), where
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.grad, ref[n])]
    assert not differ, f"{where}: gradients differ for {differ[:4]}"
    assert all(s.meter.live_bytes == 0 for s in stages), where


def _fast_link_hardware(pp: int, m: int):
    """This machine's figures, but copies on engines beside compute (as a GPU's): OPT offloads."""
    from lynx.planner.host_link import PCIE4_X16

    spec = lynx.CompileConfig(pp=pp, microbatches=m, hardware="cpu-local", target="cpu").hardware_spec()
    return spec.model_copy(update={"host_link": PCIE4_X16.model_copy(
        update={"alpha_s": 0.0, "d2h_bytes_per_s": 1e12, "h2d_bytes_per_s": 1e12})})


def _budget(pp: int, m: int) -> int:
    """20% of the way from full recomputation's peak to keeping everything's (OPT then both
    recomputes and offloads)."""
    from lynx.planner.loop import plan_graph

    graph = _analysis("gpt-tiny")[2].graph
    peaks = [max(sp.static_bytes + sp.activation_bytes for sp in plan_graph(graph, lynx.CompileConfig(
        pp=pp, microbatches=m, hardware="cpu-local", target="cpu", solver=s), check_budget=False).stages)
        for s in ("full", "none")]
    return int(peaks[0] + 0.2 * (peaks[1] - peaks[0]))


@pytest.mark.parametrize("solver", ["offload-all", "offload-modules", "opt"])
def test_measured_peak_is_the_plans(solver: str) -> None:
    from lynx.compiler import Compiled
    from lynx.planner.loop import plan_graph

    pp, m = 2, 4
    _model_, inputs, analysis = _analysis("gpt-tiny")
    budget = _budget(pp, m) if solver == "opt" else "1GiB"
    config = lynx.CompileConfig(pp=pp, microbatches=m, target="cpu", solver=solver, offload=True, time_limit_s=5,
                                hardware=_fast_link_hardware(pp, m), memory_budget=budget)
    plan = plan_graph(analysis.graph, config, check_budget=False)
    assert any(d.action == "offload" for d in plan.stage(0).decisions), f"{solver} offloads nothing"
    stages = [Compiled(plan=plan, config=config, analysis=analysis).stage(s) for s in range(pp)]
    batch = dict(zip(analysis.captured.input_names, inputs))
    run_local(stages, [batch] * m, schedule="1f1b", prefetch=_prefetch(plan))
    for s, stage in enumerate(stages):
        predicted, measured = plan.stage(s).activation_bytes, stage.meter.peak_by.get("stage", 0)
        assert abs(measured - predicted) <= 0.05 * predicted, \
            f"{solver} stage {s}: measured {measured} B, predicted {predicted} B"
        assert stage.meter.live_bytes == 0


def test_a_window_prefetch_reads_nothing_its_producer_regenerates() -> None:
    """Values offloaded and prefetched in a window, whose producers are recomputed on demand:
    the copy coming back re-runs nothing, so the producers are regenerated only when their own
    readers need them (the model once held them from the backward's start: 24% over the meter)."""
    from lynx.compiler import Compiled
    from lynx.planner.loop import plan_graph
    from lynx.planner.simulator import simulate

    pp, m = 2, 4
    _model_, inputs, analysis = _analysis("gpt-tiny")
    graph = analysis.graph
    config = lynx.CompileConfig(pp=pp, microbatches=m, target="cpu", solver="full", offload=True,
                                hardware=_fast_link_hardware(pp, m), memory_budget="1GiB")
    plan = plan_graph(graph, config, check_budget=False)
    first = plan.stages[0]
    action = {d.node: d.action for d in first.decisions}
    regenerated = [d.node for d in first.decisions if d.action == "recompute" and graph.nodes[d.node]["saved_bytes"]
                   and any(action.get(p) == "recompute" for p in graph.predecessors(d.node))]
    picked = set(regenerated[len(regenerated) // 5:][:8])
    windows = {j: f"s0.recv_grad.mb{j}" for j in range(m)}
    decisions = [Decision(node=d.node, action="offload", windows=windows) if d.node in picked else d
                 for d in first.decisions]
    plan = plan.model_copy(update={"stages": [first.model_copy(update={"decisions": decisions}), *plan.stages[1:]]})
    predicted = simulate(plan, graph).activation_bytes[0]
    stages = [Compiled(plan=plan, config=config, analysis=analysis).stage(s) for s in range(pp)]
    run_local(stages, [dict(zip(analysis.captured.input_names, inputs))] * m, schedule="1f1b",
              prefetch=_prefetch(plan))
    measured = stages[0].meter.peak_by.get("stage", 0)
    assert abs(measured - predicted) <= 0.05 * predicted, f"measured {measured} B, predicted {predicted} B"
