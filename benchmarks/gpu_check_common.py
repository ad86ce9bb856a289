"""Shared pieces of ``benchmarks/gpu_check.py``: sizes, results, models, plans and timing.

Every check builds its model through :func:`build_gpt` (the Megatron-style GPT of
``lynx.models`` at the sizes of one :class:`Sizes`), plans through :func:`compiled_for` (one
analysis per model and hardware, reused by every plan of it) and times with
:func:`time_interleaved` (CUDA events around each step after a synchronise, warm-up excluded;
``perf_counter`` on the CPU). A check returns a :class:`CheckResult` of named :class:`Part` s;
:func:`verdict_of` turns the parts into the check's verdict.

Example::

    >>> parts = {"a": Part({"x": 1}, "pass"), "b": Part({}, "skipped", "needs CUDA")}
    >>> verdict_of(parts)
    'pass'
    >>> model, (idx, targets) = build_gpt(SIZES["tiny"], dtype="float32", attention="math")
    >>> tuple(idx.shape), float(model(idx, targets).detach()) > 0
    ((1, 32), True)
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import lynx

__all__ = ["Sizes", "SIZES", "Part", "CheckResult", "Env", "verdict_of", "build_gpt", "compiled_for",
           "time_interleaved", "sync", "free_memory", "rel_diff", "VERDICTS", "shared_gpt",
           "between_budget", "judged", "shared_plan", "sent_grads"]

VERDICTS = ("pass", "fail", "skipped")


@dataclass(frozen=True)
class Sizes:
    """The sizes of one run: the GPT, the pipeline, the timing and the optimizer tensors."""

    name: str
    hidden: int
    heads: int
    layers: int
    seq: int
    microbatch: int
    vocab: int
    microbatches: int                 # per step, for the pipelined checks (pp 2, 1F1B)
    dtypes: tuple[str, ...]           # saved-bytes cases (the other checks use the first)
    attentions: tuple[str, ...]
    repeats: int                      # timed steps per variant (median reported)
    warmup: int
    optim_shapes: tuple[tuple[int, ...], ...]
    optim_steps: int


SIZES: dict[str, Sizes] = {
    # gpt-1.3b's layer (h 2048, 16 heads, seq 2048, vocab 51200), 2 layers: what the issue asks.
    "h200": Sizes("h200", hidden=2048, heads=16, layers=2, seq=2048, microbatch=1, vocab=51200, microbatches=4,
                  dtypes=("float16", "bfloat16"), attentions=("math", "sdpa"), repeats=20, warmup=3,
                  optim_shapes=((2048, 2048), (8192, 2048), (2048,), (1000, 3)), optim_steps=3),
    # a CPU run that still takes a moment per op (minutes on 2 cores)
    "small": Sizes("small", hidden=256, heads=4, layers=2, seq=256, microbatch=1, vocab=1024, microbatches=4,
                   dtypes=("float16", "bfloat16"), attentions=("math", "sdpa"), repeats=5, warmup=1,
                   optim_shapes=((256, 256), (1024, 256), (256,), (100, 3)), optim_steps=3),
    # the fast CPU test (tests/test_gpu_check.py) and the launch-bound timing case on CUDA
    "tiny": Sizes("tiny", hidden=64, heads=4, layers=2, seq=32, microbatch=1, vocab=256, microbatches=2,
                  dtypes=("float32",), attentions=("math", "sdpa"), repeats=2, warmup=1,
                  optim_shapes=((64, 64), (256, 64), (64,), (10, 3)), optim_steps=2),
}


@dataclass
class Part:
    """One measured comparison of a check: its figures, verdict and why."""

    figure: dict[str, Any]
    verdict: str                      # pass | fail | skipped
    reason: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"figure": self.figure, "verdict": self.verdict, "reason": self.reason}


@dataclass
class CheckResult:
    """What a check returns: a headline figure, one line of reason and its parts."""

    figure: dict[str, Any]
    reason: str
    parts: dict[str, Part] = field(default_factory=dict)


def verdict_of(parts: dict[str, Part]) -> str:
    """``fail`` if any part failed, else ``pass`` if any passed, else ``skipped``."""
    verdicts = {p.verdict for p in parts.values()}
    if "fail" in verdicts:
        return "fail"
    return "pass" if "pass" in verdicts else "skipped"


def judged(ok: bool) -> str:
    return "pass" if ok else "fail"


@dataclass
class Env:
    """Where and at what size the checks run."""

    device: torch.device
    sizes: Sizes
    hardware: str                     # the preset plans are made with: h200 on CUDA, cpu-local on the CPU
    calibrate: str = "auto"           # auto: run `lynx calibrate` where it exists; never
    workdir: Any = None               # a temporary folder (calibration file, ...)
    log: Callable[[str], None] = print
    memo: dict[str, Any] = field(default_factory=dict)  # what several checks share (see shared_gpt)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def target(self) -> str:
        return "cuda" if self.cuda else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop what the last check left behind, so the next one's allocator figures start clean
    (on the CPU there are no allocator figures, and a full collection costs half a second)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def rel_diff(value: float, reference: float) -> float:
    """``value / reference − 1`` (0 when both are 0)."""
    if reference == 0:
        return 0.0 if value == 0 else float("inf")
    return value / reference - 1.0


def build_gpt(sizes: Sizes, *, dtype: str, attention: str, dropout: float = 0.1, device: Any = "cpu",
              seed: int = 0, layers: int | None = None) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The GPT of ``lynx.models`` at ``sizes`` in train mode, with one microbatch ``(idx, targets)``."""
    from lynx.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=sizes.vocab, seq_len=sizes.seq, hidden=sizes.hidden, heads=sizes.heads,
                    layers=layers or sizes.layers, dropout=dropout, attention=attention)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg).to(getattr(torch, dtype))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, sizes.vocab, (sizes.microbatch, sizes.seq), generator=gen).to(device)  # (B, T)
    return model.train(), (idx, idx.roll(-1, dims=1))


def shared_gpt(env: Env) -> tuple[torch.nn.Module, tuple, Any]:
    """The GPT the pipeline checks share (math attention, the first dtype) and its keep-all plan
    for 2 stages, whose analysis every other plan of it reuses: one capture for checks 2-4."""
    if "gpt" not in env.memo:
        model, inputs = build_gpt(env.sizes, dtype=env.sizes.dtypes[0], attention="math", device=env.device)
        keep = compiled_for(model, inputs, env, pp=2, microbatches=env.sizes.microbatches, solver="none")
        env.memo["gpt"] = (model, inputs, keep)
    return env.memo["gpt"]


def shared_plan(env: Env, solver: str) -> Any:
    """The shared GPT planned for 2 stages by ``solver`` (``none``, ``full``, or one that must
    choose at :func:`between_budget`), made once per run."""
    model, inputs, keep = shared_gpt(env)
    if solver == "none":
        return keep
    key = f"plan/{solver}"
    if key not in env.memo:
        budget = None if solver == "full" else between_budget(keep, shared_plan(env, "full"))
        env.memo[key] = compiled_for(model, inputs, env, pp=2, microbatches=env.sizes.microbatches, solver=solver,
                                     memory_budget=budget, analysis=keep.analysis)
    return env.memo[key]


def between_budget(keep: Any, full: Any, fraction: float = 0.4) -> int:
    """A stage-0 budget ``fraction`` of the way from full recompute's activations to keep-all's."""
    k, f = keep.plan.stage(0), full.plan.stage(0)
    return k.static_bytes + f.activation_bytes + int(fraction * (k.activation_bytes - f.activation_bytes))


def compiled_for(model: torch.nn.Module, inputs: tuple, env: Env, *, pp: int, microbatches: int, solver: str,
                 memory_budget: int | None = None, hardware: Any = None, analysis: Any = None,
                 offload: bool = False) -> Any:
    """``lynx.compile(model, inputs, ...)``, reusing ``analysis`` (``compiled.analysis`` of an
    earlier plan of the same model and hardware) when given: capture and profile run once.

    Planning goes through the loop ``lynx.compile`` runs (``plan_graph``) with the budget check
    off: a plan that does not fit still runs and says so in ``plan.predicted.fits_budget``.
    """
    from lynx.planner.loop import plan_graph

    config = lynx.CompileConfig(pp=pp, microbatches=microbatches, solver=solver, memory_budget=memory_budget,
                                hardware=hardware or env.hardware, target=env.target, time_limit_s=20,
                                offload=offload)
    if analysis is None:
        analysis = lynx.analyze(model, inputs, target=config.target, hardware=config.hardware_spec())
    return lynx.Compiled(plan=plan_graph(analysis.graph, config, check_budget=False), config=config,
                         analysis=analysis)


def time_interleaved(steps: dict[str, Callable[[], Any]], device: torch.device, *, repeats: int,
                     warmup: int) -> dict[str, dict[str, float]]:
    """Median seconds per call of each step, the variants interleaved (A B A B ...).

    ``step_s``: from a synchronised start to the end of the device's work (CUDA events; on
    the CPU the call's wall time). ``host_s``: until the call returned, before synchronising —
    the host's cost of issuing the step (on the CPU the same as ``step_s``).
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    sync(device)
    samples: dict[str, dict[str, list[float]]] = {name: {"step_s": [], "host_s": []} for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                step()
                host = time.perf_counter() - t0
                end.record()
                end.synchronize()
                total = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                step()
                host = total = time.perf_counter() - t0
            samples[name]["step_s"].append(total)
            samples[name]["host_s"].append(host)
    return {name: {k: statistics.median(v) for k, v in s.items()} | {"repeats": repeats}
            for name, s in samples.items()}


def sent_grads(stage: Any, batch: dict, device: torch.device) -> list:
    """Fixed gradients for the values stage 0 sends (shapes from one forward, then its backward,
    so nothing of it stays alive: saved tensors a pack hook kept can form reference cycles)."""
    from lynx.runtime.step import backward_step, forward_step

    flight = forward_step(stage, 0, batch, [])
    gen = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(o.shape, dtype=o.dtype, device=device, generator=gen) * 1e-3
             if o.requires_grad and o.is_floating_point() else None for o in flight.output]
    backward_step(stage, 0, flight, grads)
    stage.release(0)
    del flight
    return grads
