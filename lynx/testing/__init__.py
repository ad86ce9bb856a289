"""Test harness: worlds of processes on this machine, token batches, hand-made plans, a reference.

Everything here runs plans through :class:`lynx.runtime.Pipeline` (the one driver) or checks it:
:func:`spawn_world` starts ``world`` local processes joined in one process group and runs a
function on each (a failure is reported to the job's store, so the others stop naming it);
:class:`TokenBatches` gives reproducible token batches per step; :func:`with_stages` turns
hand-made drop sets and windows into a plan ``Pipeline`` runs; :func:`run_local` is the
single-process reference executor (every stage in one process, in its schedule's order).
Nothing in ``lynx/`` outside this package imports it (``tests/test_layout.py``).

Example::

    >>> from lynx.testing import TokenBatches
    >>> idx, targets = TokenBatches(vocab=16, batch=2, seq=4)(step=0, dp=1, microbatches=3)
    >>> tuple(idx.shape), bool((targets[:, :-1] == idx[:, 1:]).all())
    ((6, 4), True)
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "spawn_world": "lynx.testing.world",
    "InjectedFailure": "lynx.testing.world",
    "preload": "lynx.testing.world",
    "TokenBatches": "lynx.testing.data",
    "with_stages": "lynx.testing.plans",
    "captured_with_plan": "lynx.testing.plans",
    "run_local": "lynx.testing.reference",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lynx.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
