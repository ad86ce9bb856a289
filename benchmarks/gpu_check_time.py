"""Check 4 of ``gpu_check.py``: predicted vs measured time, and the stage's host overhead vs eager.

The shared GPT is planned as one stage (pp 1, one microbatch) twice: ``none`` (keep all) and
``full`` (Megatron full recompute, on demand). One training step of a plan's stage
(``compiled.stage(0)``: forward, backward) is timed against the eager module, interleaved,
warm-up excluded: ``step_s`` from a synchronised start to the end of the device's work (CUDA
events), ``host_s`` until the Python call returned (what the host spends issuing it).

Parts:

* ``<hardware>/none``, ``<hardware>/full``: the cost model's forward + backward (+ recompute)
  of the stage vs its measured ``step_s``, for the run's preset (``h200`` on CUDA) and, where
  ``lynx calibrate`` exists (``python -m lynx.calibrate``), for a file it measured on this
  device. Bar 25% (the design's bar for a calibrated prediction; a datasheet preset is held
  to it too, to see how far it is).
* ``stage_vs_eager``: ``step_s`` of the keep-all stage over eager's — bar 1.05 at these sizes
  (compute-bound on a GPU), and ``launch_bound``: the same at the tiny sizes on CUDA, bar
  1.25 (the design's bars for running a plan).
* ``host_ahead``: the stage's ``host_s`` below its ``step_s``: the host stays ahead of the
  device (else the GPU waits on Python).

Timings are judged on CUDA only; on the CPU the parts run and record their figures.

Example::

    >>> import torch
    >>> from gpu_check_common import SIZES, Env
    >>> env = Env(torch.device("cpu"), SIZES["tiny"], "cpu-local", calibrate="never")
    >>> result = check_time(env)
    >>> result.parts["cpu-local/none"].figure["measured_s"] > 0
    True
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from gpu_check_common import (SIZES, CheckResult, Env, Part, build_gpt, compiled_for, free_memory, judged, rel_diff,
                              shared_gpt, time_interleaved)

__all__ = ["check_time", "calibrated_hardware"]

PREDICTION_BAR = 0.25
COMPUTE_BOUND_BAR = 1.05
LAUNCH_BOUND_BAR = 1.25


def _step(stage: Any, batch: dict) -> Any:
    from lynx.runtime.step import backward_step, forward_step

    def run() -> None:
        flight = forward_step(stage, 0, batch, [])
        backward_step(stage, 0, flight, None)
        stage.release(0)

    return run


def _eager(model: torch.nn.Module, inputs: tuple) -> Any:
    def run() -> None:
        model(*inputs).backward()

    return run


def predicted_step_s(compiled: Any) -> float:
    """Forward + backward of every node (the cost model's), plus the plan's recomputation."""
    graph, sp = compiled.analysis.graph, compiled.plan.stage(0)
    compute = sum(graph.nodes[n]["forward_s"] + graph.nodes[n]["backward_s"] for n in graph)
    return compute + sp.exposed_recompute_s + sp.hidden_recompute_s


def calibrated_hardware(env: Env) -> tuple[str | None, str]:
    """A hardware file ``lynx calibrate`` measured on this device, or why there is none."""
    if env.calibrate == "never":
        return None, "not asked for (--calibrate never)"
    if importlib.util.find_spec("lynx.calibrate") is None:
        return None, "lynx calibrate does not exist in this checkout (issue 13)"
    path = Path(env.workdir) / "calibrated.json"
    cmd = [sys.executable, "-m", "lynx.calibrate", "--output", str(path), "--repeats", "3",
           "--device", env.device.type]
    root = str(Path(__file__).resolve().parents[1])  # this checkout's lynx, installed or not
    env_vars = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env_vars)
    if done.returncode != 0 or not path.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return None, f"`{' '.join(cmd[1:])}` failed (exit {done.returncode}): {' | '.join(tail)}"
    return str(path), f"measured by `python -m lynx.calibrate --device {env.device.type}`"


def _prediction_parts(env: Env, label: str, compiled: dict[str, Any], measured: dict[str, dict]) -> dict[str, Part]:
    parts = {}
    for solver, c in compiled.items():
        predicted, got = predicted_step_s(c), measured[solver]["step_s"]
        diff = rel_diff(predicted, got)
        figure = {"predicted_s": predicted, "measured_s": got, "rel_diff": diff,
                  "plan_step_time_s": c.plan.predicted.step_time_s}
        text = f"predicted {predicted * 1e3:.3f} ms vs measured {got * 1e3:.3f} ms ({diff:+.1%})"
        if env.cuda:
            parts[f"{label}/{solver}"] = Part(figure, judged(abs(diff) <= PREDICTION_BAR),
                                              f"{text}; bar ±{PREDICTION_BAR:.0%}")
        else:
            parts[f"{label}/{solver}"] = Part(figure, "skipped", f"{text}; timings are judged on CUDA only")
    return parts


def _launch_bound(env: Env) -> Part:
    """Stage vs eager at the tiny sizes on this device: where launching, not computing, is the cost."""
    tiny = SIZES["tiny"]
    model, inputs = build_gpt(tiny, dtype="float32", attention="math", device=env.device)
    compiled = compiled_for(model, inputs, env, pp=1, microbatches=1, solver="none")
    batch = dict(zip(compiled.analysis.captured.input_names, inputs))
    times = time_interleaved({"eager": _eager(model, inputs), "none": _step(compiled.stage(0), batch)}, env.device,
                             repeats=max(20, env.sizes.repeats), warmup=3)
    ratio = times["none"]["step_s"] / times["eager"]["step_s"]
    return Part({"ratio": ratio, **{f"{k}_{q}": v[q] for k, v in times.items() for q in ("step_s", "host_s")}},
                judged(ratio <= LAUNCH_BOUND_BAR), f"tiny GPT step {ratio:.3f}x eager's (bar {LAUNCH_BOUND_BAR})")


def check_time(env: Env) -> CheckResult:
    model, inputs, keep = shared_gpt(env)
    batch = dict(zip(keep.analysis.captured.input_names, inputs))
    plans = {s: compiled_for(model, inputs, env, pp=1, microbatches=1, solver=s, analysis=keep.analysis)
             for s in ("none", "full")}
    steps = {"eager": _eager(model, inputs), **{s: _step(c.stage(0), batch) for s, c in plans.items()}}
    times = time_interleaved(steps, env.device, repeats=env.sizes.repeats, warmup=env.sizes.warmup)
    model.zero_grad(set_to_none=True)
    parts = _prediction_parts(env, env.hardware, plans, times)

    path, how = calibrated_hardware(env)
    if path is None:
        parts["calibrated"] = Part({}, "skipped", how)
    else:
        first = compiled_for(model, inputs, env, pp=1, microbatches=1, solver="none", hardware=path)
        calibrated = {"none": first, "full": compiled_for(model, inputs, env, pp=1, microbatches=1, solver="full",
                                                          hardware=path, analysis=first.analysis)}
        measured_hw = {k: v for k, v in json.loads(Path(path).read_text()).items()
                       if k in ("peak_flops", "achievable_fraction", "memory_bandwidth", "op_overhead_s")}
        for name, part in _prediction_parts(env, "calibrated", calibrated, times).items():
            part.reason += f" ({how})"
            part.figure["hardware"] = measured_hw
            parts[name] = part

    ratio = times["none"]["step_s"] / times["eager"]["step_s"]
    host = {k: {"step_s": v["step_s"], "host_s": v["host_s"]} for k, v in times.items()}
    ahead = times["none"]["host_s"] / times["none"]["step_s"]
    eager_busy = times["eager"]["host_s"] / times["eager"]["step_s"]  # near 1: launch-bound even eagerly
    text = (f"stage step {ratio:.3f}x eager's; host {times['none']['host_s'] * 1e3:.2f} ms (eager "
            f"{times['eager']['host_s'] * 1e3:.2f} ms, {eager_busy:.0%} of its step) for a "
            f"{times['none']['step_s'] * 1e3:.2f} ms step")
    if env.cuda:
        parts["stage_vs_eager"] = Part({"ratio": ratio, **host}, judged(ratio <= COMPUTE_BOUND_BAR),
                                       f"{text}; bar {COMPUTE_BOUND_BAR}")
        parts["host_ahead"] = Part({"host_over_step": ahead,
                                    "host_stage_over_eager": times["none"]["host_s"] / times["eager"]["host_s"]},
                                   judged(ahead < 1.0), f"the host spends {ahead:.0%} of the step issuing it")
        parts["launch_bound"] = _launch_bound(env)
    else:
        parts["stage_vs_eager"] = Part({"ratio": ratio, **host}, "skipped", f"{text}; timings are judged on CUDA only")
    del model, inputs, keep, plans, steps
    free_memory(env.device)
    figure = {"stage_vs_eager": ratio,
              **{f"{n}_rel_diff": p.figure["rel_diff"] for n, p in parts.items() if "rel_diff" in p.figure}}
    reason = "; ".join(f"{n}: {p.reason}" for n, p in parts.items())
    return CheckResult(figure, reason, parts)
