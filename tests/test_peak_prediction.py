"""The plan's predicted peak saved-activation bytes per stage is what the runtime measures.

Every solver's and baseline's plan for the tiny GPT (dropout on) runs through the
single-process executor (1F1B and GPipe, pp 1 and 2, 4 microbatches, budgets that force
recomputation); the peak of the stage's saved bytes the hooks count must be at most the
prediction (``lynx.solvers.memory.peak_activation_bytes``) and at least 95% of it, and within
the activation budget whenever the plan says it fits.

The meter counts what is resident for backward, as the plan does: the saved tensors of kept
nodes, what recomputation brings back (what the re-run op saves and, when a consumer saved
the dropped node's output, that output), and the values the stage sends, held until the
microbatch's backward (a later stage saves them; the plan counts them on the producer). So
each stage's own meter (``peak_by["stage"]``, what the distributed runtime reports) is
compared with its prediction, with no correction.

Example (what one case checks)::

    pytest tests/test_peak_prediction.py -k "pp2-1f1b and opt"
"""

from __future__ import annotations

import functools

import pytest
import torch

import lynx
from lynx.rewrite import StageModule, build_stage_module, split_graph
from lynx.testing import run_local

SOLVERS = ["none", "full", "selective", "checkmate", "heu", "opt"]
M = 4
CONFIGS = {  # name: (pp, schedule, memory budget) — each below `none`'s peak
    "pp1-1f1b": (1, "1f1b", "4.1MiB"),
    "pp2-1f1b": (2, "1f1b", "2.3MiB"),
    "pp2-gpipe": (2, "gpipe", "2.6MiB"),
}


@functools.lru_cache(maxsize=1)
def _analysis():
    """gpt-tiny analysed once for every configuration (an analysis does not depend on pp)."""
    torch.manual_seed(0)
    model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu", dropout=0.1)
    hardware = lynx.CompileConfig(microbatches=M, hardware="cpu-local", target="cpu").hardware_spec()
    return model, inputs, lynx.analyze(model, inputs, target="cpu", hardware=hardware)


def _compiled(config_name: str, solver: str):
    from lynx.compiler import Compiled
    from lynx.planner.loop import plan_graph

    pp, schedule, budget = CONFIGS[config_name]
    model, inputs, analysis = _analysis()
    config = lynx.CompileConfig(pp=pp, microbatches=M, schedule=schedule, memory_budget=budget, hardware="cpu-local",
                                target="cpu", time_limit_s=5, solver=solver)
    return inputs, Compiled(plan=plan_graph(analysis.graph, config, check_budget=False), config=config,
                            analysis=analysis)


def _run(compiled, inputs, schedule: str) -> list:
    """Run ``compiled``'s plan on ``inputs`` (M microbatches) in one process; the stage modules."""
    plan = compiled.plan
    pp = len(plan.stages)
    batch = dict(zip(compiled.analysis.captured.input_names, inputs))
    stages = [build_stage_module(compiled, s) for s in range(pp)]
    schedules = [plan.stage_schedule(s) for s in range(pp)]
    run_local(stages, [batch] * M, schedule=schedule,
              prefetch=lambda s, j: [nodes for _wid, nodes in schedules[s].prefetch.get(j, [])])
    return stages


def _check(plan, stages, where: str) -> None:
    for s, stage in enumerate(stages):
        sp = plan.stage(s)
        predicted, measured = sp.activation_bytes, stage.meter.peak_by.get("stage", 0)
        at = f"{where} stage {s}: measured {measured} B, predicted {predicted} B"
        assert measured <= predicted, at
        assert measured >= 0.95 * predicted, at
        if plan.predicted.fits_budget:
            assert measured <= sp.budget_bytes - sp.static_bytes, at


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_measured_peak_matches_prediction(config_name: str, solver: str) -> None:
    inputs, compiled = _compiled(config_name, solver)
    _check(compiled.plan, _run(compiled, inputs, CONFIGS[config_name][1]), f"{config_name} {solver}")


def test_cases_cover_window_and_on_demand_recompute() -> None:
    """The cases above include plans that prefetch in windows and recompute on demand, per stage."""
    kinds = set()
    for config_name in CONFIGS:
        for solver in ("heu", "opt"):
            plan = _compiled(config_name, solver)[1].plan
            for s in range(len(plan.stages)):
                schedule = plan.stage_schedule(s)
                windowed = {n for j in range(M) for _w, nodes in schedule.prefetch.get(j, []) for n in nodes}
                kinds.add(("window", bool(windowed)))
                kinds.add(("on-demand", bool(schedule.dropped - windowed)))
    assert ("window", True) in kinds and ("on-demand", True) in kinds, kinds


def test_train_gpt_default_plan() -> None:
    """``examples/train_gpt.py``'s defaults: seq 64 x 8, pp 2, 12 MiB, DeMo, HEU on cpu-local."""
    torch.manual_seed(0)
    resolved = lynx.models.resolve_model("gpt-tiny", seq=64, microbatch=8, device="cpu")
    compiled = lynx.compile(resolved.model, resolved.example_inputs, pp=2, microbatches=M, memory_budget="12MiB",
                            optimizer="demo", hardware="cpu-local", solver="heu")
    assert compiled.plan.predicted.fits_budget
    _check(compiled.plan, _run(compiled, resolved.example_inputs, "1f1b"), "train_gpt defaults")


def test_meter_counts_a_recomputed_output_a_kept_consumer_saved() -> None:
    """GELU (kept) saves the linear's output; dropping the linear brings that output back."""
    gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()),
                             (torch.randn(8, 64),), strict=False).module()
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    stage = StageModule(split_graph(gm, [ops])[0], dropped={"linear"})
    stage(torch.randn(8, 64), microbatch=0).sum().backward()
    assert stage.stats(0).on_demand_nodes == 1
    assert stage.meter.peak_by.get("stage") == 8 * 64 * 4   # the regenerated linear output


def test_meter_counts_a_sliced_microbatch_by_its_own_bytes() -> None:
    """A microbatch handed over as a slice of the step's batch counts its own bytes, not the
    batch's storage (the distributed runtime's microbatches are such slices)."""
    gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()),
                             (torch.randn(8, 64),), strict=False).module()
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    peaks = []
    for x in (torch.randn(8, 64), torch.randn(32, 64)[8:16]):   # (8, 64) alone, or in a (32, 64) batch
        stage = StageModule(split_graph(gm, [ops])[0])
        stage(x, microbatch=0).sum().backward()
        peaks.append(stage.meter.peak_by.get("stage"))
    assert peaks[0] == peaks[1] == 2 * 8 * 64 * 4   # the saved input and the linear's output
