"""The plan's predicted peak saved-activation bytes per stage is what the runtime measures.

Every solver's and baseline's plan for the tiny GPT (dropout on) runs through the
single-process executor (1F1B and GPipe, pp 1 and 2, 4 microbatches, budgets that force
recomputation); the peak of the stage's saved bytes the hooks count must be at most the
prediction (``lynx.solvers.memory.peak_activation_bytes``) and at least 95% of it, and within
the activation budget whenever the plan says it fits.

Two accounting details make the meter comparable with the plan:

* A value sent to the next stage and saved there belongs to its producer in the profile
  (and in the plan); the receiving stage's meter files it as ``boundary:<producer>``, so it
  is added back to the producing stage, at each instant (one process: one clock).
* The meter registers recomputed saved tensors as the recomputed op saves them; the output
  of a dropped node that a *kept* consumer saved (a view handle) is resident as well, so the
  test registers it too (:func:`_count_viewed_outputs`; a no-op once the stage module does).

Example (what one case checks)::

    pytest tests/test_peak_prediction.py -k "pp2-1f1b and opt"
"""

from __future__ import annotations

import functools

import pytest
import torch

import lynx
from lynx.rewrite import build_stage_module
from lynx.rewrite.saved import storage_key, tensor_leaves
from lynx.runtime.local import run_local

SOLVERS = ["none", "full", "selective", "checkmate", "heu", "opt"]
M = 4
CONFIGS = {  # name: (pp, schedule, memory budget) — each below `none`'s peak
    "pp1-1f1b": (1, "1f1b", "4.1MiB"),
    "pp2-1f1b": (2, "1f1b", "2.3MiB"),
    "pp2-gpipe": (2, "gpipe", "2.6MiB"),
}


@functools.lru_cache(maxsize=None)
def _analysis(pp: int):
    torch.manual_seed(0)
    model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu", dropout=0.1)
    hardware = lynx.CompileConfig(pp=pp, microbatches=M, hardware="cpu-local", target="cpu").hardware_spec()
    return model, inputs, lynx.analyze(model, inputs, target="cpu", hardware=hardware)


def _compiled(config_name: str, solver: str):
    from lynx.compile import Compiled, plan_graph

    pp, schedule, budget = CONFIGS[config_name]
    model, inputs, analysis = _analysis(pp)
    config = lynx.CompileConfig(pp=pp, microbatches=M, schedule=schedule, memory_budget=budget, hardware="cpu-local",
                                target="cpu", time_limit_s=5, solver=solver)
    return inputs, Compiled(plan=plan_graph(analysis.graph, config, check_budget=False), config=config,
                            analysis=analysis)


def _count_viewed_outputs(stage) -> None:
    """Register a recomputed node's output in the meter when a dropped saved tensor views it."""
    pack, recompute = stage._pack, stage._recompute_node
    viewed: set[tuple[int, str]] = set()

    def _pack(state, microbatch, t):
        handle = pack(state, microbatch, t)
        if getattr(handle, "kind", None) == "view":
            viewed.add((id(state), handle.node))
        return handle

    def _recompute_node(state, name):
        count = recompute(state, name)
        if (id(state), name) in viewed and name in state.outputs:
            for t in tensor_leaves(state.outputs[name]):
                if storage_key(t) not in stage._constant_keys:
                    stage.meter.add(t, "stage")
        return count

    stage._pack, stage._recompute_node = _pack, _recompute_node


def _measure(stages, owner_stage: dict[str, int]) -> list[int]:
    """Peak per stage of its own saved bytes plus what later stages save of its values."""
    peaks = [0] * len(stages)

    def update() -> None:
        live = [stage.meter.live_by.get("stage", 0) for stage in stages]
        for stage in stages:
            for category, nbytes in stage.meter.live_by.items():
                if category.startswith("boundary:"):
                    producer = owner_stage.get(category.split(":", 1)[1])
                    if producer is not None:
                        live[producer] += nbytes
        for s, nbytes in enumerate(live):
            peaks[s] = max(peaks[s], nbytes)

    for stage in stages:
        meter = stage.meter
        add, drop = meter.add, meter._drop

        def _add(t, category, add=add):
            add(t, category)
            update()

        def _drop(key, ref, drop=drop):
            drop(key, ref)
            update()

        meter.add, meter._drop = _add, _drop
    return peaks


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_measured_peak_matches_prediction(config_name: str, solver: str) -> None:
    inputs, compiled = _compiled(config_name, solver)
    plan = compiled.plan
    pp, schedule, _ = CONFIGS[config_name]
    batch = dict(zip(compiled.analysis.captured.input_names, inputs))
    owner_stage = {d.node: s for s in range(pp) for d in plan.stage(s).decisions}
    stages = [build_stage_module(compiled, s) for s in range(pp)]
    for stage in stages:
        _count_viewed_outputs(stage)
    peaks = _measure(stages, owner_stage)
    schedules = [plan.stage_schedule(s) for s in range(pp)]
    run_local(stages, [batch] * M, schedule=schedule,
              prefetch=lambda s, j: [nodes for _wid, nodes in schedules[s].prefetch.get(j, [])])
    for s in range(pp):
        sp = plan.stage(s)
        predicted, measured = sp.activation_bytes, peaks[s]
        where = f"{config_name} {solver} stage {s}: measured {measured} B, predicted {predicted} B"
        assert measured <= predicted, where
        assert measured >= 0.95 * predicted, where
        if plan.predicted.fits_budget:
            assert measured <= sp.budget_bytes - sp.static_bytes, where
