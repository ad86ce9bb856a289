"""The CPU figures that need no captured model, measured in a forked process while this one captures.

Three of a CPU calibration's per-repeat figures depend on nothing the calibration captures:
the cost of an eager op (:func:`lynx.calibrate.cpu.op_overhead_s`, which the node-rate fit
takes off each node's time), the bfloat16 and float16 matmul speed relative to float32's
(:func:`lynx.calibrate.cpu.matmul_dtype_ratios`) and the host link's copies
(:func:`lynx.calibrate.host_copies.memcpy_link`). Timed among the repeats they took ~0.5 s
of each repeat on one core with the other idle, while the capture of the first reference (the
imports of ``torch.export``'s machinery and the capture itself, ~3 s on one core) left the
other core idle as well. :func:`start_standalone` forks a process that times them, every
repeat, right when the captures begin; :func:`standalone_results` takes what it measured
when the repeats need it.

What that changes: these figures are timed beside this process's capture (Python, tracing,
no timed loop) on the other core, not beside an idle core. They are the fastest of several
runs each, in CPU time (the copies in wall time), as before; the eager op costs of all
repeats come first (the node-rate fit uses them), then the copies, then the matmuls (the
longest part: ~0.3 s a repeat where bfloat16 and float16 have no native kernels), and the
copies reuse one pair of buffers. With the profiles cached on disk
(:mod:`lynx.frontend.profile_cache`) the first capture and its imports take ~2.5 s of CPU
instead of ~4.5 (at load 7), about what this process takes: its last matmuls may then run
beside the ranks' preparations, which adds to their CPU time only through the caches they
share (each is the fastest of several runs).

Example (forks one process; ~2 s)::

    >>> from lynx.calibrate.standalone import standalone_results, start_standalone
    >>> with start_standalone(repeats=1) as started:                   # doctest: +SKIP
    ...     (first,) = standalone_results(started)                     # doctest: +SKIP
    >>> 0 < first.eager.seconds < 1e-3 and first.ratios["float32"] == 1.0  # doctest: +SKIP
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lynx.calibrate.repeats import Timing
from lynx.errors import LynxRuntimeError

__all__ = ["Standalone", "start_standalone", "standalone_results"]


@dataclass(frozen=True)
class Standalone:
    """One repeat's figures: an eager op's :class:`~lynx.calibrate.repeats.Timing`, each
    dtype's matmul speed relative to float32's, and the host link's ``alpha_s`` and bytes/s
    each way."""

    eager: Timing
    ratios: dict[str, float]
    host_link: dict[str, float]


def start_standalone(repeats: int, timeout_s: float = 120.0) -> Any:
    """Fork the process that times :class:`Standalone` ``repeats`` times, starting now (a
    :class:`lynx.calibrate.forked.Staged` of one rank that never waits to be let go)."""
    from lynx.calibrate.forked import Staged

    return Staged(_worker, 1, (repeats,), timeout_s)


def standalone_results(started: Any) -> list[Standalone]:
    """What :func:`start_standalone`'s process measured, per repeat."""
    items, missing = started.results()
    result = dict(items).get(0, missing)
    if not isinstance(result, list):
        raise LynxRuntimeError(f"could not time the eager op, the matmul dtypes and the host copies in a forked "
                               f"process: {result}")
    return result


def _worker(rank: int, gate: Any, repeats: int) -> list[Standalone]:
    """Every repeat's eager op first (the node-rate fit uses it), then the dtypes and copies."""
    from lynx.calibrate.cpu import matmul_dtype_ratios, op_overhead_s
    from lynx.calibrate.host_copies import memcpy_links

    torch.set_num_threads(1)
    eager = [op_overhead_s() for _ in range(repeats)]
    copies = memcpy_links(repeats)   # timed in wall time: before the matmuls, the longest part
    ratios = [matmul_dtype_ratios() for _ in range(repeats)]
    return [Standalone(e, r, c) for e, r, c in zip(eager, ratios, copies)]
