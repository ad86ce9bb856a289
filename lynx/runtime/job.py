"""Joining a job: the process group torchrun's environment describes, and what every rank
checks before its first step (:class:`lynx.runtime.Pipeline` calls these in its constructor).

:func:`join_job` starts the process group (NCCL on this rank's GPU, gloo otherwise) unless the
script made one, refusing a world that is not the plan's ``pp × dp × tp``; without torchrun a
plan for one process runs as a world of one. :func:`check_same_everywhere` stops every rank
when one compiled another plan; :func:`check_runnable` refuses a schedule whose receives NCCL
would match to the wrong messages.

    >>> from lynx.runtime.job import join_job
    >>> created = join_job(1, timeout_s=60)   # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import LynxConfigError, LynxFingerprintError
from lynx.runtime.topology import free_port, select_backend

__all__ = ["join_job", "check_runnable", "check_same_everywhere"]


def join_job(world: int, timeout_s: float) -> bool:
    """Join the job's process group (torchrun's environment); True when this call created it."""
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise LynxConfigError(f"the process group has {dist.get_world_size()} ranks but the plan needs "
                                  f"pp × dp × tp = {world}")
        return False
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is None:
        if world != 1:
            raise LynxConfigError(f"this plan runs on pp × dp × tp = {world} processes: launch the script with "
                                  f"`torchrun --nproc_per_node {world} SCRIPT.py` (no torchrun environment found)")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    elif int(env_world) != world:
        raise LynxConfigError(f"{env_world} processes were started but the plan needs pp × dp × tp = {world}: "
                              f"launch `torchrun --nproc_per_node {world}` or compile with pp × dp × tp = {env_world}")
    backend, device = select_backend(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(60.0, timeout_s)))
    return True


def check_runnable(schedule: str, pp: int, microbatches: int, virtual: int) -> None:
    """Refuse a schedule this runtime cannot execute on this backend."""
    from lynx.planner.schedule import link_order_problems, rank_actions

    # schedules not in RUNTIME_SCHEDULES were refused before the process group (check_executable)
    if dist.get_backend() == "nccl":
        problems = link_order_problems(rank_actions(schedule, pp, microbatches, virtual), pp)
        if problems:   # NCCL matches point-to-point messages in posting order, not by tag
            raise LynxConfigError(f"schedule {schedule!r} posts receives out of their senders' order ({problems[0]}"
                                  f"{'; …' if len(problems) > 1 else ''}), which NCCL would match to the wrong "
                                  "messages; run it on gloo or choose 1f1b, gpipe or zbh1")


def check_same_everywhere(fingerprint: str, loss_form: str | None) -> None:
    """Every rank compiled the same plan (and found the same loss): else stop before any step."""
    mine = (fingerprint, loss_form)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        raise LynxFingerprintError(
            f"ranks {differ} compiled another plan than rank 0 (fingerprint, loss: {everyone[differ[0]]} vs "
            f"{everyone[0]}): build the same model with the same seed and settings on every rank")
