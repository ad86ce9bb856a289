"""One rank of the pipeline: executes its action list, recomputing inside the plan's windows.

:class:`StageRunner` is what :class:`lynx.runtime.Pipeline` drives on each rank. It executes
the rank's list from :func:`lynx.planner.schedule.rank_actions` action by action — the same
list the planner's timeline replays — over this rank's model chunks (one, or ``virtual`` under
interleaved 1F1B): receives are posted where the list posts them, ``R`` runs the recompute
graph of every microbatch the plan put in that window while the awaited message is still in
flight (hidden if it had not arrived when the recompute started, else exposed), ``F`` / ``B``
/ ``I`` wait for their input and run the chunk's generated graphs (whatever was not prefetched
is recomputed on demand inside the backward graph), ``W`` runs a deferred weight-gradient
graph, ``DP`` arms the data-parallel buckets for the next action (on-demand recompute then runs
while they are in flight), ``OPT`` finishes the step. Every wait goes through the
:class:`~lynx.runtime.faults.FaultMonitor`, so a failed peer is named instead of hanging.
The messages themselves (receives posted, sends, the bounded wait) and what a step has in
flight: :mod:`lynx.runtime.rank_messages`, the runner's base class.

Why a loop of its own rather than ``torch.distributed.pipelining``'s schedule runtime:
``docs/runtime.md``. Adding a schedule is adding a generator in :mod:`lynx.planner.schedule`.

Example (what ``Pipeline`` builds on each rank; see ``lynx/runtime/user_pipeline.py``)::

    runner = StageRunner({topology.stage: stage}, topology, RuntimeConfig(schedule="1f1b", microbatches=4),
                         schedule=plan.stage_schedule(topology.stage))
    stats = runner.step(microbatches)     # grads are in the stage's parameters' .grad
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lynx.errors import LynxConfigError, LynxError, LynxRuntimeError
from lynx.planner.schedule import SCHEDULES, Action, Op, rank_actions
from lynx.planner.windows import WindowId
from lynx.rewrite.saved import SavedBytesMeter
from lynx.runtime.data_parallel import AllReduceSync, BucketedSync, BucketLauncher, syncs_own_buckets
from lynx.runtime.faults import FaultMonitor
from lynx.runtime.p2p import boundary_meta
from lynx.runtime.rank_messages import RankMessages, StepState
from lynx.runtime.stats import StepStats
from lynx.runtime.step import as_received, backward_step, forward_step
from lynx.runtime.topology import Topology

__all__ = ["RuntimeConfig", "StageRunner"]



class RuntimeConfig(BaseModel):
    """How the runtime executes a step (validated at the boundary)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: str = "1f1b"
    virtual: int = Field(1, ge=1)  # model chunks per rank (interleaved schedules)
    microbatches: int = Field(4, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    loss_scale: float = 1.0
    bucket_bytes: int = Field(1 << 20, gt=0)
    prefetch: bool = True          # False: ignore the plan's windows (everything on demand)
    trace: bool = False            # record (what, microbatch, start s, end s) per action in StepStats.events
    # B on a chunk with a previous one: send the input gradients before computing the weight
    # gradients (where that holds no more activations: StageModule.defer_weights(unless_held=True))
    send_grads_first: bool = True

    @field_validator("schedule")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in SCHEDULES:
            raise ValueError(f"unknown schedule {value!r}; use {', '.join(SCHEDULES)}")
        return value



class StageRunner(RankMessages):
    """Runs this rank's chunks of the pipeline (see module docstring).

    ``stages``: chunk index → stage module (``Pipeline`` builds them); ``schedule``: the plan's
    :class:`~lynx.plan.StageSchedule` of this rank (its windows), or None."""

    def __init__(self, stages: Mapping[int, Any], topology: Topology, config: RuntimeConfig, *,
                 schedule: Any = None, optimizer: Any = None, tied: Mapping[str, Any] | None = None) -> None:
        self.chunks = dict(sorted(stages.items()))
        self.topo, self.config = topology, config
        expected = [k * topology.pp + topology.stage for k in range(config.virtual)]
        if list(self.chunks) != expected:
            raise LynxConfigError(f"rank {topology.rank} runs chunks {expected} but was given {list(self.chunks)}")
        self.last_chunk = topology.pp * config.virtual - 1
        self.actions: list[Action] = rank_actions(config.schedule, topology.pp, config.microbatches,
                                                  config.virtual)[topology.stage]
        self.monitor = FaultMonitor(topology.store, rank=topology.rank, world_size=topology.world,
                                    timeout_s=config.timeout_s)
        first = next(iter(self.chunks.values()))
        self.device = next((p.device for p in first.parameters()), torch.device("cpu"))
        self.recv_meta = {c: boundary_meta(st.gm, st.spec.recv) for c, st in self.chunks.items()}
        self.send_meta = {c: boundary_meta(st.gm, st.spec.send) for c, st in self.chunks.items()}
        self.send_flags: dict[int, list[bool]] = {}   # chunk -> which sent values need a gradient back
        self.recv_flags: dict[int, list[bool]] = {}
        # the rank's meter over its chunks' (one chunk: the stage's own)
        self.meter = first.meter if len(self.chunks) == 1 else SavedBytesMeter()
        if len(self.chunks) > 1:
            for st in self.chunks.values():
                st.meter.parent = self.meter
        self.node_chunk = {n: c for c, st in self.chunks.items() for n in st.spec.nodes}
        self._windows = self._index_windows(schedule)
        # the receives a window polls (to count its recomputation hidden or exposed); the others
        # are waited on only when needed (see p2p.Pollable)
        self._watched = {(Op.RECV_ACT if a.window.kind == "recv_act" else Op.RECV_GRAD, a.chunk, a.microbatch)
                         for a in self.actions if a.op is Op.RECOMPUTE and a.window in self._windows}
        self._t0 = time.perf_counter()
        # see _backward (settable per step, e.g. to measure both ways in one run); a stage given in
        # place of a StageModule (a baseline) may not split, a tensor-parallel one does not
        self.send_grads_first = config.send_grads_first and topology.tp == 1 and all(
            hasattr(st, "defer_weights") and hasattr(st, "weights_pending") for st in self.chunks.values())
        self.optimizer = optimizer
        params = [p for st in self.chunks.values() for p in st.parameters() if p.requires_grad]
        # parameters in the order their final gradients appear (last used in forward first)
        self.params = list(reversed(list(dict.fromkeys(params))))
        self.tied = dict(tied or {})  # param name -> process group of the stages sharing it
        tied_ids = {id(p) for st in self.chunks.values() for n, p in st.gm.named_parameters() if n in self.tied}
        self.sync: BucketedSync | None = None
        self.launcher: BucketLauncher | None = None
        if topology.dp > 1:
            self.sync = optimizer if syncs_own_buckets(optimizer) else AllReduceSync(
                self.params, topology.dp_group, config.bucket_bytes)
            # buckets holding tied weights wait for the tied sum at the end (launched by finish)
            held = {self.sync.bucket_of(p) for p in self.params if id(p) in tied_ids}
            self.launcher = BucketLauncher(self.sync, self.params, hold_buckets=held)
            for st in self.chunks.values():
                if hasattr(st, "on_param_grad"):
                    # the backward graph accumulates each parameter gradient as soon as it is final,
                    # so buckets launch while the rest of the backward graph still runs
                    st.on_param_grad = self.launcher.param_ready

    # ------------------------------------------------------------------ windows
    def _index_windows(self, schedule: Any) -> dict[WindowId, list[tuple[int, int, list[str], bool]]]:
        """window id -> [(chunk, microbatch served, nodes, offloaded)] for windows this rank's list
        names: the nodes recomputed there, or (offloaded) brought back from host memory there."""
        if schedule is None or not self.config.prefetch:
            return {}
        named = {a.window for a in self.actions if a.op is Op.RECOMPUTE}
        s, interleaved = self.topo.stage, self.config.virtual > 1
        # forward order: a node recomputed before a dropped input it reads would recompute that
        # input on the way, release it, and a later entry for it would recompute it again
        position = {n: k for st in self.chunks.values() for k, n in enumerate(st.spec.nodes)}
        windows: dict[WindowId, list[tuple[int, int, list[str], bool]]] = {}
        served = [(j, wid, nodes, False) for j, entries in schedule.prefetch.items() for wid, nodes in entries]
        served += [(j, wid, nodes, True) for j, entries in getattr(schedule, "offload_prefetch", {}).items()
                   for wid, nodes in entries]
        for j, wid, nodes, offloaded in served:
            if wid.kind in ("tp_allreduce", "dp_collective"):
                continue  # TP: inside the backward graph (lynx.runtime.tp); DP: on demand meanwhile
                # (an offloaded value named there comes back inside the backward graph)
            by_chunk: dict[int, list[str]] = {}
            for n in nodes:
                by_chunk.setdefault(self.node_chunk[n], []).append(n)
            for c, members in by_chunk.items():
                where = wid
                if wid not in named:   # a window this schedule does not have: just before B(j)
                    where = WindowId.recv(s, "recv_grad", int(j), c if interleaved else None)
                windows.setdefault(where, []).append(
                    (c, int(j), sorted(members, key=lambda n: position.get(n, -1)), offloaded))
        return windows

    def _recompute(self, state: StepState, a: Action) -> None:
        """``R``: the recompute graph of each microbatch the window serves (one generated call per
        chunk). Time while the awaited message was still in flight counts as hidden, the rest
        (it had arrived, or nothing is awaited) as exposed."""
        assert a.window is not None, "a recompute action names its window (planner/schedule.py)"
        awaited = (Op.RECV_ACT if a.window.kind == "recv_act" else Op.RECV_GRAD, a.chunk, a.microbatch)
        works = state.recv.get(awaited, ([], []))[1]
        stats = state.stats
        for c, j, nodes, offloaded in self._windows.get(a.window, ()):
            stage = self.chunks[c]
            if not stage.forward_done(j):
                continue  # its forward has not run here (another schedule's window): on demand instead
            if offloaded:   # the prefetch is issued here (on CUDA it runs on the H2D copy stream)
                start = time.perf_counter()
                stage.prefetch(j, nodes)
                stats.offload_prefetch_s += time.perf_counter() - start
                self._mark(stats, self._what("H2D", c), j, start)
                continue
            arrived = all(w.is_completed() for w in works)
            start = time.perf_counter()
            stage.recompute(j, nodes)
            elapsed = time.perf_counter() - start
            self._mark(stats, self._what("R" if (works and not arrived) else "Rx", c), j, start)
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
        m = self.config.microbatches
        if len(batches) != m:
            raise LynxConfigError(f"step() got {len(batches)} microbatches, the runtime is configured for {m}")
        state = self._begin_step()
        run = {Op.FORWARD: lambda a: self._forward(state, a, batches),
               Op.BACKWARD: lambda a: self._backward(state, a), Op.BACKWARD_INPUT: lambda a: self._backward(state, a),
               Op.BACKWARD_WEIGHT: lambda a: self._weight(state, a),
               Op.RECOMPUTE: lambda a: self._recompute(state, a),
               Op.RECV_ACT: lambda a: self._post_recv_act(state, a),
               Op.RECV_GRAD: lambda a: self._post_recv_grad(state, a),
               Op.SEND_ACT: lambda a: self._send_act(state, a), Op.SEND_GRAD: lambda a: self._send_grad(state, a),
               Op.DP_LAUNCH: lambda a: self._arm(state), Op.OPTIMIZER: lambda a: None}
        for action in self.actions:
            run[action.op](action)
            if state.armed and action.is_compute:   # the action DP armed the buckets for is done
                assert self.launcher is not None   # armed only where there is one (_arm)
                self.launcher.disarm()
                state.armed = False
        return self._finish_step(state)

    def _begin_step(self) -> StepState:
        """Reset gradients and peaks."""
        self.monitor.check()
        topo = self.topo
        stats = StepStats(rank=topo.rank, stage=topo.stage, dp_rank=topo.dp_rank, tp_rank=topo.tp_rank)
        for p in self.params:
            p.grad = None
        if self.launcher is not None:
            self.launcher.reset()
        self.meter.reset_peak()
        for st in self.chunks.values():
            st.meter.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = self._t0 = time.perf_counter()
        self._mark(stats, "start", -1, start)
        return StepState(stats=stats, start=start)

    # -------------------------------------------------------------- compute
    def _forward(self, state: StepState, a: Action, batches: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """F: wait for the activation, run the forward graph."""
        c, j, stats = a.chunk, a.microbatch, state.stats
        received: list[torch.Tensor] = []
        if c > 0:
            buffers, works = state.recv.pop((Op.RECV_ACT, c, j))
            t0 = time.perf_counter()
            for w in works:
                stats.wait_act_s += self._wait(w, f"activation receive of microbatch {j}", self._rank_of(c - 1))
            self._mark(stats, self._what("wait_act", c), j, t0)
            if c in state.flag_recv:
                buf, flag_works = state.flag_recv.pop(c)
                for w in flag_works:
                    self._wait(w, "boundary flags receive", self._rank_of(c - 1))
                self.recv_flags[c] = [bool(v) for v in buf.tolist()]
            received = as_received(buffers, self.recv_flags[c])
        t0 = time.perf_counter()
        flight = forward_step(self.chunks[c], j, _to(batches[j], self.device), received)
        stats.forward_s += time.perf_counter() - t0
        self._mark(stats, self._what("F", c), j, t0)
        state.flights[(c, j)] = flight
        if c == self.last_chunk:
            stats.losses.append(float(flight.output.detach()))

    def _backward(self, state: StepState, a: Action) -> None:
        """B (or I): wait for the gradient, run the backward graph (its input-gradient part for
        I); on-demand recompute runs inside it."""
        c, j, stats, stage = a.chunk, a.microbatch, state.stats, self.chunks[a.chunk]
        buffers, works = state.recv.pop((Op.RECV_GRAD, c, j)) if c < self.last_chunk else ([], [])
        t0 = time.perf_counter()
        for w in works:
            stats.wait_grad_s += self._wait(w, f"gradient receive of microbatch {j}", self._rank_of(c + 1))
        self._mark(stats, self._what("wait_grad", c), j, t0)
        sent = state.act_sends.pop((c, j), None)
        if sent is not None:
            for w in sent[0]:
                self._wait(w, f"activation send of microbatch {j}", self._rank_of(c + 1))
            del sent
        t0 = time.perf_counter()
        flight = state.flights.pop((c, j))
        # B on a chunk that sends gradients back: its input-gradient part first, the gradients
        # sent, then its weight part — the previous stage waits for them (the first backward,
        # the cool-down) and no longer for the weight gradients (docs/runtime.md, "Input gradients first")
        first = a.op is Op.BACKWARD and c > 0 and self.send_grads_first
        if a.op is Op.BACKWARD_INPUT:
            stage.defer_weights(j)   # the backward graph computes the input gradients; W the rest
        elif first:
            stage.defer_weights(j, unless_held=True)
        launcher = self.launcher if getattr(stage, "on_param_grad", None) is not None else None
        if launcher is not None and (first or a.op is Op.BACKWARD_INPUT):
            with launcher.mute_hooks():   # the graphs hand each gradient over when final
                in_grads = backward_step(stage, j, flight, buffers, self.config.loss_scale)
        else:
            in_grads = backward_step(stage, j, flight, buffers, self.config.loss_scale)
        if c > 0:
            state.to_send[(c, j)] = in_grads
        if first and stage.weights_pending(j):
            self._send_grad(state, a)
            state.sent_first.add((c, j))
            stage.backward_weight(j)
        stats.backward_s += time.perf_counter() - t0
        self._mark(stats, self._what(a.kind, c), j, t0)
        if a.op is Op.BACKWARD:
            self._release(state, c, j)

    def _weight(self, state: StepState, a: Action) -> None:
        """W: the deferred weight-gradient graph of a microbatch whose I ran."""
        c, j = a.chunk, a.microbatch
        t0 = time.perf_counter()
        self.chunks[c].backward_weight(j)
        state.stats.backward_s += time.perf_counter() - t0
        self._mark(state.stats, self._what("W", c), j, t0)
        self._release(state, c, j)

    def _release(self, state: StepState, c: int, j: int) -> None:
        mb = self.chunks[c].release(j)
        state.stats.recompute_on_demand_s += mb.on_demand_s
        state.stats.recompute_tp_hidden_s += getattr(mb, "tp_hidden_s", 0.0)   # the backward graph's TP windows
        state.stats.recompute_tp_exposed_s += getattr(mb, "tp_exposed_s", 0.0)
        state.stats.offloaded_bytes += mb.offloaded_bytes
        if state.armed and self.sync is not None:
            state.stats.recompute_on_demand_dp_s += mb.on_demand_s

    def _arm(self, state: StepState) -> None:
        if self.launcher is not None:
            self.launcher.arm(reset=False)
            state.armed = True

    def _finish_step(self, state: StepState) -> StepStats:
        """Wait for the sends, synchronise tied weights and data-parallel gradients, step the optimizer."""
        stats = state.stats
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
        stats.peak_saved_bytes = self.meter.peak_by.get("stage", 0)
        stats.peak_held_bytes = self.meter.peak_bytes
        if len(self.chunks) > 1:
            stats.peak_saved_bytes_by_chunk = {c: st.meter.peak_by.get("stage", 0) for c, st in self.chunks.items()}
        if self.device.type == "cuda":
            stats.cuda_max_memory_allocated = int(torch.cuda.max_memory_allocated(self.device))
        return stats

    def close(self) -> None:
        """Remove the gradient hooks this runner installed."""
        if self.launcher is not None:
            self.launcher.remove()
            self.launcher = None
            for st in self.chunks.values():
                if getattr(st, "on_param_grad", None) is not None:
                    st.on_param_grad = None

    def _sync_tied(self) -> None:
        import torch.distributed as dist

        for st in self.chunks.values():
            for name, p in st.gm.named_parameters():
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
