"""Every solver's and baseline's plan runs: bitwise gradients, measured peak within 5% of the plan."""

from __future__ import annotations

import functools

import pytest
import torch

import lynx
from lynx.rewrite import build_stage_module
from lynx.runtime.local import run_local

SOLVERS = ["none", "full", "selective", "checkmate", "heu", "opt"]
M = 4


@functools.lru_cache(maxsize=None)
def _compiled(solver: str):
    torch.manual_seed(0)
    model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu", dropout=0.1)
    try:
        compiled = lynx.compile(model, inputs, pp=2, microbatches=M, solver=solver, memory_budget="2.6MiB",
                                hardware="cpu-local", target="cpu", time_limit_s=5)
    except ImportError as err:  # the solver is not in this checkout yet
        pytest.skip(f"solver {solver!r} unavailable: {err}")
    return model, inputs, compiled


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
def test_measured_peak_matches_plan(solver: str) -> None:
    model, inputs, compiled = _compiled(solver)
    plan = compiled.plan
    batch = dict(zip(compiled.analysis.captured.input_names, inputs))
    stages = [build_stage_module(compiled, i) for i in range(2)]
    run_local(stages, [batch] * M, schedule="1f1b", prefetch=_prefetch(plan))
    for s, stage in enumerate(stages):
        sp = plan.stage(s)
        measured = stage.meter.peak_by.get("stage", 0)
        predicted = sp.activation_bytes
        assert abs(measured - predicted) <= 0.05 * predicted, (
            f"{solver} stage {s}: measured {measured} B vs predicted {predicted} B")
        if solver != "none" and plan.predicted.fits_budget:
            assert stage.meter.peak_bytes <= sp.budget_bytes - sp.static_bytes
