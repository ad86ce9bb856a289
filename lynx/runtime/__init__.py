"""Runtime: execute planned stages, recomputing inside communication windows.

``Pipeline`` is the user-facing API: your own loop, optimizer and data under ``torchrun``
(``docs/train_your_model.md``). ``run_local`` runs every stage in one process (the reference);
``PipelineRunner`` runs one stage per rank over ``torch.distributed`` (gloo or NCCL) with 1F1B or GPipe, posting each
gradient receive, running the plan's window recomputation while it is in flight, then
waiting and running backward; data parallelism over a ``(pp, dp)`` device mesh. See
``docs/runtime.md``.

Example::

    >>> from lynx.runtime import stage_actions
    >>> [str(a) for a in stage_actions("gpipe", stage=1, stages=2, microbatches=2)]
    ['F0', 'F1', 'B0', 'B1']
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ScheduledAction": "lynx.planner.schedule",
    "stage_actions": "lynx.planner.schedule",
    "max_in_flight": "lynx.planner.schedule",
    "run_local": "lynx.runtime.local",
    "InFlight": "lynx.runtime.step",
    "forward_step": "lynx.runtime.step",
    "backward_step": "lynx.runtime.step",
    "Pipeline": "lynx.runtime.user_pipeline",
    "PipelineRunner": "lynx.runtime.pipeline",
    "RuntimeConfig": "lynx.runtime.pipeline",
    "Topology": "lynx.runtime.topology",
    "make_topology": "lynx.runtime.topology",
    "AllReduceSync": "lynx.runtime.data_parallel",
    "BucketLauncher": "lynx.runtime.data_parallel",
    "FaultMonitor": "lynx.runtime.faults",
    "RankFailedError": "lynx.runtime.faults",
    "PeerTimeoutError": "lynx.runtime.faults",
    "StepStats": "lynx.runtime.stats",
    "format_stats": "lynx.runtime.stats",
    "WorkerSpec": "lynx.runtime.launch",
    "RankResult": "lynx.runtime.launch",
    "TokenBatches": "lynx.runtime.launch",
    "run_rank": "lynx.runtime.launch",
    "spawn": "lynx.runtime.launch",
    "RankTrainer": "lynx.runtime.trainer",
    "save_checkpoint": "lynx.runtime.checkpoint",
    "load_checkpoint": "lynx.runtime.checkpoint",
    "latest_checkpoint": "lynx.runtime.checkpoint",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lynx.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
