"""``lynx.runtime.Pipeline``: train a compiled model across processes from your own loop.

In the conventions of ``torch.distributed.pipelining`` (a stage, a schedule, ``step`` over the
whole batch) and torchtitan: the script is launched by ``torchrun``, one process per device;
every process compiles the same model (same seed) and builds a :class:`Pipeline`, which joins
the job — the process group (NCCL on CUDA, gloo otherwise), the ``(pp, dp)`` device mesh and
this rank's pipeline stage with the plan applied. The loop, optimizer, data and learning-rate
schedule stay the user's::

    compiled = lynx.compile(model, example_inputs, pp=2, microbatches=4, memory_budget="20GiB")
    pipe = lynx.runtime.Pipeline(compiled)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    for batch in loader:                 # the whole step's batch: dp × microbatches microbatches
        loss = pipe.step(*batch)         # 1F1B with the plan's windows; mean loss, on every rank
        opt.step(); opt.zero_grad()
    pipe.close()

Conventions (see ``docs/train_your_model.md``):

- **Data.** ``step(*inputs, target=None, **inputs_by_name)`` takes what ``forward`` takes,
  for the whole step: ``dp × microbatches × b`` rows along dim 0 where ``b`` is the example
  inputs' first dimension. Replica ``d`` trains rows ``[d·m·b, (d+1)·m·b)``, ``b`` rows per
  microbatch, copied into the example inputs' layout. Every rank may get the same objects;
  an input a rank's stage does not read may be ``None`` there.
- **Loss.** ``loss_fn(output, *targets)`` when given (``target``: a tensor or a tuple of
  tensors, split like the inputs), else what :attr:`lynx.Compiled.loss` found in the output:
  a scalar, ``.loss``, or the first scalar of a tuple.
- **Gradients** are the mean over the step's microbatches and replicas (each microbatch's
  loss scaled by 1/m, then averaged over ``dp``, as ``torch.distributed.pipelining``'s
  ``scale_grads=True`` and DDP): the gradient of the mean microbatch loss, i.e. of the whole
  batch's loss when the loss is a mean over equal microbatches. ``step`` replaces ``.grad``.
- **Returned loss**: the mean of the ``dp × m`` microbatch losses (float32, microbatch order),
  the same value on every rank.
- **Random numbers**: each rank's stage draws (dropout) from a stream of its own, seeded
  ``seed + 1009·replica + stage`` and swapped in around ``step`` (:mod:`lynx.runtime.rank_rng`):
  your own random state is neither used nor advanced by a step.
- **Non-finite values**: a NaN or infinite loss or gradient stops the step on every rank with
  one :class:`~lynx.errors.LynxNonFiniteError` naming the step, the ranks and what was
  non-finite (before any optimizer sees it); with ``skip_nonfinite=True`` the step is reported
  instead (``pipe.last_step_skipped``, ``pipe.skipped_steps``) for your loop to skip.
- **Checkpoints**: :meth:`Pipeline.state_dict` / :meth:`Pipeline.load_state_dict` hold this rank's stage under
  the model's own parameter names, its random stream and its step count; save them with
  :func:`lynx.runtime.checkpoint.save_state` (nothing unpickled on load); what they hold:
  :mod:`lynx.runtime.pipe_state`.
- **Failures**: an uncaught exception on any rank ends every rank with exit status 1 and a
  message naming the failed rank (:mod:`lynx.runtime.failure_exit`).
- **Tracing**: every rank traces and partitions its stage's graphs when the pipeline is built,
  the ranks side by side (:mod:`lynx.runtime.prelower`), not each after the previous stage's
  first forward.

What the pipeline hands its runner in place of your objects (the last stage with its loss, an
optimizer whose ``step()`` your loop calls): :mod:`lynx.runtime.pipeline_adapters`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from lynx.errors import LynxConfigError
from lynx.runtime import nonfinite, pipe_state
from lynx.runtime.batching import (
    bind_inputs,
    check_batch,
    check_indices,
    check_microbatch,
    index_limits,
    match_layout,
    split_rows,
)
from lynx.runtime.executable import check_executable
from lynx.runtime.job import check_runnable, check_same_everywhere, join_job
from lynx.runtime.p2p import Pollable
from lynx.runtime.prelower import lower_chunks
from lynx.runtime.pipeline_adapters import LossStage, StepByUser
from lynx.runtime.data_parallel import syncs_own_buckets
from lynx.runtime.runner import RuntimeConfig, StageRunner
from lynx.runtime.rank_rng import RankRNG
from lynx.runtime.stats import StepStats
from lynx.runtime.topology import make_topology, rank_device, tied_groups
from lynx.runtime.tp import tp_window_schedule

if TYPE_CHECKING:
    from lynx.rewrite.stage import StageModule

__all__ = ["Pipeline"]


class Pipeline:
    """This rank's stage of ``compiled``, trained one step at a time (see module docstring).

    Args:
        compiled: the result of :func:`lynx.compile` (the same model and plan on every rank).
        loss_fn: ``loss_fn(output, *targets) -> scalar``; default: the loss in the output.
        timeout_s: how long a rank waits for a peer before naming it.
        prefetch: run the plan's window recomputation (False: everything on demand).
        exit_on_error: install :mod:`lynx.runtime.failure_exit` (torchrun scripts).
        trace: record every action's start and end in ``last_stats.events`` (see ``docs/runtime.md``).
        bucket_bytes: size of a data-parallel gradient bucket.
        stage: a module to run as this rank's stage instead of ``compiled.stage(i)``, with the
            same boundary (``spec``) and :class:`~lynx.rewrite.stage.StageModule`'s methods —
            e.g. a baseline to measure against (``benchmarks/overlap_cpu.py``).
        seed: the random streams' seed (:mod:`lynx.runtime.rank_rng`).
        skip_nonfinite: report a step with a non-finite loss or gradient instead of raising
            (``last_step_skipped``); a Lynx optimizer given to :meth:`use_optimizer` then
            sends its buckets in its ``step()``, after the check, not during the last backward.
        short_slices: on a CPU rank, ask the scheduler for 0.1 ms slices for every thread of
            this process (:mod:`lynx.runtime.sched_slice`: gloo's hand-offs then wait 0.1 ms,
            not a whole slice); False leaves the process as it is.
        pin_cores: on a CPU rank of a tensor-parallel job that fills this host's cores
            evenly, keep the rank's threads on a core of its own (:mod:`lynx.runtime.core_pin`:
            where they sat changed step times by a third from second to second); False
            leaves placement to the scheduler.
    """

    def __init__(self, compiled: Any, loss_fn: Callable[..., Any] | None = None, *, timeout_s: float = 60.0,
                 prefetch: bool = True, exit_on_error: bool = True, trace: bool = False,
                 bucket_bytes: int = 1 << 20, stage: torch.nn.Module | None = None, seed: int = 0,
                 skip_nonfinite: bool = False, short_slices: bool = True, pin_cores: bool = True) -> None:
        from lynx.rewrite.build import build_chunk_modules, chunk_node_lists, split_cached
        from lynx.runtime.loss import LossSpec

        plan, config = compiled.plan, compiled.config
        # before any process group: a plan run approximately is no plan (the stages compile as
        # this compilation says, whatever the plan was made with)
        check_executable({**plan.config, "compile": bool(getattr(config, "compile", False))})
        self.compiled = compiled
        self._loss_stage: LossStage | None = None
        self.loss = (compiled.loss or LossSpec("scalar", "the model's output")).with_loss_fn(loss_fn)
        if self.loss.form is None:
            raise LynxConfigError(f"cannot train: {self.loss.description}")
        pp = len(plan.stages)
        dp, m = int(plan.config.get("dp", config.dp)), int(plan.config.get("microbatches", config.microbatches))
        tp = int(plan.config.get("tp", config.tp))
        if tp > 1 and getattr(compiled, "sharding", None) is None:
            raise LynxConfigError(f"the plan is for tp={tp} but the model was compiled without a sharding plan: "
                                  f"compile it with tp={tp} (lynx.compile(..., tp={tp}, plan=...))")
        self.microbatches = m
        self._own_group = join_job(pp * dp * tp, timeout_s)
        self.topology = topo = make_topology(pp, dp, device_type=rank_device().type, tp=tp)
        check_same_everywhere(plan.fingerprint, self.loss.form)
        captured = compiled.analysis.captured
        self.input_names = list(captured.input_names)
        self._examples = dict(zip(self.input_names, captured.example_inputs))
        self._index_limits = index_limits(captured.gm)   # token ids an embedding or a loss indexes
        schedule = plan.config.get("schedule", "1f1b")
        virtual = int(plan.config.get("virtual_stages", 1)) if schedule == "interleaved1f1b" else 1
        check_runnable(schedule, pp, m, virtual)
        # this rank's model chunks (one, or `virtual` under interleaved 1F1B), by pipeline position;
        # with tp > 1 this TP rank's shards of them
        tp_mesh = topo.tp_mesh if tp > 1 else None
        # a stage given in place of compiled.stage(i) has StageModule's boundary and methods (see Args)
        self.chunks: dict[int, StageModule] = (build_chunk_modules(compiled, topo.stage, tp_mesh=tp_mesh)
                                               if stage is None else {topo.stage: cast("StageModule", stage)})
        self.device = rank_device()
        for chunk in self.chunks.values():
            if any(p.device != self.device for p in chunk.parameters()):
                chunk.to(self.device)   # the user's parameters: the chunk shares them
        self.stage = next(iter(self.chunks.values()))
        last = max(self.chunks)
        driven: dict[int, Any] = dict(self.chunks)   # what the runner drives (StageRunner's stages)
        if self.chunks[last].spec.is_last:
            driven[last] = self._loss_stage = LossStage(self.chunks[last], self.loss)
        parts = split_cached(captured.gm, chunk_node_lists(plan, compiled.analysis.graph))
        names = [set().union(*(part.attr_names for part in parts[s::pp])) for s in range(pp)]
        self.attr_names = names[topo.stage]
        self.tied = tied_groups(topo, names)
        self.runtime = RuntimeConfig(schedule=schedule, virtual=virtual, microbatches=m, timeout_s=timeout_s,
                                     loss_scale=1.0 / m, prefetch=prefetch, trace=trace, bucket_bytes=bucket_bytes)
        self._driven = driven
        self._schedule = plan.stage_schedule(topo.stage)
        if tp > 1 and prefetch:  # the plan's TP windows: run by the backward graph between all-reduce and wait
            for chunk in self.chunks.values():
                chunk.tp_windows = tp_window_schedule(self._schedule, topo.stage)
        self.optimizer: Any = None
        self.runner = self._make_runner()
        if short_slices and self.device.type == "cpu":   # gloo's threads exist now; later ones inherit
            from lynx.runtime.sched_slice import request_short_slices

            request_short_slices()
        if pin_cores and self.device.type == "cpu":   # every thread there is now (gloo's, the runner's)
            from lynx.runtime.core_pin import pin_rank

            pin_rank(tp)
        self._hook = None
        if exit_on_error:
            from lynx.runtime.failure_exit import install_failure_exit

            self._hook = install_failure_exit(self.runner.monitor)
        self.last_stats: StepStats | None = None
        self.losses: list[float] = []   # the last step's microbatch losses, every replica's
        self.rng = RankRNG(seed, topo.stage, topo.dp_rank, self.device)
        self.skip_nonfinite = skip_nonfinite
        self.steps_done = 0             # steps run (a resumed pipe continues the count of its state)
        self.last_step_skipped = False
        self.skipped_steps: list[int] = []   # steps with a non-finite loss or gradient (skip_nonfinite)
        self.last_nonfinite: str | None = None
        if stage is None:   # traced now, every rank at once, not rank after rank in the first step
            lower_chunks(self.chunks, parts, self._examples, self.device)

    # ------------------------------------------------------------------ parts
    def _holder(self) -> torch.nn.Module:
        """One module holding this rank's parameters and buffers under the model's names (its
        chunk's graph module; several chunks' tensors gathered into one)."""
        if len(self.chunks) == 1:
            return self.stage.gm
        import torch.fx as fx

        tensors = {n: t for chunk in self.chunks.values()
                   for n, t in [*chunk.gm.named_parameters(), *chunk.gm.named_buffers()]}
        return fx.GraphModule(tensors, fx.Graph())

    def _make_runner(self) -> StageRunner:
        return StageRunner(self._driven, self.topology, self.runtime, schedule=self._schedule,
                           optimizer=self.optimizer, tied=self.tied)

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def stage_index(self) -> int:
        return self.topology.stage

    @property
    def is_last_stage(self) -> bool:
        return self.topology.stage == self.topology.pp - 1

    @property
    def dp_group(self) -> Any:
        """This rank's data-parallel group (a group of itself alone when dp = 1), e.g. for
        ``lynx.optim.DeMo(..., process_group=pipe.dp_group)``."""
        return self.topology.dp_group if self.topology.dp_group is not None else self.topology.mesh.get_group("dp")

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This stage's trainable parameters (the model's own tensors)."""
        return (p for _, p in self.named_parameters())

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This stage's trainable parameters under the model's own names."""
        seen: set[int] = set()
        for chunk in self.chunks.values():
            for n, p in chunk.gm.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def use_optimizer(self, optimizer: Any) -> None:
        """Let a Lynx data-parallel optimizer (``lynx.optim.DeMo``, ``DistributedLion``) send its
        buckets while the last backward runs, instead of all-reducing gradients first; its
        ``step()`` (yours to call) finishes them. Other optimizers need no call."""
        if not syncs_own_buckets(optimizer):
            raise LynxConfigError(f"use_optimizer takes lynx.optim.DeMo or DistributedLion (optimizers that sync "
                                  f"their own buckets), got {type(optimizer).__name__}; other optimizers need no call")
        self.runner.close()
        self.optimizer = StepByUser(optimizer, launch_early=not self.skip_nonfinite)
        self.runner = self._make_runner()

    # ------------------------------------------------------------------- step
    def step(self, *inputs: Any, target: Any = None, **named: Any) -> torch.Tensor:
        """One training step on the whole batch; returns the mean microbatch loss (every rank)."""
        topo, m = self.topology, self.microbatches
        bound = bind_inputs(self.input_names, inputs, named)
        needed = list(dict.fromkeys(n for chunk in self.chunks.values() for n in chunk.spec.inputs))
        microbatches: list[dict[str, torch.Tensor]] = [{} for _ in range(m)]
        for name in needed:
            if bound.get(name) is None:
                raise LynxConfigError(f"stage {topo.stage} (rank {topo.rank}) reads model input {name!r} but step() "
                                      f"got {'None' if name in bound else 'nothing'} for it")
            example = self._examples[name]
            check_batch(bound[name], name, example, dp=topo.dp, microbatches=m)
            if name in self._index_limits:
                check_indices(bound[name], name, self._index_limits[name])
            for j, part in enumerate(split_rows(bound[name], name, dp=topo.dp, dp_rank=topo.dp_rank, microbatches=m)):
                check_microbatch(part, name, example, dp=topo.dp, microbatches=m)
                microbatches[j][name] = match_layout(part, example, self.device)
        if self._loss_stage is not None:
            self._loss_stage.targets = self._split_targets(target)
        with self.rng.active():
            self.last_stats = stats = self.runner.step(microbatches)
        loss = self._checked_loss(stats)
        self.steps_done += 1
        return loss

    def _split_targets(self, target: Any) -> dict[int, tuple]:
        if target is None:
            return {}   # loss_fn(output) alone, or the loss in the output
        if self.loss.form != "loss_fn":
            raise LynxConfigError(f"step() got target= but no loss_fn uses it ({self.loss.description}); pass "
                                  "loss_fn= to Pipeline, or give the targets as model inputs")
        targets = target if isinstance(target, tuple) else (target,)
        topo, m = self.topology, self.microbatches
        split = [split_rows(t, f"target[{i}]", dp=topo.dp, dp_rank=topo.dp_rank, microbatches=m)
                 if isinstance(t, torch.Tensor) else [t] * m for i, t in enumerate(targets)]
        return {j: tuple(s[j].to(self.device) if isinstance(s[j], torch.Tensor) else s[j] for s in split)
                for j in range(m)}

    def _checked_loss(self, stats: StepStats) -> torch.Tensor:
        """Every replica's microbatch losses on every rank (summed with zeros: exact) and their mean;
        with them, per rank, whether its gradients are finite (:mod:`lynx.runtime.nonfinite`)."""
        topo, m = self.topology, self.microbatches
        grads = [p.grad for _, p in self.named_parameters() if p.grad is not None]
        both = torch.zeros(topo.dp * m + topo.world, dtype=torch.float32, device=self.device)  # (dp·m + world,)
        if stats.losses and topo.tp_rank == 0:   # TP ranks hold the same loss: count it once
            both[topo.dp_rank * m:(topo.dp_rank + 1) * m] = torch.tensor(stats.losses, dtype=torch.float32)
        both[topo.dp * m + topo.rank] = nonfinite.flag(grads).to(self.device)
        if topo.world > 1:
            # blocked on, not sleep-polled (the monitor's 2 ms polls would end every step ~1 ms late)
            self.runner._wait(Pollable(dist.all_reduce(both, async_op=True)), "the step's loss all-reduce", None)
        both = both.cpu()
        losses = both[:topo.dp * m]
        self.losses = losses.tolist()
        self.last_step_skipped, self.last_nonfinite = False, None
        if bool(torch.isfinite(losses).all()) and not bool(both[topo.dp * m:].any()):
            return losses.mean()
        named = [(n, p.grad) for n, p in self.named_parameters() if p.grad is not None]
        found = nonfinite.local_findings([n for n, _ in named], [g for _, g in named], stats.losses,
                                         microbatches=m, replica=topo.dp_rank)
        message = nonfinite.describe_everywhere(self.steps_done, found, topo)
        if not self.skip_nonfinite:
            raise nonfinite.LynxNonFiniteError(
                f"{message}. The step's gradients were not applied. Lower the learning rate (or warm it up), "
                f"check the data, or pass skip_nonfinite=True to skip such steps")
        for p in self.parameters():   # nothing of this step may reach an optimizer
            p.grad = None
        self.last_step_skipped, self.last_nonfinite = True, message
        self.skipped_steps.append(self.steps_done)
        return losses.mean()

    # ------------------------------------------------------------------ state
    def state_dict(self, optimizer: Any = None) -> dict[str, Any]:
        """This stage's tensors by the model's names (and ``optimizer``'s state by the same names),
        for ``torch.distributed.checkpoint.save`` / ``load`` (see module docstring and
        :mod:`lynx.runtime.pipe_state`)."""
        return pipe_state.state_dict(self, optimizer)

    def load_state_dict(self, state: dict[str, Any], optimizer: Any = None) -> None:
        """Put :meth:`state_dict`'s content (e.g. after ``dcp.load``) into the stage and ``optimizer``."""
        pipe_state.load_state_dict(self, state, optimizer)

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Remove hooks; leave the process group (after every rank is done) if this pipe made it."""
        if self.runner is not None:
            self.runner.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._own_group and dist.is_initialized():
            dist.barrier()   # rank 0 hosts the store: nobody tears down while a peer still needs it
            dist.destroy_process_group()
            self._own_group = False

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if kind is None:
            self.close()
