"""Every solver's and baseline's plan runs: bitwise gradients, measured peak within 5% of the plan."""

from __future__ import annotations

import functools

import pytest
import torch

import lynx
from lynx.rewrite import build_stage_module
from lynx.testing import run_local

SOLVERS = ["none", "full", "selective", "checkmate", "heu", "opt"]
M = 4


@functools.lru_cache(maxsize=1)
def _analysis():
    torch.manual_seed(0)
    model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu", dropout=0.1)
    config = lynx.CompileConfig(pp=2, microbatches=M, memory_budget="2.3MiB", hardware="cpu-local", target="cpu",
                                time_limit_s=5)
    analysis = lynx.analyze(model, inputs, target="cpu", hardware=config.hardware_spec())
    return model, inputs, config, analysis


@functools.lru_cache(maxsize=None)
def _compiled(solver: str):
    """lynx.compile(..., solver=solver), sharing one analysis of the model across solvers."""
    from lynx.compiler import Compiled
    from lynx.planner.loop import plan_graph

    model, inputs, base, analysis = _analysis()
    config = base.model_copy(update={"solver": solver})
    return model, inputs, Compiled(plan=plan_graph(analysis.graph, config), config=config, analysis=analysis)


def _prefetch(plan):
    schedules = [plan.stage_schedule(s) for s in range(len(plan.stages))]

    def prefetch(s: int, j: int) -> list[list[str]]:
        return [nodes for _wid, nodes in schedules[s].prefetch.get(j, [])]

    return prefetch


@pytest.mark.parametrize("solver", SOLVERS)
def test_plan_gradients_bitwise(solver: str) -> None:
    model, inputs, compiled = _compiled(solver)
    batch = dict(zip(compiled.analysis.captured.input_names, inputs))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    ref_losses = []
    for _ in range(2):
        loss = model(*inputs)
        loss.backward()
        ref_losses.append(loss.detach())
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = [compiled.stage(i) for i in range(2)]
    torch.manual_seed(5)
    losses = run_local(stages, [batch] * 2, schedule="sequential", prefetch=_prefetch(compiled.plan))
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.grad, ref[n])]
    assert not differ, f"{solver}: gradients differ for {differ[:4]}"


@pytest.mark.parametrize("solver", SOLVERS)
def test_measured_memory_matches_plan(solver: str) -> None:
    model, inputs, compiled = _compiled(solver)
    plan, G = compiled.plan, compiled.analysis.graph
    batch = dict(zip(compiled.analysis.captured.input_names, inputs))
    # (a) what one microbatch keeps after its forward is what the plan keeps (per-node saved bytes).
    # A value sent to the next stage and saved there is the producer's in the profile; the
    # producing stage's meter counts what it sends (held until the backward, kept or dropped),
    # as the plan does (lynx.solvers.memory.is_sent).
    stages = [build_stage_module(compiled, i) for i in range(2)]
    outputs = [()]  # every stage's outputs stay referenced, as the runtime's in-flight record does
    for stage in stages:
        outputs.append(stage(*[batch[n] for n in stage.spec.inputs],
                             *[v.detach().requires_grad_(v.requires_grad) for v in outputs[-1]], microbatch=0))
    for s, stage in enumerate(stages):
        names = {d.node for d in plan.stage(s).decisions}
        sent = {n for n in names if G.nodes[n].get("output_saved")
                and not set(G.nodes[n].get("output_saved_by", ())) & names}   # saved only by a later stage
        kept = {d.node for d in plan.stage(s).decisions if d.action == "keep"} | sent
        planned = sum(G.nodes[n]["saved_bytes"] for n in kept)
        held = stage.meter.live_by.get("stage", 0)
        assert abs(held - planned) <= 0.05 * planned, f"{solver} stage {s}: keeps {held} B, plan {planned} B"
    # (b) the peak over a 1F1B step never exceeds the plan's prediction (its upper bound) nor the budget
    stages = [build_stage_module(compiled, i) for i in range(2)]
    run_local(stages, [batch] * M, schedule="1f1b", prefetch=_prefetch(plan))
    for s, stage in enumerate(stages):
        sp = plan.stage(s)
        measured = stage.meter.peak_by.get("stage", 0)
        assert measured <= 1.05 * sp.activation_bytes, f"{solver} stage {s}: {measured} B > {sp.activation_bytes} B"
        if not any(d.action == "recompute" for d in sp.decisions):  # exact when nothing is regenerated
            assert measured >= 0.95 * sp.activation_bytes
        if sp.activation_bytes <= sp.budget_bytes - sp.static_bytes:
            assert stage.meter.peak_bytes <= sp.budget_bytes - sp.static_bytes


def test_plan_for_another_model_is_refused_before_running() -> None:
    _, _, compiled = _compiled("full")
    other, other_inputs = lynx.models.build_preset("gpt-tiny", device="cpu", dropout=0.0)
    with pytest.raises(lynx.LynxFingerprintError, match="does not match this model"):
        lynx.compile(other, other_inputs, compiled.config.replace(plan=compiled.plan))
