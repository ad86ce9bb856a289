"""Check 6 of ``gpu_check.py``: a 2-process pipeline run, on the one GPU if NCCL allows it.

``lynx.testing.spawn_world`` starts 2 ranks (pp 2) of the small GPT, each training one step of
a Lynx plan that recomputes (``full``) through ``lynx.runtime.Pipeline``; each rank picks its
backend as ``lynx.runtime`` always does (``select_backend``: NCCL and ``cuda:<local rank mod
GPUs>`` where CUDA is available). Both ranks' losses and gradients must equal, bitwise, the
single-process reference (``lynx.testing.run_local`` over the same stages, each stage's RNG
seeded as its rank's, each microbatch's loss scaled by 1/m as the Pipeline does).

On one GPU both ranks land on ``cuda:0`` and NCCL is expected to refuse the communicator
("Duplicate GPU detected"): one GPU cannot hold two NCCL ranks. The refusal is recorded as
the reason, and what runs instead is:

* ``gloo_cpu_2ranks``: the same 2-process run with CUDA hidden from the ranks (gloo on the
  CPU: the communication path and its bitwise equality), and
* ``nccl_1rank``: one rank (pp 1) under NCCL on ``cuda:0`` — backend selection, the model
  moved to the GPU before its stage is built, the runtime's CUDA statistics — bitwise equal
  to ``run_local`` on the GPU.

On the CPU the first run is already gloo on the CPU, and the CUDA parts are skipped.

Example::

    >>> import torch
    >>> from gpu_check_common import SIZES, Env
    >>> check_process_group(Env(torch.device("cpu"), SIZES["tiny"], "cpu-local")).parts["2ranks"].verdict
    'pass'
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

import torch

import lynx
from gpu_check_common import CheckResult, Env, Part, compiled_for, judged

__all__ = ["check_process_group"]

SEED = 7
M = 4
NCCL_REFUSAL = ("Duplicate GPU", "duplicate GPU", "ncclInvalidUsage", "invalid usage")


def _build(seq: int) -> Any:
    return functools.partial(lynx.models.build_preset, "gpt-tiny", device="cpu", dropout=0.1, seq=seq, microbatch=1)


def _split(env: Env, pp: int, seq: int) -> tuple[Any, Any, Any]:
    """The plan (``full``), its compile settings and the token batches."""
    from lynx.testing import TokenBatches

    torch.manual_seed(SEED)
    model, inputs = _build(seq)()
    compiled = compiled_for(model, inputs, env, pp=pp, microbatches=M, solver="full")
    return compiled.plan, compiled.config, TokenBatches(model.config.vocab_size, batch=1, seq=seq, seed=SEED)


def _rank(seq: int, split: tuple) -> dict[str, Any]:
    """One rank: the model built on this rank's device, one Pipeline step of the plan."""
    from lynx.runtime.topology import rank_device
    from lynx.testing import captured_with_plan

    plan, config, batches = split
    device = rank_device()   # CUDA under NCCL: the model moves before it is captured
    torch.manual_seed(SEED)
    model, inputs = _build(seq)()
    model = model.to(device).train()
    inputs = tuple(x.to(device) for x in inputs)
    # its dropout stream: rank_seed(SEED, stage, 0), as the reference seeds each stage
    pipe = lynx.runtime.Pipeline(captured_with_plan(model, inputs, plan, config), exit_on_error=False,
                                 timeout_s=60, seed=SEED)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    pipe.step(*batches(0, 1, M))
    stats = pipe.last_stats
    out = {"rank": pipe.rank, "stage": pipe.stage_index, "losses": stats.losses,
           "cuda_max_memory_allocated": stats.cuda_max_memory_allocated,
           "grads": {n: p.grad.detach().cpu() for n, p in pipe.named_parameters() if p.grad is not None}}
    pipe.close()
    return out


def _reference(pp: int, seq: int, split: tuple, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``run_local`` over the same stages, each stage seeded as its rank: losses and gradients."""
    from lynx.rewrite import build_stages, stage_node_lists
    from lynx.runtime.topology import rank_seed
    from lynx.testing import run_local

    plan, _config, batches = split
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels, the same rounding
    try:
        torch.manual_seed(SEED)
        model, inputs = _build(seq)()
        model = model.to(device).train()
        inputs = tuple(x.to(device) for x in inputs)
        captured = lynx.capture(model, inputs)
        stages = build_stages(captured.gm, stage_node_lists(plan),
                              [plan.stage_schedule(s).dropped for s in range(pp)])
        data = [{k: v.to(device) for k, v in zip(captured.input_names, batches.microbatch(0, 0, j))}
                for j in range(M)]
        losses = run_local(stages, data, schedule="1f1b", stage_seeds=[rank_seed(SEED, s, 0) for s in range(pp)],
                           loss_scale=1.0 / M)
        return [float(x) for x in losses], {n: p.grad.detach().cpu() for n, p in model.named_parameters()
                                            if p.grad is not None}
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _cuda_hidden(hide: bool):
    """Ranks spawned inside see no GPU (so they pick gloo and the CPU)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if hide:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


def _spawn(pp: int, seq: int, split: tuple, *, hide_cuda: bool) -> tuple[list[Any], float]:
    from lynx.testing import spawn_world

    start = time.perf_counter()
    with _cuda_hidden(hide_cuda):
        results = spawn_world(_rank, pp, seq, split, timeout_s=180)
    return results, time.perf_counter() - start


def _judge(results: list[Any], ref: tuple, seconds: float, what: str) -> Part:
    ref_losses, ref_grads = ref
    grads: dict[str, torch.Tensor] = {}
    losses: list[float] = []
    peaks = {}
    for r in results:
        grads.update(r["grads"])
        if r["stage"] == len(results) - 1:
            losses = r["losses"]
        peaks[r["rank"]] = r["cuda_max_memory_allocated"]
    differ = sorted(n for n in ref_grads if n not in grads or not torch.equal(grads[n], ref_grads[n]))
    ok = losses == ref_losses and not differ and set(grads) == set(ref_grads)
    figure = {"ranks": len(results), "seconds": seconds, "losses": losses, "losses_equal": losses == ref_losses,
              "params": len(ref_grads), "params_differing": len(differ), "first_differing": differ[:4],
              "cuda_max_memory_allocated": peaks}
    return Part(figure, judged(ok), f"{what}: {len(differ)}/{len(ref_grads)} gradients differ, losses "
                                    f"{'equal' if losses == ref_losses else 'differ'} ({seconds:.1f} s)")


def check_process_group(env: Env) -> CheckResult:
    from lynx.errors import LynxRuntimeError

    seq = env.sizes.seq if env.sizes.name == "tiny" else 64
    split2 = _split(env, 2, seq)
    cpu_ref = _reference(2, seq, split2, torch.device("cpu"))
    parts: dict[str, Part] = {}
    backend = "NCCL on cuda:0 for both ranks" if env.cuda else "gloo on the CPU"
    try:
        results, seconds = _spawn(2, seq, split2, hide_cuda=False)
        ref = _reference(2, seq, split2, env.device) if env.cuda else cpu_ref
        parts["2ranks"] = _judge(results, ref, seconds, f"2 ranks, {backend}")
    except LynxRuntimeError as err:
        message = str(err)
        refused = env.cuda and any(word in message for word in NCCL_REFUSAL)
        first = " | ".join(line.strip() for line in message.splitlines()[:3])
        parts["2ranks"] = Part({"error": message[:2000]}, "skipped" if refused else "fail",
                               (f"NCCL refuses two ranks on one GPU: {first}" if refused else
                                f"2 ranks, {backend}, failed: {first}"))
    if env.cuda:
        results, seconds = _spawn(2, seq, split2, hide_cuda=True)
        parts["gloo_cpu_2ranks"] = _judge(results, cpu_ref, seconds, "instead, 2 ranks, gloo on the CPU")
        split1 = _split(env, 1, seq)
        results, seconds = _spawn(1, seq, split1, hide_cuda=False)
        parts["nccl_1rank"] = _judge(results, _reference(1, seq, split1, env.device), seconds,
                                     "instead, 1 rank, NCCL on cuda:0")
    else:
        parts["nccl_1rank"] = Part({}, "skipped", "NCCL needs CUDA")
    reason = "; ".join(f"{n}: {p.reason}" for n, p in parts.items())
    figure = {n: {k: p.figure.get(k) for k in ("ranks", "params_differing", "losses_equal", "seconds")}
              for n, p in parts.items() if "ranks" in p.figure}
    return CheckResult(figure, reason, parts)
