"""Check 7 of ``gpu_check.py``: offload on the device — gradients, memory, copy overlap, step time.

The shared GPT planned for 2 stages, 1F1B, with offload (``offload=True``) by PipeOffload's
policy (``offload-all``: every activation stage 0 can copy to host memory, prefetched in the
plan's windows or when the backward reaches it) and, for reference, keep-all (``none``). Stage
0 runs alone in its 1F1B order (it holds 2 microbatches at once), the gradients of what it
sends fixed random tensors, each backward preceded by the prefetches the plan puts in its
windows, as the runtime's ``R`` actions issue them.

Parts:

* ``gradients`` (any device): the offloading stage's parameter gradients vs the keep-all
  stage's, bitwise (the same kernels in the same order; copies move bytes).
* ``meter_vs_plan`` (any device): the stage's meter peak vs the plan's ``activation_bytes``,
  within 5%.
* ``copy_overlap`` (CUDA): one step of the offloading stage (``a``), of the keep-all stage
  (``b``), and the same copies alone on the stage's copy stream (``c``: every offloaded byte
  device→host then host→device, pinned, CUDA events); the share of copy time hidden behind
  compute, ``1 − (a − b) / c`` — bar 50% (copy engines beside compute are the point of offload).
* ``step_vs_plan`` (CUDA): ``a − b``, the step time offload added, vs what the plan's
  timeline says stage 0's backwards waited on prefetches (``exposed_copy_s``) — within 25% of
  the keep-all step (the time check's bar for a prediction). Stage 0 alone has no pipeline
  waits to hide copies in, so this compares the copies' exposed cost, not the pipeline's.

On the CPU the copies are synchronous (the same code path: separate host buffers); the timing
parts are skipped and say so. No device was lent when this check was written: its CUDA parts
have not run yet (``docs/gpu.md``).

Example::

    >>> import torch
    >>> from gpu_check_common import SIZES, Env
    >>> result = check_offload(Env(torch.device("cpu"), SIZES["tiny"], "cpu-local"))
    >>> result.parts["offload-all/gradients"].verdict, result.parts["offload-all/meter_vs_plan"].verdict
    ('pass', 'pass')
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_check_common import (CheckResult, Env, Part, compiled_for, free_memory, judged, rel_diff, sent_grads,
                              shared_gpt, sync, time_interleaved)

__all__ = ["check_offload", "copy_seconds_alone", "prefetch_beside_copy_out"]

OVERLAP_BAR = 0.5
PLAN_BAR = 0.25
MEMORY_BAR = 0.05
PP = 2


def _one_step(stage: Any, plan: Any, batch: dict, grads: list) -> None:
    """Stage 0's actions in 1F1B order, alone: forwards, and backwards after the plan's windows
    (recomputation and offload prefetches) for that microbatch."""
    from lynx.planner.schedule import stage_actions
    from lynx.runtime.step import backward_step, forward_step

    schedule = plan.stage_schedule(0)
    flights: dict[int, Any] = {}
    for action in stage_actions("1f1b", stage=0, stages=len(plan.stages), microbatches=plan.microbatches):
        j = action.microbatch
        if action.kind == "F":
            flights[j] = forward_step(stage, j, batch, [])
            continue
        for _w, nodes in schedule.prefetch.get(j, []):
            stage.recompute(j, nodes)
        for _w, nodes in schedule.offload_prefetch.get(j, []):
            stage.prefetch(j, nodes)
        backward_step(stage, j, flights.pop(j), grads)
        stage.release(j)


def _grads_of(stage: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in stage.named_parameters() if p.grad is not None}


def copy_seconds_alone(nbytes: int, device: torch.device, repeats: int = 3) -> float:
    """Median seconds to copy ``nbytes`` device→host then host→device, pinned, on a side stream
    (CUDA events), nothing else running."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(src)
    stream = torch.cuda.Stream(device)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            host.copy_(src, non_blocking=True)
            back.copy_(host, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times[1:])[len(times[1:]) // 2]


def check_offload(env: Env) -> CheckResult:
    model, inputs, keep = shared_gpt(env)
    batch = dict(zip(keep.analysis.captured.input_names, inputs))
    offload = compiled_for(model, inputs, env, pp=PP, microbatches=env.sizes.microbatches, solver="offload-all",
                           offload=True, memory_budget=2**50, analysis=keep.analysis)
    plan, sp = offload.plan, offload.plan.stage(0)
    name = "offload-all"
    moved = sum(d.action == "offload" for d in sp.decisions)
    figure: dict[str, Any] = {"model": f"math attention, {env.sizes.dtypes[0]}, pp {PP}, 1f1b, "
                                       f"{env.sizes.microbatches} microbatches, stage 0",
                              "offloaded_nodes": moved, "offloaded_bytes_per_microbatch": sp.offloaded_bytes}
    parts: dict[str, Part] = {}
    if not moved:
        parts[f"{name}/gradients"] = Part({}, "fail", "the offload-all plan offloads nothing on stage 0")
        return CheckResult(figure, "nothing offloaded", parts)
    stages = {"keep": keep.stage(0), "offload": offload.stage(0)}
    grads = sent_grads(stages["keep"], batch, env.device)
    got = {}
    for kind, stage in stages.items():
        stage.zero_grad(set_to_none=True)
        stage.meter.reset_peak()
        torch.manual_seed(3)   # the same dropout masks in both runs
        _one_step(stage, (keep if kind == "keep" else offload).plan, batch, grads)
        sync(env.device)
        got[kind] = _grads_of(stage)
    differ = [n for n in got["keep"] if not torch.equal(got["keep"][n], got["offload"].get(n))]
    parts[f"{name}/gradients"] = Part({"parameters": len(got["keep"]), "differing": len(differ)},
                                      judged(not differ and set(got["keep"]) == set(got["offload"])),
                                      "bitwise equal to the keep-all stage" if not differ
                                      else f"{len(differ)} parameters differ, e.g. {differ[:3]}")
    predicted, meter = sp.activation_bytes, stages["offload"].meter.peak_by.get("stage", 0)
    diff = rel_diff(meter, predicted)
    parts[f"{name}/meter_vs_plan"] = Part({"predicted_bytes": predicted, "meter_bytes": meter, "rel_diff": diff,
                                          "keep_all_meter_bytes": stages["keep"].meter.peak_by.get("stage", 0)},
                                         judged(abs(diff) <= MEMORY_BAR),
                                         f"meter {diff:+.2%} vs the plan (bar ±{MEMORY_BAR:.0%})")
    if not env.cuda:
        skip = "copy engines beside compute need CUDA (on the CPU copies are synchronous)"
        parts[f"{name}/copy_overlap"] = Part({}, "skipped", skip)
        parts[f"{name}/step_vs_plan"] = Part({}, "skipped", skip)
        parts[f"{name}/prefetch_beside_copy_out"] = Part({}, "skipped", skip)
    else:
        parts.update(_timed(env, name, stages, plan, keep.plan, batch, grads, sp.offloaded_bytes))
        parts[f"{name}/prefetch_beside_copy_out"] = prefetch_beside_copy_out(env.device)
        figure.update({k: v for p in parts.values() for k, v in p.figure.items() if k.endswith("_s")})
    del stages, model, inputs
    free_memory(env.device)
    reason = "; ".join(f"{n}: {p.reason}" for n, p in parts.items())
    return CheckResult(figure, reason, parts)


def _timed(env: Env, name: str, stages: dict, plan: Any, keep_plan: Any, batch: dict, grads: list,
           per_microbatch: int) -> dict[str, Part]:
    timed = time_interleaved(
        {kind: (lambda st=stage, pl=(plan if kind == "offload" else keep_plan): _one_step(st, pl, batch, grads))
         for kind, stage in stages.items()}, env.device, repeats=env.sizes.repeats, warmup=env.sizes.warmup)
    a, b = timed["offload"]["step_s"], timed["keep"]["step_s"]
    c = copy_seconds_alone(per_microbatch * plan.microbatches, env.device)
    overlap = 1.0 - max(0.0, a - b) / c if c > 0 else 0.0
    exposed = plan.stage(0).exposed_copy_s
    gap = abs((a - b) - exposed) / b
    return {
        f"{name}/copy_overlap": Part({"offload_step_s": a, "keep_step_s": b, "copies_alone_s": c, "overlap": overlap},
                                     judged(overlap >= OVERLAP_BAR),
                                     f"{overlap:.0%} of {c * 1e3:.2f} ms of copies hidden behind compute "
                                     f"(step {a * 1e3:.2f} ms vs {b * 1e3:.2f} ms keeping all; bar "
                                     f"{OVERLAP_BAR:.0%})"),
        f"{name}/step_vs_plan": Part({"added_s": a - b, "planned_exposed_copy_s": exposed, "gap_of_step": gap},
                                     judged(gap <= PLAN_BAR),
                                     f"offload added {(a - b) * 1e3:.2f} ms, the plan's copy waits "
                                     f"{exposed * 1e3:.2f} ms: {gap:.1%} of the step apart (bar {PLAN_BAR:.0%})"),
    }


def prefetch_beside_copy_out(device: torch.device, small: int = 2**20, large: int = 2**28) -> Part:
    """CUDA: copy out ``small`` then ``large`` bytes, prefetch the small value at once; it must
    be back before the large copy-out ends (see the module docstring)."""
    from lynx.rewrite.offload import HostStore, OffloadedValues

    store = HostStore(device)
    a = torch.randint(0, 255, (small,), dtype=torch.uint8, device=device)
    b = torch.empty(large, dtype=torch.uint8, device=device)
    start = torch.cuda.Event(enable_timing=True)
    out_end, back_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    values = OffloadedValues(store)
    values.put(0, a)
    values.put(1, b)
    assert store.d2h is not None and store.h2d is not None
    out_end.record(store.d2h)          # the large copy-out's end
    (back,), _ = values.restore_async([0])
    back_end.record(store.h2d)         # the small prefetch's end
    torch.cuda.synchronize(device)
    out_s, back_s = start.elapsed_time(out_end) / 1e3, start.elapsed_time(back_end) / 1e3
    same = bool(torch.equal(back, a))
    values.release()
    return Part({"large_copy_out_end_s": out_s, "small_prefetch_end_s": back_s, "same_bytes": same},
                judged(same and back_s < out_s),
                f"the small value back at {back_s * 1e3:.2f} ms, the large copy-out done at {out_s * 1e3:.2f} ms "
                f"({'the prefetch did not wait for it' if back_s < out_s else 'the prefetch queued behind it'}"
                f"{'' if same else '; the bytes differ'})")
