"""Train a GPT across processes with a Lynx plan: pipeline stages × data-parallel replicas × tensor-parallel ranks.

Launch with ``torchrun`` (gloo on CPU, NCCL when CUDA is available — the same file)::

    torchrun --nproc_per_node 4 examples/train_gpt.py          # pp 2 × dp 2, DeMo, HEU plan
    torchrun --nproc_per_node 4 examples/train_gpt.py --tp 2 --dp 1 --optimizer adamw   # pp 2 × tp 2
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 20 --checkpoint-dir ckpt --checkpoint-every 10
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 40 --checkpoint-dir ckpt --resume

The mesh is ``pp × dp × tp`` = the number of processes (``--dp`` defaults to WORLD_SIZE / (pp · tp);
``--tp`` shards the layers' linears with the default sharding plan, docs/tensor_parallel.md).
Rank 0 compiles the plan (or loads ``--plan``, checked against this model and mesh) and
broadcasts it, so every rank runs the same plan; each rank then builds the same model (same
seed), compiles it with that plan and trains it through ``lynx.runtime.Pipeline`` from the
loop below — its own optimizer, learning-rate warm-up and data, as in
``docs/train_your_model.md`` — on byte windows of the Python standard library's sources (no
download; the data of step ``i`` is a function of ``i``). Every
bad input — a plan for another model or mesh, a checkpoint of another configuration, a
process count that is not the mesh, a budget no plan meets — stops every rank before the
first step, with one message and a non-zero exit, and leaves the files on disk as they were.

Rank 0 prints a line per step (loss, tokens/s, exposed vs hidden recomputation) and at the
end the plan's predicted vs the run's measured step time and peak activation bytes per stage.
``--log-json`` writes the per-step losses (what the tests compare) as strict JSON.

A step whose loss or gradients are NaN or infinite stops every rank with one message naming
the step, the ranks and what was non-finite, before the optimizer sees it; with
``--skip-nonfinite`` such steps are skipped instead (no optimizer step) and counted in the
report. Checkpoints (``lynx.runtime.checkpoint``) hold safetensors and JSON, nothing that runs
code when read, with a manifest of every file's size and SHA-256; ``--resume`` verifies them,
and when the newest checkpoint is damaged it says so, moves it aside (``step_N.damaged``) and
continues from the newest one that verifies. The checkpoint directory is locked for the life of
the run: a second run on it is refused at start, naming the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lynx.units import format_size
from lynx.errors import LynxConfigError, LynxError
from lynx.process_group_guard import bind_before_init

DEFAULT_LR = {"adamw": 6e-3, "demo": 6e-3, "lion": 2e-3}   # benchmarks/convergence.py's tuned peaks
WARMUP_STEPS = 5
# gpt-tiny at seq 64 × 8 keeps 16.9 MiB on stage 0 without recomputation (`lynx compare`): 12 MiB forces it
DEFAULT_BUDGET = "12MiB"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-tiny",
                    help="preset (gpt-tiny, llama-tiny, ...) or file.py:factory / module:factory returning "
                         "(model, example_inputs): a model taking (tokens, targets) of one microbatch, "
                         "positional or by keyword (e.g. input_ids, labels)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (bytes)")
    ap.add_argument("--microbatch", type=int, default=8, help="sequences per microbatch")
    ap.add_argument("--pp", type=int, default=None, help="pipeline stages (default 2, or the plan's)")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default WORLD_SIZE / (pp · tp))")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks per stage (default 1, or the plan's)")
    ap.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default 4)")
    ap.add_argument("--optimizer", choices=("adamw", "demo", "lion"), default=None, help="default demo")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default per optimizer)")
    ap.add_argument("--solver", default="heu", help="opt | heu | none | full | selective | checkmate")
    ap.add_argument(
        "--memory-budget", default=None, help="per device, e.g. 7MiB (default 12MiB: forces recompute on stage 0)"
    )
    ap.add_argument(
        "--hardware",
        default=None,
        help="cost model: a preset, a hardware file (.yaml/.json) or auto (this machine, measured once "
        "by `lynx calibrate` and cached); default auto on CPU, h100-sxm on CUDA",
    )
    ap.add_argument("--plan", default=None, help="a saved plan (lynx plan ... -o plan.json) instead of compiling")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-json", default=None, help="write per-step losses and the summary here (rank 0)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--no-pin-cores", dest="pin_cores", action="store_false",
                    help="leave the ranks' threads to the scheduler (default on CPU with tp: a core per rank where the "
                         "job fills the cores evenly, lynx.runtime.core_pin)")
    ap.add_argument("--compile", action="store_true",
                    help="pass each stage's generated graphs through torch.compile (Inductor; on CPU needs gcc)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="how long a rank waits for a peer")
    ap.add_argument("--skip-nonfinite", action="store_true",
                    help="skip a step whose loss or gradients are NaN or infinite (counted in the report) instead "
                         "of stopping")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- settings
def mesh_from_env(args: argparse.Namespace, plan_config: dict[str, Any] | None) -> tuple[int, int, int]:
    """(pp, dp, tp) from the flags, the plan and WORLD_SIZE; refuses a process count that is not the mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = args.pp or int((plan_config or {}).get("pp", 2))
    tp = args.tp or int((plan_config or {}).get("tp", 1))
    dp = args.dp or int((plan_config or {}).get("dp", 0)) or max(1, world // (pp * tp))
    if pp * dp * tp != world:
        source = " (the plan's)" if plan_config and not (args.pp and args.dp) else ""
        mesh, flags = (f"pp {pp} × dp {dp} × tp {tp}", "--pp/--dp/--tp with pp × dp × tp") if tp > 1 else \
            (f"pp {pp} × dp {dp}", "--pp/--dp with pp × dp")
        raise LynxConfigError(
            f"{world} {'process was' if world == 1 else 'processes were'} started but the mesh{source} "
            f"is {mesh} = {pp * dp * tp}: start `torchrun --nproc_per_node {pp * dp * tp}` or choose "
            f"{flags} = {world}"
        )
    return pp, dp, tp


def plan_settings(
    args: argparse.Namespace, pp: int, dp: int, plan_config: dict[str, Any] | None, device: torch.device,
    tp: int = 1,
) -> dict[str, Any]:
    """lynx.compile settings: the flags given, else the saved plan's, else the defaults."""
    base = dict(plan_config or {})
    pick = lambda flag, key, default: flag if flag is not None else base.get(key, default)  # noqa: E731
    hardware = pick(args.hardware, "hardware", "h100-sxm" if device.type == "cuda" else "auto")
    settings = {
        "pp": pp,
        "dp": dp,
        "tp": tp,
        "microbatches": int(pick(args.microbatches, "microbatches", 4)),
        "memory_budget": pick(args.memory_budget, "memory_budget", DEFAULT_BUDGET),
        "optimizer": pick(args.optimizer, "optimizer", "demo"),
        "hardware": hardware,
        "schedule": base.get("schedule", "1f1b"),
    }
    if tp > 1 and base.get("tp_plan"):
        settings["tp_plan"] = base["tp_plan"]   # the sharding the plan was made for
    return settings


def hardware_for_plan(hardware: Any, ranks: int, from_plan: bool, source: Any = None) -> tuple[Any, str, Any]:
    """Rank 0: the spec to plan with (``auto`` may measure this machine first), a line naming
    it, and how it was measured (its ``Calibration``, None for a preset).

    A CPU spec assumes a core per rank; with more ranks than cores each rank gets its share
    (``lynx.planner.hardware.share_cores``). A saved plan's hardware is used as recorded, with
    the file and calibration it came from (``source``: the plan's ``hardware_source``).
    """
    from lynx.planner.hardware import HARDWARE_PRESETS, HardwareSpec, share_cores
    from lynx.planner.hardware_ref import resolve_hardware

    spec = HardwareSpec.model_validate(hardware) if isinstance(hardware, dict) else resolve_hardware(hardware)
    if from_plan and source is not None:
        spec = source.applied_to(spec)
    if not from_plan:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        shared = share_cores(spec, ranks, cores)
        hardware = hardware if shared is spec and isinstance(hardware, str) and hardware in HARDWARE_PRESETS else shared
    return hardware, _hardware_line(spec, hardware), spec.calibration


def _hardware_line(spec: Any, used: Any) -> str:
    """Where the cost model's figures come from: a preset, or a file (and how it was measured)."""
    name = used if isinstance(used, str) else _hardware_name(used) if isinstance(used, dict) else spec.name
    line = f"hardware {name}: " + (f"file {spec.source}" if spec.source else "preset (lynx/planner/hardware.py)")
    cal = spec.calibration
    if cal is not None:
        steadiest = sorted(cal.spread.items(), key=lambda kv: kv[1])
        spread = ", ".join(f"{k} {v:.0%}" for k, v in steadiest)
        line += (
            f"; calibrated {cal.date} on {cal.host} in {cal.seconds:.1f} s at load {cal.load_before:.2f}, "
            f"{cal.repeats} repeats, spread (max-min)/median: {spread}"
        )
        if cal.unreliable:
            line += f"; not repeatable at that load: {', '.join(cal.unreliable)} (lynx calibrate says why)"
    return line


def build_model(model: str, seq: int, microbatch: int, device: str) -> tuple[torch.nn.Module, tuple]:
    from lynx.models import resolve_model

    resolved = resolve_model(model, seq=seq, microbatch=microbatch, device=device)
    return resolved.model, resolved.example_inputs


def make_optimizer(kind: str, lr: float, params: list, group: Any) -> torch.optim.Optimizer:
    from lynx.optim import DeMo, DistributedLion

    if kind == "demo":
        return DeMo(params, lr=lr, process_group=group)
    if kind == "lion":
        return DistributedLion(params, lr=lr, betas=(0.9, 0.9), process_group=group)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))  # gradients averaged by the runtime


def warmup_lr(peak: float, step: int) -> float:
    """Linear warm-up, then constant: a function of the step alone, so resuming is exact."""
    return peak * min(1.0, (step + 1) / WARMUP_STEPS)


# ----------------------------------------------------------------------------- rank-0 decisions
def decided_by_rank0(fn: Any) -> Any:
    """Run ``fn`` on rank 0 and give its result to every rank; its LynxError stops every rank."""
    rank = dist.get_rank()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except LynxError as err:
            box[0] = ("error", err)
        except BaseException as err:  # a bug: the others must not wait for a broadcast forever
            dist.broadcast_object_list([("error", _Quiet(repr(err)))], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value if rank == 0 else _Quiet(str(value))
    return value


class _Quiet(Exception):
    """Another rank's error, already printed by rank 0: exit non-zero without repeating it."""


def make_plan(args: argparse.Namespace, settings: dict[str, Any], device: torch.device) -> Any:
    """Rank 0's compilation: the plan every rank runs (the model is the one :func:`train` builds,
    from the same seed, so rank 0 trains this compilation instead of capturing the model again)."""
    import lynx
    from lynx.plan import Plan

    torch.manual_seed(args.seed)
    model, inputs = build_model(args.model, args.seq, args.microbatch, str(device))
    if args.plan is not None:
        # checked against this model and these settings: LynxFingerprintError names what differs
        return lynx.compile(model, inputs, plan=Plan.load(args.plan), **settings)
    return lynx.compile(model, inputs, solver=args.solver, **settings)


def run_meta(args: argparse.Namespace, plan: Any, settings: dict[str, Any], lr: float) -> dict[str, Any]:
    """What a checkpoint records about the run (and what a resume must share with it); with
    ``plan`` None, what is known before planning (all but the plan's fields)."""
    meta = {
        "model": args.model,
        "model_dims": {"seq": args.seq, "microbatch": args.microbatch},
        "pp": settings["pp"],
        "dp": settings["dp"],
        "tp": settings.get("tp", 1),
        "microbatches": settings["microbatches"],
        "optimizer": settings["optimizer"],
        "seed": args.seed,
        "lr": lr,
    }
    if plan is not None:
        meta.update({
            "stage_layers": [sp.layers for sp in plan.stages],
            "plan_fingerprint": plan.fingerprint,
            "solver": plan.solver,
            "memory_budget": plan.config.get("memory_budget"),
        })
    return meta


_LOCK: Any = None   # rank 0's lock on --checkpoint-dir, held until the process ends


def lock_checkpoint_dir(args: argparse.Namespace) -> None:
    """Rank 0: one job per checkpoint directory (a second is refused, naming the first)."""
    global _LOCK
    from lynx.runtime.checkpoint_lock import CheckpointLock

    if args.checkpoint_dir is not None and _LOCK is None:
        _LOCK = CheckpointLock(args.checkpoint_dir).acquire()


def find_resume_point(args: argparse.Namespace, meta: dict[str, Any]) -> tuple[Any, list[tuple[Any, str]]]:
    """Before planning (``meta`` without the plan's fields): the checkpoint to resume from
    (verified) and the damaged ones above it. A directory that needs --resume, holds no checkpoint
    that verifies, or was written by another configuration is refused here, before the model is
    captured and planned; the stage split, which needs the plan, is :func:`take_resume_point`'s."""
    from lynx.runtime.checkpoint import COMPARED_FIELDS, check_compatible, read_meta, usable_checkpoint

    if args.checkpoint_dir is None:
        return None, []
    usable, damaged = usable_checkpoint(args.checkpoint_dir)
    if usable is None and not damaged:
        return None, []
    if not args.resume:
        latest = (damaged[0][0] if damaged else usable).name
        raise LynxConfigError(
            f"{args.checkpoint_dir} already holds checkpoints (latest {latest}); pass --resume to continue "
            f"from it, or choose an empty --checkpoint-dir (existing checkpoints are never overwritten)"
        )
    if usable is None:
        raise LynxConfigError(
            f"no checkpoint in {args.checkpoint_dir} verifies: " + "; ".join(why for _, why in damaged)
            + ". Move them away to start afresh"
        )
    check_compatible(read_meta(usable), meta, where=str(usable), fields=[f for f in COMPARED_FIELDS if f in meta])
    return usable, damaged


def take_resume_point(
    usable: Any, damaged: list[tuple[Any, str]], meta: dict[str, Any]
) -> tuple[str | None, list[str]]:
    """After planning: the plan's stage split checked against the checkpoint's, then the damaged
    checkpoints moved aside; the checkpoint to resume from and what to say about the damaged ones."""
    from lynx.runtime.checkpoint import check_compatible, read_meta

    if usable is None:
        return None, []
    check_compatible(read_meta(usable), meta, where=str(usable))
    notes = []
    for path, why in damaged:   # aside, not deleted: a later save of that step must not find it
        aside = path.with_name(path.name + ".damaged")
        n = 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}.damaged{n}"), n + 1
        path.rename(aside)
        notes.append(f"checkpoint {path.name} is damaged ({why}); moved it to {aside.name}")
    return str(usable), notes


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass
class Setup:
    """What every rank agreed on before the first step."""

    plan: Any
    settings: dict[str, Any]
    meta: dict[str, Any]
    device: torch.device
    resume_from: str | None
    lr: float
    hardware_line: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)   # what rank 0 found on the way (damaged checkpoints)
    calibration: Any = None   # how the hardware file was measured (None: a preset)
    compiled: Any = None      # rank 0: the compilation that made the plan (None elsewhere)


def setup(args: argparse.Namespace) -> Setup:
    """Check the flags, start the process group and agree on the plan and resume point (no training)."""
    from lynx.plan import Plan

    if args.steps < 1:
        raise LynxConfigError(f"--steps must be >= 1, got {args.steps}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise LynxConfigError("--checkpoint-every and --resume need --checkpoint-dir")
    # a missing or corrupt plan file, or one the runtime cannot execute, stops here, on every
    # rank, before any process group
    saved = Plan.load(args.plan) if args.plan is not None else None
    saved_config = saved.config if saved is not None else None
    if saved_config is not None:
        from lynx.runtime.executable import check_executable

        check_executable(saved_config)
    pp, dp, tp = mesh_from_env(args, saved_config)
    if "MASTER_ADDR" not in os.environ:  # plain `python train_gpt.py --pp 1`: a world of one
        from lynx.runtime.topology import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    bind_before_init()  # while no group exists: see lynx/process_group_guard.py
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=max(60.0, args.timeout_s)))
    settings = plan_settings(args, pp, dp, saved_config, device, tp)
    lr = args.lr if args.lr is not None else DEFAULT_LR[settings["optimizer"]]

    def decide() -> tuple[str, str | None, list[str], str, Any]:
        lock_checkpoint_dir(args)   # before anything reads or writes the directory
        # a checkpoint this run cannot resume is refused before anything is measured or captured
        usable, damaged = find_resume_point(args, run_meta(args, None, settings, lr))
        hardware, line, calibration = hardware_for_plan(
            settings["hardware"],
            pp * dp * tp,
            from_plan=args.hardware is None and saved_config is not None and "hardware" in saved_config,
            source=saved.hardware_source if saved is not None else None,
        )
        own.append(make_plan(args, {**settings, "hardware": hardware}, device))
        plan = own[-1].plan
        resume_from, notes = take_resume_point(usable, damaged, run_meta(args, plan, settings, lr))
        return plan.to_json(), resume_from, notes, line, calibration

    own: list[Any] = []
    plan_json, resume_from, notes, hardware_line, calibration = decided_by_rank0(decide)
    plan = Plan.from_json(plan_json)
    return Setup(plan, settings, run_meta(args, plan, settings, lr), device, resume_from, lr, hardware_line, notes,
                 calibration, own[-1] if own else None)


def global_batch(source: Any, step: int, dp: int, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's batch, every replica's microbatches stacked in order (what Pipeline.step takes)."""
    parts = [mb for d in range(dp) for mb in source(step, d, microbatches)]
    return torch.cat([mb["idx"] for mb in parts]), torch.cat([mb["targets"] for mb in parts])


def train(args: argparse.Namespace) -> dict[str, Any]:
    import lynx
    from lynx.config import FINGERPRINT_FIELDS
    from lynx.data import StdlibBatches
    from lynx.runtime.checkpoint import load_checkpoint, save_checkpoint
    from lynx.runtime.rank_state import pipeline_state
    from lynx.runtime.report import host_busy_s

    load_start = os.getloadavg()[0]  # before this run compiles or trains: the others' load
    run = setup(args)
    m, rank = run.settings["microbatches"], dist.get_rank()
    use_compile = args.compile or bool(run.plan.config.get("compile"))
    if run.compiled is not None:   # rank 0 planned on this model, built from --seed: no second capture
        compiled = dataclasses.replace(run.compiled, config=run.compiled.config.replace(compile=use_compile))
    else:
        torch.manual_seed(args.seed)  # the same weights on every rank
        model, inputs = build_model(args.model, args.seq, args.microbatch, str(run.device))
        settings = {k: run.plan.config[k] for k in FINGERPRINT_FIELDS if k in run.plan.config}
        if run.plan.config.get("tp_plan"):   # tp > 1: shard as the plan was made for
            settings["tp_plan"] = run.plan.config["tp_plan"]
        # checked against this model
        compiled = lynx.compile(model, inputs, plan=run.plan, compile=use_compile, **settings)
    # the pipe seeds each rank's own dropout stream from --seed (lynx.runtime.rank_rng)
    pipe = lynx.runtime.Pipeline(compiled, timeout_s=args.timeout_s, seed=args.seed,
                                 skip_nonfinite=args.skip_nonfinite, pin_cores=args.pin_cores)
    topo = pipe.topology
    optimizer = make_optimizer(run.settings["optimizer"], run.lr, list(pipe.parameters()), pipe.dp_group)
    if run.settings["optimizer"] != "adamw":
        pipe.use_optimizer(optimizer)  # DeMo / Lion send their buckets during the last backward
    state = pipeline_state(pipe, optimizer)
    start = load_checkpoint(state, run.resume_from) if run.resume_from else 0
    pipe.steps_done = start   # the pipe counts steps as this loop does (in its messages)
    if rank == 0:
        for note in run.notes:
            _say(note)
        _say(run.hardware_line)
        _say(_banner(args, run, start))
    source = StdlibBatches(("idx", "targets"), batch=args.microbatch, seq=args.seq, seed=args.seed)
    tokens = topo.dp * m * args.microbatch * args.seq
    log: dict[str, Any] = {"meta": run.meta, "start_step": start, "steps": [], "skipped_steps": []}
    history: list[Any] = []
    cpu_s: list[float] = []
    threads_s: list[float] = []
    progress = _Progress(rank == 0, args.steps, start)
    # the host's CPU time beside the run's own over the loop: what other processes took (RunLoad)
    loop = (time.perf_counter(), time.process_time(), host_busy_s())
    for step in range(start, args.steps):
        t0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(run.lr, step)
        loss = pipe.step(*global_batch(source, step, topo.dp, m))
        if pipe.last_step_skipped:   # --skip-nonfinite: no optimizer step (the pipe cleared the gradients)
            optimizer.zero_grad()
            log["skipped_steps"].append({"step": step, "why": pipe.last_nonfinite})
            progress.note(f"step {step + 1}: skipped ({pipe.last_nonfinite})")
        else:
            t_opt = time.perf_counter()
            optimizer.step()  # DeMo / Lion: finishes the buckets the last backward launched
            optimizer.zero_grad()
            opt_s = time.perf_counter() - t_opt
            stats = pipe.last_stats
            stats.wait_sync_s += opt_s  # the step as the plan counts it: the optimizer step included
            stats.step_s += opt_s
            cpu_s.append(time.process_time() - cpu0)  # this process's CPU time: what other load cannot inflate
            threads_s.append(max(0.0, cpu_s[-1] - (time.thread_time() - main0)))  # its threads' beyond the main one
            exposed, hidden = _recompute_seconds(stats, topo, run.device)
            wall = time.perf_counter() - t0
            history.append(stats)
            record = {
                "step": step,
                "loss": float(loss),
                "losses": list(pipe.losses),
                "wall_s": wall,
                "exposed_recompute_s": exposed,
                "hidden_recompute_s": hidden,
            }
            log["steps"].append(record)
            progress.update(step, record, tokens / wall)
        state.next_step = step + 1
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            saved = save_checkpoint(state, args.checkpoint_dir, run.meta)
            if rank == 0:
                progress.note(f"checkpoint {saved}")
        if rank == 0 and args.log_json:
            _write_json(args.log_json, log)
    progress.close()
    busy = host_busy_s()
    loop = (time.perf_counter() - loop[0], time.process_time() - loop[1],
            None if loop[2] is None or busy is None else busy - loop[2])
    pipe.close()
    log["hardware"] = run.hardware_line
    if rank == 0 and log["skipped_steps"]:
        _say(f"skipped {len(log['skipped_steps'])} step(s) with a non-finite loss or gradient: "
             + ", ".join(str(s["step"] + 1) for s in log["skipped_steps"]))
    _finish(args, run.plan, history, (cpu_s, threads_s), log,
            _predicted_optimizer_s(run.plan, list(pipe.parameters())), _run_load(load_start, run.calibration), loop)
    return log


def _run_load(start: float, calibration: Any) -> Any:
    """The machine's load at calibration and around this run (lynx.runtime.report.RunLoad)."""
    from lynx.runtime.report import RunLoad

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return RunLoad(start=start, end=os.getloadavg()[0], ranks_here=ranks_here, cpus=os.cpu_count() or 1,
                   calibrated=calibration.load_before if calibration is not None else None,
                   calibrated_on=calibration.date if calibration is not None else "")


def _banner(args: argparse.Namespace, run: Setup, start: int) -> str:
    plan, s = run.plan, run.settings
    recomputed = sum(d.action == "recompute" for sp in plan.stages for d in sp.decisions)
    return (
        f"plan {plan.solver} ({plan.status}) for {args.model} seq {args.seq} × {args.microbatch}, "
        f"pp {s['pp']} × dp {s['dp']}" + (f" × tp {s['tp']}" if s.get("tp", 1) > 1 else "")
        + f", {s['microbatches']} microbatches, {s['optimizer']} lr {run.meta['lr']:g}, "
        f"budget {format_size(plan.stages[0].budget_bytes)} per device: {recomputed} nodes recomputed, "
        f"predicted step {plan.predicted.step_time_s * 1e3:.1f} ms on {_hardware_name(plan.config.get('hardware'))}"
        + (f"; resuming from {run.resume_from} at step {start}" if run.resume_from else "")
    )


def _hardware_name(hardware: Any) -> str:
    return hardware.get("name", "a custom spec") if isinstance(hardware, dict) else str(hardware)


def _predicted_optimizer_s(plan: Any, params: list[Any]) -> float:
    """The cost model's optimizer step over this rank's parameters (lynx.planner.cost.optimizer_step_s)."""
    from lynx.planner.cost import optimizer_step_s
    from lynx.planner.simulator import config_from_record

    config = config_from_record(plan.config)
    return optimizer_step_s(sum(p.numel() for p in params), config.optimizer, config.hardware_spec())


def _finish(
    args: argparse.Namespace,
    plan: Any,
    history: list[Any],
    cpu_s: tuple[list[float], list[float]],
    log: dict[str, Any],
    optimizer_s: float = 0.0,
    load: Any = None,
    loop: tuple[float, float, float | None] = (0.0, 0.0, None),
) -> None:
    """Rank 0 prints the plan's predictions beside what every rank measured. ``loop``: this
    rank's training loop in wall seconds, its CPU seconds and the host's busy CPU seconds."""
    from lynx.runtime.report import format_summary, run_summary
    from lynx.runtime.stats import format_stats

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (history, cpu_s, optimizer_s, (socket.gethostname(), loop[1])))
    if dist.get_rank() != 0:
        return
    if not history:
        _say(f"nothing to train: the run is already at step {log['start_step']} of --steps {args.steps}")
        return
    per_step = [[ranks[i] for ranks, *_ in everyone] for i in range(len(history))]
    cpu = [statistics.median(c[1:] or c) for _, (c, _), *_ in everyone]  # per rank, after the warm-up step
    threads = [statistics.median(t[1:] or t) for _, (_, t), *_ in everyone]
    cpu_line, cpu_ratio = _cpu_line(plan, per_step[0], cpu, [o for _, _, o, _ in everyone])
    if load is not None:
        wall, _, host_busy = loop
        ours = sum(c for _, _, _, (host, c) in everyone if host == socket.gethostname())
        others = (host_busy - ours) / wall if host_busy is not None and wall > 0 else None
        load = dataclasses.replace(load, others_cpus=others, cpu_ratio=cpu_ratio)
    summary = run_summary(per_step, plan, load)
    print(format_stats(per_step[-1], plan))
    print(format_summary(summary, plan))
    print(cpu_line, flush=True)
    runtime_line, modelled = _runtime_line(plan, per_step, threads)
    print(runtime_line, flush=True)
    hardware = log.get("hardware") or "the hardware the plan records"
    print(f"predicted with {hardware}", flush=True)
    log["summary"] = dataclasses.asdict(summary)
    # every step's pipeline time (the slowest rank's, as the summary's median and fastest take it)
    log["step_times_s"] = [max(s.step_s for s in ranks) for ranks in per_step]
    log["per_rank"] = _per_rank_medians(per_step)
    for row, c, t in zip(log["per_rank"], cpu, threads):
        row["cpu_s"], row["threads_cpu_s"] = c, t
    log["runtime_modelled_s"] = modelled
    log["loadavg"] = os.getloadavg()
    if args.log_json:
        _write_json(args.log_json, log)


def _cpu_line(plan: Any, ranks: list[Any], cpu: list[float], optimizer_s: list[float]) -> tuple[str, float | None]:
    """The busiest rank's CPU time per step beside its stage's predicted busy time (compute,
    recompute and optimizer step): a check of the cost model that other load inflates little,
    unlike the wall-clock step (which also waits for the other ranks). Returns the line and
    the ratio where it measures the cores' speed against the calibration's, else None: with
    tensor parallelism the busiest rank's CPU time also holds what its all-reduces spend
    waiting, and with more ranks than cores the model's share of a core is not what a rank
    got at each instant — both read as a slower core that is not."""
    from lynx.planner.core_sharing import CoreSharing, bar_work
    from lynx.planner.simulator import config_from_record

    busiest = max(range(len(cpu)), key=lambda r: cpu[r])
    stage = ranks[busiest].stage
    config = config_from_record(plan.config)
    # with shared cores a bar's second is more work where fewer stages are busy (lynx.planner.core_sharing)
    sharing = CoreSharing.from_hardware(config.hardware_spec(), pp=config.pp, tp=config.tp, dp=config.dp)
    predicted = optimizer_s[busiest] + bar_work(plan.timeline, stage, ("compute", "recompute", "runtime"), sharing)
    share = config.hardware_spec().core_share   # lynx.planner.hardware.share_cores: a core's share per rank
    named = re.fullmatch(r".*-(\d+)on(\d+)", _hardware_name(plan.config.get("hardware")))   # a plan from before
    factor = share.ranks / share.cores if share is not None else int(named[1]) / int(named[2]) if named else 1.0
    note = f" × {factor:g} (the model prices each rank's work at 1/{factor:g} of a core)" if factor != 1.0 else ""
    ratio = cpu[busiest] * factor / predicted
    speed = ratio if factor == 1.0 and config.tp == 1 else None
    return (
        f"CPU time per step, busiest rank ({busiest}, stage {stage}): {cpu[busiest] * 1e3:.1f} ms{note}; "
        f"predicted busy time (compute, recompute, runtime, optimizer step) {predicted * 1e3:.1f} ms: "
        f"measured/predicted {ratio:.2f} "
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    ), speed


def _recompute_seconds(stats: Any, topo: Any, device: torch.device) -> tuple[float, float]:
    """The step's exposed and hidden recomputation seconds (hidden in pipeline and in TP windows),
    averaged over the replicas and TP ranks (each recomputes its own shard)."""
    ranks = topo.dp * getattr(topo, "tp", 1)
    hidden = stats.recompute_hidden_s + stats.recompute_tp_hidden_s
    buf = torch.tensor(
        [stats.exposed_recompute_s / ranks, hidden / ranks], dtype=torch.float64
    ).to(device)  # NCCL reduces device tensors only
    dist.all_reduce(buf)
    return float(buf[0]), float(buf[1])


def _runtime_s(s: Any) -> float:
    """One rank's step outside its graphs, recomputation and waits: the runtime's own main-thread work."""
    return max(0.0, s.step_s - s.forward_s - s.backward_s - s.wait_act_s - s.wait_grad_s - s.wait_sync_s
               - s.recompute_hidden_s - s.recompute_window_exposed_s)


def _runtime_line(plan: Any, per_step: list[list[Any]], threads: list[float]) -> tuple[str, float]:
    """The runtime's own work per rank and step: modelled (``runtime_action_s`` per action of the
    rank's list: compute, sends, receives) beside measured (the main thread outside graphs and
    waits, the median and the least over steps, and the other threads' CPU time)."""
    from lynx.planner.schedule import list_actions
    from lynx.planner.simulator import config_from_record

    config = config_from_record(plan.config)
    per_action = config.hardware_spec().runtime_action_s
    timed = per_step[1:] if len(per_step) > 1 else per_step
    ranks = range(len(timed[0]))
    main = [statistics.median(_runtime_s(step[r]) for step in timed) for r in ranks]
    least = [min(_runtime_s(step[r]) for step in timed) for r in ranks]
    busiest = max(ranks, key=lambda r: main[r])
    actions = list_actions(config.schedule, config.pp, config.microbatches, timed[0][busiest].stage, config.virtual)
    return (f"runtime's own work per rank and step: modelled {actions * per_action * 1e3:.1f} ms ({actions} actions "
            f"× {per_action * 1e6:.0f} µs); measured on rank {busiest} {main[busiest] * 1e3:.1f} ms on the main "
            f"thread outside graphs and waits (least {least[busiest] * 1e3:.1f} ms) + "
            f"{threads[busiest] * 1e3:.1f} ms of other threads' CPU time"), actions * per_action


def _per_rank_medians(per_step: list[list[Any]]) -> list[dict[str, float]]:
    """Per rank, the median of each timing over the steps after the first (where the time goes)."""
    timed = per_step[1:] if len(per_step) > 1 else per_step
    keys = (
        "step_s",
        "forward_s",
        "backward_s",
        "wait_act_s",
        "wait_grad_s",
        "wait_sync_s",
        "recompute_hidden_s",
        "recompute_window_exposed_s",
        "recompute_on_demand_s",
    )
    return [
        {
            "rank": ranks.rank,
            "stage": ranks.stage,
            "dp_rank": ranks.dp_rank,
            **{k: statistics.median(getattr(step[i], k) for step in timed) for k in keys},
            "runtime_s": statistics.median(_runtime_s(step[i]) for step in timed),
            "runtime_least_s": min(_runtime_s(step[i]) for step in timed),
        }
        for i, ranks in enumerate(timed[0])
    ]


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Strict JSON (a NaN or infinity, e.g. a skipped step's loss, is written as null)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(_finite(data), indent=1, allow_nan=False))
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _say(message: str) -> None:
    print(message, flush=True)


class _Progress:
    """A rich progress bar on a terminal, a plain line per step otherwise (rank 0 only)."""

    def __init__(self, active: bool, total: int, start: int) -> None:
        self.active, self.bar = active, None
        if active and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=start)

    def update(self, step: int, record: dict[str, Any], tokens_per_s: float) -> None:
        if not self.active:
            return
        text = (
            f"loss {record['loss']:.4f}  {tokens_per_s:,.0f} tok/s  recompute exposed "
            f"{record['exposed_recompute_s'] * 1e3:.1f} ms hidden {record['hidden_recompute_s'] * 1e3:.1f} ms"
        )
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, description=text)
        else:
            _say(f"step {step + 1:>4}  {text}")

    def note(self, message: str) -> None:
        (self.bar.console.print if self.bar is not None else _say)(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
        code = 0
    except LynxError as err:
        # before the process group exists, or when the ranks agreed on it, every rank has the
        # same message: rank 0 says it
        if (dist.is_initialized() and not err.every_rank) or os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        code = 2
    except _Quiet:
        code = 2
    if dist.is_initialized():
        if code == 0:
            # every rank done with its peers before any tears down (rank 0 hosts the store)
            dist.barrier()
            dist.destroy_process_group()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # peers may be gone: no collective teardown
    return code


if __name__ == "__main__":
    sys.exit(main())
