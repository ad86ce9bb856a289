"""One pipeline stage per rank: the loop :class:`lynx.runtime.Pipeline` drives, with window recompute.

For every backward B(j) the gradient receive is posted as soon as F(j)'s activations are sent;
when B(j) comes up the runner first runs the recomputation the plan put in that window
(``s{stage}.recv_grad.mb{j}``) while the gradient is still in flight, then waits, then runs
backward. Each window is one call of a generated recompute graph (:mod:`lynx.rewrite.lower`).
Recomputation planned for a forward's wait (``s{stage}.recv_act.mb{k}``) runs before
waiting for that activation. Windows of data-parallel collectives are served by on-demand
recomputation in the last backward, which runs while the per-bucket collectives launched by
:class:`~lynx.runtime.data_parallel.BucketLauncher` are in flight. Every wait goes through the
:class:`~lynx.runtime.faults.FaultMonitor`, so a failed peer is named instead of hanging.

This is a loop of its own over ``isend``/``irecv`` rather than
``torch.distributed.pipelining``'s schedule runtime (why: ``docs/runtime.md``). The action
orders are those of its ``Schedule1F1B`` / ``ScheduleGPipe`` (:mod:`lynx.planner.schedule`).

Example (what ``Pipeline`` builds on each rank; see ``lynx/runtime/user_pipeline.py``)::

    runner = StageRunner(stage, topology, RuntimeConfig(schedule="1f1b", microbatches=4),
                         schedule=plan.stage_schedule(topology.stage))
    stats = runner.step(microbatches)     # grads are in the stage's parameters' .grad
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from lynx.errors import LynxConfigError, LynxError, LynxRuntimeError
from lynx.runtime.data_parallel import AllReduceSync, BucketedSync, BucketLauncher, syncs_own_buckets
from lynx.runtime.faults import FaultMonitor, PeerTimeoutError
from lynx.runtime.p2p import ACT, FLAGS, GRAD, Pollable, boundary_meta, post_recv, post_send
from lynx.planner.schedule import recv_window_id, stage_actions, window_place
from lynx.runtime.stats import StepStats
from lynx.runtime.step import InFlight, as_received, backward_step, forward_step, needs_grad
from lynx.runtime.topology import Topology

__all__ = ["RuntimeConfig", "StageRunner"]


class RuntimeConfig(BaseModel):
    """How the runtime executes a step (validated at the boundary)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: str = Field("1f1b", pattern="^(1f1b|gpipe)$")
    microbatches: int = Field(4, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    loss_scale: float = 1.0
    bucket_bytes: int = Field(1 << 20, gt=0)
    prefetch: bool = True          # False: ignore the plan's windows (everything on demand)
    trace: bool = False            # record (what, microbatch, start s, end s) per action in StepStats.events


@dataclass
class _StepState:
    """What one step's schedule has in flight: posted receives and sends, forwards awaiting backward."""

    stats: StepStats
    start: float
    first: bool
    last: bool
    act_recv: dict[int, tuple[list, list]] = field(default_factory=dict)
    grad_recv: dict[int, tuple[list, list]] = field(default_factory=dict)
    flights: dict[int, InFlight] = field(default_factory=dict)
    sends: list[tuple[list, list]] = field(default_factory=list)
    # an activation send holds its tensors: it is dropped once that microbatch's gradient is
    # back (the peer has used it), so a stage holds no more than the plan counts
    act_sends: dict[int, tuple[list, list]] = field(default_factory=dict)
    flag_recv: Any = None  # (buffer, works) of the boundary flags, until they arrive


class StageRunner:
    """Runs one stage of the pipeline on this rank (see module docstring)."""

    def __init__(self, stage: Any, topology: Topology, config: RuntimeConfig, *, schedule: Any = None,
                 optimizer: Any = None, tied: Mapping[str, Any] | None = None) -> None:
        if stage.index != topology.stage:
            raise LynxConfigError(f"rank {topology.rank} runs stage {topology.stage} but was given stage {stage.index}")
        self.stage, self.topo, self.config = stage, topology, config
        self.monitor = FaultMonitor(topology.store, rank=topology.rank, world_size=topology.world,
                                    timeout_s=config.timeout_s)
        self.device = next((p.device for p in stage.parameters()), torch.device("cpu"))
        self.recv_meta = boundary_meta(stage.gm, stage.spec.recv)
        self.send_meta = boundary_meta(stage.gm, stage.spec.send)
        self.send_flags: list[bool] | None = None   # which sent values need a gradient back
        self.recv_flags: list[bool] | None = None
        self._windows = self._index_windows(schedule)
        self._t0 = time.perf_counter()
        self.optimizer = optimizer
        params = [p for p in stage.parameters() if p.requires_grad]
        # parameters in the order their final gradients appear (last used in forward first)
        self.params = list(reversed(params))
        self.tied = dict(tied or {})  # param name -> process group of the stages sharing it
        tied_ids = {id(p) for n, p in stage.gm.named_parameters() if n in self.tied}
        self.sync: BucketedSync | None = None
        self.launcher: BucketLauncher | None = None
        if topology.dp > 1:
            self.sync = optimizer if syncs_own_buckets(optimizer) else AllReduceSync(
                self.params, topology.dp_group, config.bucket_bytes)
            # buckets holding tied weights wait for the tied sum at the end (launched by finish)
            held = {self.sync.bucket_of(p) for p in self.params if id(p) in tied_ids}
            self.launcher = BucketLauncher(self.sync, self.params, hold_buckets=held)
            if hasattr(stage, "on_param_grad"):
                # the backward graph accumulates each parameter gradient as soon as it is final,
                # so buckets launch while the rest of the backward graph still runs
                stage.on_param_grad = self.launcher.param_ready

    # ------------------------------------------------------------------ windows
    def _index_windows(self, schedule: Any) -> dict[str, list[tuple[int, list[str]]]]:
        """window id -> [(microbatch served, nodes)] for windows this runner anchors."""
        if schedule is None or not self.config.prefetch:
            return {}
        windows: dict[str, list[tuple[int, list[str]]]] = {}
        s = self.topo.stage
        # forward order: a node recomputed before a dropped input it reads would recompute that
        # input on the way, release it, and a later entry for it would recompute it again
        position = {name: k for k, name in enumerate(self.stage.spec.nodes)}
        for j, entries in schedule.prefetch.items():
            for wid, nodes in entries:
                device, kind = window_place(wid)
                if kind in ("tp_allreduce", "dp_collective"):
                    continue  # served on demand while those collectives run
                if device != s:
                    wid = recv_window_id(s, "recv_grad", j)  # unknown anchor: just before B(j)
                windows.setdefault(wid, []).append((int(j), sorted(nodes, key=lambda n: position.get(n, -1))))
        return windows

    def _wait(self, work: Any, what: str, peer: int | None) -> float:
        """The monitor's bounded wait, but blocking on a :class:`Pollable`'s completion event in
        slices instead of the monitor's sleep-polling, so a receive on the critical path is
        picked up at once (the monitor polls every 2 ms: ~1 ms lost per message on average)."""
        start = time.monotonic()
        if isinstance(work, Pollable):
            slice_s = min(self.monitor.check_every_s, 0.05)
            while not work.block(slice_s):
                self.monitor.check()
                if time.monotonic() - start > self.monitor.timeout_s:
                    who = f" from rank {peer}" if peer is not None else ""
                    raise PeerTimeoutError(
                        f"rank {self.topo.rank}: {what}{who} did not complete within {self.monitor.timeout_s:g} s "
                        "and no rank reported an error; a peer may be hung or the link down (raise timeout_s "
                        "if links are slow)")
        return time.monotonic() - start + self.monitor.wait(work, what, peer)

    def _mark(self, stats: StepStats, what: str, j: int, t0: float) -> None:
        if self.config.trace:
            # absolute perf_counter (CLOCK_MONOTONIC on Linux): comparable across the ranks of a machine
            stats.events.append((what, j, t0, time.perf_counter()))

    def _run_window(self, wid: str, works: Sequence[Any], stats: StepStats) -> None:
        """Run the recompute graph of each microbatch this window serves (one generated call each).

        Time spent while the awaited message was still in flight counts as hidden, the rest
        (the message had arrived, or nothing is awaited) as exposed."""
        for j, nodes in self._windows.get(wid, ()):
            if not self.stage.forward_done(j):
                continue  # its forward has not run here (another schedule's window): on demand instead
            arrived = all(w.is_completed() for w in works)
            start = time.perf_counter()
            self.stage.recompute(j, nodes)
            elapsed = time.perf_counter() - start
            self._mark(stats, "R" if (works and not arrived) else "Rx", j, start)
            if arrived or not works:
                stats.recompute_window_exposed_s += elapsed
            else:
                stats.recompute_hidden_s += elapsed

    # --------------------------------------------------------------------- step
    def step(self, microbatches: Sequence[Mapping[str, torch.Tensor]]) -> StepStats:
        """Forward and backward all ``microbatches`` of this data-parallel replica."""
        try:
            return self._step(microbatches)
        except BaseException as err:
            if not isinstance(err, LynxError):  # e.g. gloo "connection closed": did a peer fail?
                try:
                    self.monitor.check()
                except LynxRuntimeError as peer:
                    self.monitor.report(peer)
                    raise peer from err
            self.monitor.report(err)
            raise

    def _step(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> StepStats:
        m, topo = self.config.microbatches, self.topo
        if len(batches) != m:
            raise LynxConfigError(f"step() got {len(batches)} microbatches, the runtime is configured for {m}")
        state = self._begin_step()
        for action in stage_actions(self.config.schedule, stage=topo.stage, stages=topo.pp, microbatches=m):
            if action.kind == "F":
                self._forward(state, action.microbatch, batches)
            else:
                self._backward(state, action.microbatch)
        return self._finish_step(state)

    def _begin_step(self) -> _StepState:
        """Reset gradients and peaks; post the first activation receive (and the boundary flags')."""
        topo = self.topo
        self.monitor.check()
        stats = StepStats(rank=topo.rank, stage=topo.stage, dp_rank=topo.dp_rank)
        for p in self.params:
            p.grad = None
        self.stage.meter.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = self._t0 = time.perf_counter()
        self._mark(stats, "start", -1, start)
        state = _StepState(stats=stats, start=start, first=topo.stage == 0, last=topo.stage == topo.pp - 1)
        if not state.first and self.recv_flags is None:
            state.flag_recv = _recv_flags(len(self.recv_meta), topo.prev_rank, self.device)
        if not state.first:
            state.act_recv[0] = post_recv(self.recv_meta, topo.prev_rank, 0, ACT, self.device)
        return state

    def _forward(self, state: _StepState, j: int, batches: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """F(j): the activation window, wait, the forward graph, send the output on."""
        topo, stats, m = self.topo, state.stats, self.config.microbatches
        received: list[torch.Tensor] = []
        if not state.first:
            buffers, works = state.act_recv.pop(j)
            self._run_window(recv_window_id(topo.stage, "recv_act", j), works, stats)
            t0 = time.perf_counter()
            for w in works:
                stats.wait_act_s += self._wait(w, f"activation receive of microbatch {j}", topo.prev_rank)
            self._mark(stats, "wait_act", j, t0)
            if state.flag_recv is not None:
                for w in state.flag_recv[1]:
                    self._wait(w, "boundary flags receive", topo.prev_rank)
                self.recv_flags = [bool(v) for v in state.flag_recv[0].tolist()]
                state.flag_recv = None
            received = as_received(buffers, self.recv_flags)
            if j + 1 < m:
                state.act_recv[j + 1] = post_recv(self.recv_meta, topo.prev_rank, j + 1, ACT, self.device)
        t0 = time.perf_counter()
        flight = forward_step(self.stage, j, _to(batches[j], self.device), received)
        stats.forward_s += time.perf_counter() - t0
        self._mark(stats, "F", j, t0)
        state.flights[j] = flight
        if state.last:
            stats.losses.append(float(flight.output.detach()))
            return
        if self.send_flags is None:
            self.send_flags = [needs_grad(o) for o in flight.output]
            flags = torch.tensor(self.send_flags, dtype=torch.uint8, device=self.device)
            state.sends.append(post_send([flags], topo.next_rank, 0, FLAGS))
        state.act_sends[j] = post_send(list(flight.output), topo.next_rank, j, ACT)
        state.grad_recv[j] = post_recv(self.send_meta, topo.next_rank, j, GRAD, self.device, only=self.send_flags)

    def _backward(self, state: _StepState, j: int) -> None:
        """B(j): the gradient window, wait, the backward graph (on-demand recompute inside), send."""
        topo, stats, stage = self.topo, state.stats, self.stage
        buffers, works = state.grad_recv.pop(j) if not state.last else ([], [])
        self._run_window(recv_window_id(topo.stage, "recv_grad", j), works, stats)
        t0 = time.perf_counter()
        for w in works:
            stats.wait_grad_s += self._wait(w, f"gradient receive of microbatch {j}", topo.next_rank)
        self._mark(stats, "wait_grad", j, t0)
        sent = state.act_sends.pop(j, None)
        if sent is not None:
            for w in sent[0]:
                self._wait(w, "send", None)
            del sent
        is_last_backward = j == self.config.microbatches - 1
        if is_last_backward and self.launcher is not None:
            self.launcher.arm()
        t0 = time.perf_counter()
        in_grads = backward_step(stage, j, state.flights.pop(j), buffers, self.config.loss_scale)
        stats.backward_s += time.perf_counter() - t0
        self._mark(stats, "B", j, t0)
        if self.launcher is not None:
            self.launcher.disarm()
        mb = stage.release(j)
        stats.recompute_on_demand_s += mb.on_demand_s
        if is_last_backward and self.sync is not None:
            stats.recompute_on_demand_dp_s += mb.on_demand_s
        if not state.first:
            payload = [(g if g is not None else torch.zeros(meta.shape, dtype=meta.dtype, device=self.device))
                       if flag else None
                       for g, flag, meta in zip(in_grads, self.recv_flags or [], self.recv_meta)]
            state.sends.append(post_send(payload, topo.prev_rank, j, GRAD))

    def _finish_step(self, state: _StepState) -> StepStats:
        """Wait for the sends, synchronise tied weights and data-parallel gradients, step the optimizer."""
        stats, stage = state.stats, self.stage
        t0 = time.perf_counter()
        for works, _payload in [*state.sends, *state.act_sends.values()]:
            for w in works:
                self._wait(w, "send", None)
        self._sync_tied()
        if self.sync is not None:
            wait = self.monitor.wait
            if isinstance(self.sync, AllReduceSync):
                self.sync.finish(wait)
                if self.optimizer is not None:
                    self.optimizer.step()
            else:
                self.optimizer.step()  # the compressed optimizer finishes its collectives and updates
        elif self.optimizer is not None:
            self.optimizer.step()
        stats.wait_sync_s += time.perf_counter() - t0
        self._mark(stats, "sync", -1, t0)
        stats.step_s = time.perf_counter() - state.start
        stats.peak_saved_bytes = stage.meter.peak_by.get("stage", 0)
        stats.peak_held_bytes = stage.meter.peak_bytes
        if self.device.type == "cuda":
            stats.cuda_max_memory_allocated = int(torch.cuda.max_memory_allocated(self.device))
        return stats

    def close(self) -> None:
        """Remove the gradient hooks this runner installed."""
        if self.launcher is not None:
            self.launcher.remove()
            self.launcher = None
            if getattr(self.stage, "on_param_grad", None) is not None:
                self.stage.on_param_grad = None

    def _sync_tied(self) -> None:
        import torch.distributed as dist

        for name, p in self.stage.gm.named_parameters():
            group = self.tied.get(name)
            if group is None:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.monitor.wait(dist.all_reduce(p.grad, group=group, async_op=True), f"tied-weight sum of {name}")


def _to(batch: Mapping[str, torch.Tensor], device: torch.device) -> Mapping[str, torch.Tensor]:
    """The microbatch's tensors on the stage's device (the same dict when they already are)."""
    if all(not isinstance(v, torch.Tensor) or v.device == device for v in batch.values()):
        return batch
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _recv_flags(n: int, peer: int, device: torch.device) -> tuple[torch.Tensor, list[Any]]:
    """Receive the boundary's requires-grad flags, on the stage's device (NCCL refuses CPU tensors)."""
    import torch.distributed as dist

    from lynx.runtime.p2p import Pollable, tag

    buf = torch.empty(n, dtype=torch.uint8, device=device)
    return buf, [Pollable(dist.irecv(buf, peer, tag=tag(0, FLAGS)))]
