"""Runtime: train a compiled model across processes, recomputing inside communication windows.

:class:`Pipeline` is the one way a plan runs — your own loop, optimizer and data under
``torchrun`` (``docs/train_your_model.md``); ``python -m lynx.runtime.torchrun`` and the
test harness (:mod:`lynx.testing`) drive it too. Underneath, each rank's
:class:`~lynx.runtime.runner.StageRunner` executes its stage's action list over
``torch.distributed`` (gloo or NCCL), posting each receive early and running the plan's window
recomputation while the message is in flight; data parallelism over a ``(pp, dp)`` device
mesh. The names here are what a training script calls; the modules hold the rest. See
``docs/runtime.md``.

Example::

    >>> import lynx.runtime
    >>> sorted(lynx.runtime.__all__)[:4]
    ['PeerTimeoutError', 'Pipeline', 'RankFailedError', 'StepStats']
"""

from __future__ import annotations

import importlib
from typing import Any

from lynx.process_group_guard import bind_before_init

bind_before_init()  # before the script's process group exists: see lynx.process_group_guard

_LAZY = {
    "Pipeline": "lynx.runtime.user_pipeline",
    "StepStats": "lynx.runtime.stats",
    "format_stats": "lynx.runtime.stats",
    "RankFailedError": "lynx.runtime.faults",
    "PeerTimeoutError": "lynx.runtime.faults",
    "save_checkpoint": "lynx.runtime.checkpoint",
    "load_checkpoint": "lynx.runtime.checkpoint",
    "latest_checkpoint": "lynx.runtime.checkpoint",
    "pipeline_state": "lynx.runtime.rank_state",
    "rank_seed": "lynx.runtime.topology",
    "save_state": "lynx.runtime.checkpoint",
    "load_state": "lynx.runtime.checkpoint",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lynx.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
