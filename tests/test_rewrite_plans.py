"""Every solver's and baseline's plan, lowered to compiled stages, gives the un-rewritten model's
gradients bitwise: llama-tiny and a ``transformers`` GPT-2 built from a config (dropout on),
1 and 2 stages (gpt-tiny's plans: ``tests/runtime/test_runtime_plans.py``).

The budget sits 40% of the way from full recomputation's memory to none's (as
``lynx.solvers`` benchmarks do), so the solvers drop a real mix of nodes; even microbatches
run the plan's windows before backward, odd ones recompute everything on demand.
"""

from __future__ import annotations

import functools

import pytest
import torch

import lynx
from lynx.testing import run_local

SOLVERS = ["none", "full", "selective", "checkmate", "heu", "opt"]
M = 2


@functools.lru_cache(maxsize=None)
def _analysis(name: str):
    """The model analysed once for both pipeline depths (an analysis does not depend on pp)."""
    from test_rewrite import _model  # pytest puts tests/ on sys.path (no package)

    model, inputs = _model(name)
    model.train()
    hardware = lynx.CompileConfig(microbatches=M, hardware="cpu-local", target="cpu").hardware_spec()
    return model, inputs, lynx.analyze(model, inputs, target="cpu", hardware=hardware)


def _plan(name: str, pp: int, solver: str):
    from lynx.compiler import Compiled
    from lynx.planner.loop import plan_graph

    model, inputs, analysis = _analysis(name)

    def config(s: str, budget: int | None = None):
        return lynx.CompileConfig(pp=pp, microbatches=M, hardware="cpu-local", target="cpu", time_limit_s=2,
                                  solver=s, memory_budget=budget)

    peaks = {}
    for baseline in ("none", "full"):
        plan = plan_graph(analysis.graph, config(baseline), check_budget=False)
        peaks[baseline] = max(sp.static_bytes + sp.activation_bytes for sp in plan.stages)
    budget = int(peaks["full"] + 0.4 * (peaks["none"] - peaks["full"]))
    cfg = config(solver, budget)
    return model, inputs, Compiled(plan=plan_graph(analysis.graph, cfg, check_budget=False), config=cfg,
                                   analysis=analysis)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-hf"])
def test_every_plan_gives_bitwise_gradients(name: str, pp: int) -> None:
    dropped_somewhere = 0
    for solver in SOLVERS:
        model, inputs, compiled = _plan(name, pp, solver)
        batch = dict(zip(compiled.analysis.captured.input_names, inputs))
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        ref_losses = []
        for _ in range(M):
            loss = model(*inputs)
            loss.backward()
            ref_losses.append(loss.detach())
        ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        stages = [compiled.stage(i) for i in range(pp)]
        schedules = [compiled.plan.stage_schedule(s) for s in range(pp)]
        dropped_somewhere += sum(len(s.dropped) for s in schedules)

        def prefetch(s: int, j: int) -> list[list[str]]:
            return [nodes for _wid, nodes in schedules[s].prefetch.get(j, [])] if j % 2 == 0 else []

        torch.manual_seed(7)
        losses = run_local(stages, [batch] * M, schedule="sequential", prefetch=prefetch)
        where = f"{name} pp {pp} {solver}"
        assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses)), where
        differ = [n for n, p in model.named_parameters() if not torch.equal(p.grad, ref[n])]
        assert not differ, f"{where}: gradients differ for {differ[:4]}"
        for s, stage in enumerate(stages):  # never above the plan (equality: test_peak_prediction.py)
            measured, predicted = stage.meter.peak_by.get("stage", 0), compiled.plan.stage(s).activation_bytes
            assert measured <= predicted, f"{where} stage {s}: measured {measured} B, predicted {predicted} B"
    assert dropped_somewhere > 0
