"""What crosses devices and how long it takes: the timeline's communication model.

:class:`CommModel` gives the seconds of a pipeline send, a tensor-parallel all-reduce and a
data-parallel gradient collective as functions of their size, from a hardware spec's links
(α-β ring formulas in :mod:`lynx.planner.cost`); :func:`dp_payload_bytes` is what one rank
contributes to a data-parallel collective under each optimizer.

Example::

    >>> from lynx.planner.comm import CommModel, dp_payload_bytes
    >>> from lynx.planner.hardware import get_hardware
    >>> comm = CommModel.from_hardware(get_hardware("a100-80g"), tp=1, dp=8, optimizer="lion")
    >>> comm.p2p(0), dp_payload_bytes(4096, "adamw", 8), dp_payload_bytes(4096, "lion", 8)
    (0.0, 16384, 512)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lynx.errors import LynxConfigError
from lynx.planner import cost

__all__ = ["CommModel", "dp_payload_bytes"]


@dataclass(frozen=True)
class CommModel:
    """Communication times used by the timeline (seconds as a function of bytes)."""

    p2p: Callable[[int], float]
    tp_allreduce: Callable[[int], float]
    dp_gradients: Callable[[int], float]   # argument: parameter count of the bucket

    @staticmethod
    def free() -> "CommModel":
        """Instant communication (for closed-form checks)."""
        return CommModel(p2p=lambda n: 0.0, tp_allreduce=lambda n: 0.0, dp_gradients=lambda n: 0.0)

    @staticmethod
    def from_hardware(hardware: Any, *, tp: int, dp: int, optimizer: str) -> "CommModel":
        """α-β times from ``hardware.links`` via :mod:`lynx.planner.cost`; DP payload by optimizer."""
        pp_link, tp_link, dp_link = hardware.links["pp"], hardware.links["tp"], hardware.links["dp"]

        def dp_gradients(params: int) -> float:
            if dp <= 1 or params <= 0:
                return 0.0
            payload = dp_payload_bytes(params, optimizer, dp)
            if optimizer == "adamw":
                return cost.allreduce_time(payload, dp, dp_link)
            if optimizer == "demo":
                return cost.allgather_time(payload, dp, dp_link)
            # lion majority vote: all_to_all of packed signs, then all_gather of the voted shard
            return cost.alltoall_time(payload, dp, dp_link) + cost.allgather_time(
                max(1, payload // dp), dp, dp_link)

        return CommModel(
            p2p=lambda n: cost.p2p_time(n, pp_link) if n > 0 else 0.0,
            tp_allreduce=lambda n: cost.allreduce_time(n, tp, tp_link) if tp > 1 and n > 0 else 0.0,
            dp_gradients=dp_gradients,
        )


def dp_payload_bytes(params: int, optimizer: str, world: int) -> int:
    """Bytes one rank contributes to a bucket's data-parallel collective.

    ``adamw``: fp32 gradients (ring all-reduce). ``demo``: top-32 DCT coefficients of every
    64×64 chunk, a 2-byte index and a bf16 value each, all-gathered (4096 params → 128 B).
    ``lion``: one sign bit per parameter (packed 8 per byte), exchanged all-to-all.
    (The optimizers in :mod:`lynx.optim` count their real wire bytes per step; this is the
    planner's per-parameter approximation of the same payloads.)
    """
    if optimizer == "adamw":
        return 4 * params
    if optimizer == "demo":
        return max(1, -(-params // 4096)) * 32 * (2 + 2)
    if optimizer == "lion":
        return max(1, -(-params // 8))
    raise LynxConfigError(f"unknown optimizer {optimizer!r}; use adamw, demo or lion")
