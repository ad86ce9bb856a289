"""The simulated step ends each device's step with its optimizer step (``PipelineCosts.optimizer_s``),
after its last gradient and data-parallel exchange; ``build_pipeline`` fills it from the
hardware (``lynx.planner.cost.optimizer_step_s`` over the device's parameters)."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.planner.cost import optimizer_step_s
from lynx.planner.hardware import get_hardware
from lynx.planner.comm import CommModel
from lynx.units import dtype_bytes
from lynx.planner.problems import build_pipeline
from lynx.planner.synthetic import synthetic_graph
from lynx.planner.timeline import PipelineCosts, run_timeline


def test_optimizer_step_closes_every_device_step() -> None:
    base = PipelineCosts.uniform(pp=2, microbatches=4, forward_s=1.0, backward_s=2.0)
    with_opt = dataclasses.replace(base, optimizer_s=(0.5, 0.25))
    t0, t1 = run_timeline(base), run_timeline(with_opt)
    assert t1.device_end_s == pytest.approx([t0.device_end_s[0] + 0.5, t0.device_end_s[1] + 0.25])
    assert t1.step_time_s == pytest.approx(max(t1.device_end_s))
    assert t1.busy_s == pytest.approx([t0.busy_s[0] + 0.5, t0.busy_s[1] + 0.25])
    opt = [s for s in t1.segments if s.kind == "optimizer"]
    assert [(s.device, s.end - s.start) for s in opt] == [(0, pytest.approx(0.5)), (1, pytest.approx(0.25))]
    assert [w.id for w in t1.windows] == [w.id for w in t0.windows]   # no window moves


@pytest.mark.parametrize("optimizer", ["adamw", "demo", "lion"])
def test_build_pipeline_fills_the_optimizer_step_from_the_hardware(optimizer: str) -> None:
    g = synthetic_graph(layers=4)
    hw = get_hardware("cpu-local")
    pipe = build_pipeline(g, pp=2, microbatches=4, optimizer=optimizer, hardware=hw)
    size = dtype_bytes(g.graph.get("dims", {}).get("dtype"))
    for s in range(2):
        params = sum(pipe.costs[b].param_bytes for c in pipe.device_chunks(s) for b in c.blocks) // size
        assert params > 0
        assert pipe.optimizer_s[s] == pytest.approx(optimizer_step_s(params, optimizer, hw))
        assert pipe.optimizer_s[s] > 0
    assert build_pipeline(g, pp=2, microbatches=4, optimizer=optimizer, hardware=get_hardware("h100-sxm")).optimizer_s \
        == (0.0, 0.0)
    assert build_pipeline(g, pp=2, microbatches=4, comm=CommModel.free()).optimizer_s == ()
