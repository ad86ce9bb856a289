"""Run ``fn(rank, world, *args)`` on W gloo processes (:func:`lynx.testing.spawn_world`).

Each worker returns a picklable result; :func:`run_world` returns them per rank. A worker's
exception fails the caller with the worker's message.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from lynx.testing import spawn_world


def _with_rank(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(dist.get_rank(), dist.get_world_size(), *args)


def run_world(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the results by rank."""
    return spawn_world(_with_rank, world, fn, *args, timeout_s=timeout)
