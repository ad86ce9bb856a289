"""Start a pipeline (× data-parallel) run: ``torch.multiprocessing`` spawn here, or ``torchrun``.

:class:`WorkerSpec` says what every rank builds: the model (a picklable factory giving the
same model on every rank), how the graph is split and what each stage drops — from a
:class:`lynx.Plan` (checked against the model's fingerprint before anything runs, and across
ranks) or from plain stage node lists and :class:`~lynx.plan.StageSchedule` objects — and the
microbatches of each step. :func:`run_rank` is the body of one rank: it picks NCCL and ``cuda:<LOCAL_RANK>`` where CUDA
is available, gloo and the CPU otherwise (:func:`lynx.runtime.topology.select_backend`), and
under NCCL moves the model to the rank's GPU before the stage is built; :func:`spawn` runs all
ranks on this machine (over 127.0.0.1) and returns each rank's :class:`RankResult`, or
raises :class:`~lynx.errors.LynxRuntimeError` naming the failed rank. Under ``torchrun`` call
:func:`run_rank` with ``init="env://"`` (see ``python -m lynx.runtime.torchrun``).

Example::

    results = spawn(WorkerSpec(build=my_factory, stage_nodes=nodes, pp=2, dp=2,
                               runtime=RuntimeConfig(microbatches=4)), timeout_s=120)
    results[0].stats[-1].step_s
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import LynxFingerprintError, LynxRuntimeError
from lynx.runtime.pipeline import RuntimeConfig
from lynx.runtime.stats import StepStats
from lynx.runtime.topology import make_topology, rank_device, select_backend
from lynx.runtime.worker import WorkerSpec, rank_seed

__all__ = ["WorkerSpec", "RankResult", "TokenBatches", "run_rank", "spawn", "free_port", "rank_seed"]

@dataclass
class RankResult:
    rank: int
    stage: int
    dp_rank: int
    stats: list[StepStats]                       # every step of every runtime config, in order
    grads: dict[str, torch.Tensor] = field(default_factory=dict)   # after the last step
    runs: list[tuple[list[StepStats], dict[str, torch.Tensor]]] = field(default_factory=list)  # per config


@dataclass(frozen=True)
class TokenBatches:
    """Picklable microbatch source: random tokens, next-token targets, per (step, replica, mb)."""

    names: tuple[str, str]
    vocab: int
    batch: int
    seq: int
    seed: int = 0

    def __call__(self, step: int, dp_rank: int, microbatches: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for j in range(microbatches):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 10_007 + dp_rank * 101 + j)
            idx = torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen)  # (B, T)
            out.append({self.names[0]: idx, self.names[1]: idx.roll(-1, dims=1)})
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_fingerprints(spec: WorkerSpec, store: Any, rank: int, world: int) -> None:
    given = spec.fingerprint.get(rank) if isinstance(spec.fingerprint, dict) else spec.fingerprint
    mine = given or (getattr(spec.plan, "fingerprint", None) if spec.plan is not None else None) or ""
    store.set(f"lynx/fingerprint/{rank}", mine)
    theirs = store.get("lynx/fingerprint/0").decode()
    if theirs != mine:
        raise LynxFingerprintError(f"rank {rank} has plan fingerprint {mine or '(none)'} but rank 0 has "
                                   f"{theirs or '(none)'}: every rank must run the same plan")


def run_rank(spec: WorkerSpec, rank: int, world: int, init: str = "env://") -> RankResult:
    """Everything one rank does; ``init`` is the process-group init method."""
    torch.set_num_threads(spec.threads)
    backend, device = select_backend(int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(30.0, _first(spec).timeout_s)))
    from lynx.runtime.trainer import RankTrainer

    topo = make_topology(spec.pp, spec.dp, device_type=rank_device().type)
    trainer = None
    try:
        _check_fingerprints(spec, topo.store, rank, world)
        runtimes = spec.runtime if isinstance(spec.runtime, list) else [spec.runtime]
        result = RankResult(rank, topo.stage, topo.dp_rank, [])
        for runtime in runtimes:
            if trainer is None:
                trainer = RankTrainer(spec, topo, runtime)
            else:
                trainer.start(runtime)
            stats = [trainer.step(step) for step in range(spec.steps)]
            grads = trainer.grads() if spec.return_grads else {}
            trainer.close()
            result.runs.append((stats, grads))
            result.stats += stats
            result.grads = grads
        return result
    except BaseException as err:
        runner = trainer.runner if trainer is not None else None
        (runner.monitor if runner else _monitor(topo, spec)).report(err)
        raise


def _monitor(topo: Any, spec: WorkerSpec) -> Any:
    from lynx.runtime.faults import FaultMonitor

    return FaultMonitor(topo.store, rank=topo.rank, world_size=topo.world, timeout_s=_first(spec).timeout_s)


def _first(spec: WorkerSpec) -> RuntimeConfig:
    return spec.runtime[0] if isinstance(spec.runtime, list) else spec.runtime


def _worker(rank: int, spec: WorkerSpec, world: int, port: int, queue: Any) -> None:
    try:
        result = run_rank(spec, rank, world, init=f"tcp://127.0.0.1:{port}")
        # bytes, not tensors: a queue would share tensors through memory this process frees on exit
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put(("ok", rank, buffer.getvalue()))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        kind = type(err).__name__
        queue.put(("error", rank, f"{kind}: {err}", not _caused_by_peer(err),
                   traceback.format_exc(limit=6)))
        # Receives posted to a peer that is gone never complete; their waiting threads would
        # abort the interpreter at exit. The report is out: leave without running teardown.
        queue.close()
        queue.join_thread()
        os._exit(1)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _caused_by_peer(err: BaseException) -> bool:
    from lynx.runtime.faults import PeerTimeoutError, RankFailedError

    return isinstance(err, (RankFailedError, PeerTimeoutError))


def spawn(spec: WorkerSpec, timeout_s: float = 300.0) -> list[RankResult]:
    """Run ``spec`` on ``pp × dp`` local processes; results by rank, or LynxRuntimeError."""
    world = spec.pp * spec.dp
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, spec, world, port, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LynxRuntimeError(f"run did not finish within {timeout_s:g} s; ranks without a result: "
                                       f"{sorted(set(range(world)) - set(results))}")
            try:
                item = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and p.exitcode]
                if dead:
                    code = procs[dead[0]].exitcode
                    raise LynxRuntimeError(f"rank {dead[0]} died (exit code {code}) without a result")
                continue
            results[item[1]] = item
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = {r: item for r, item in results.items() if item[0] == "error"}
    if errors:
        own = [r for r, item in errors.items() if item[3]] or sorted(errors)
        first = errors[own[0]]
        detail = "\n".join(f"  rank {r}: {item[2].splitlines()[0]}" for r, item in sorted(errors.items()))
        err = LynxRuntimeError(f"rank {own[0]} failed: {first[2]}\n{detail}")
        err.rank_errors = {r: item[2] for r, item in errors.items()}  # type: ignore[attr-defined]
        raise err
    return [torch.load(io.BytesIO(results[r][2]), weights_only=False) for r in range(world)]
