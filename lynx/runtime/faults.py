"""Failure detection: a rank that raises makes every other rank stop with its name, in bounded time.

A rank whose step raises records ``(rank, message)`` in the job's ``torch.distributed`` store
(:meth:`FaultMonitor.report`) before it exits. Every wait on a send, receive or collective goes
through :meth:`FaultMonitor.wait`, which polls the work and the store: when another rank has
reported, it raises :class:`~lynx.errors.LynxRuntimeError` naming that rank and its error;
when nothing completes within ``timeout_s`` it raises one naming the peer and the operation
it was waiting for. No rank hangs silently.

Example::

    >>> import datetime, torch.distributed as dist
    >>> store = dist.HashStore()
    >>> monitor = FaultMonitor(store, rank=0, world_size=2, timeout_s=1.0)
    >>> FaultMonitor(store, rank=1, world_size=2).report(ValueError("boom"))
    >>> try:
    ...     monitor.check()
    ... except LynxRuntimeError as e:
    ...     print(str(e).splitlines()[0])
    rank 1 failed: ValueError: boom
"""

from __future__ import annotations

import time
from typing import Any

from lynx.errors import LynxRuntimeError

__all__ = ["FaultMonitor", "RankFailedError", "PeerTimeoutError"]

_COUNT = "lynx/failures"
_POLL_S = 0.002


class RankFailedError(LynxRuntimeError):
    """Another rank raised; this rank stopped because of it."""

    def __init__(self, rank: int, message: str, *, seen_by: int) -> None:
        super().__init__(f"rank {rank} failed: {message}\n  (rank {seen_by} stopped because of it)")
        self.failed_rank = rank


class PeerTimeoutError(LynxRuntimeError):
    """Nothing arrived within the timeout and no rank reported a failure."""


class FaultMonitor:
    """Shares failures through the store and bounds every wait (see module docstring)."""

    def __init__(self, store: Any, *, rank: int, world_size: int, timeout_s: float = 60.0,
                 check_every_s: float = 0.05) -> None:
        if timeout_s <= 0:
            raise LynxRuntimeError(f"timeout_s must be > 0, got {timeout_s}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = float(timeout_s)
        self.check_every_s = float(check_every_s)
        self._last_check = 0.0

    def report(self, error: BaseException) -> None:
        """Record that this rank failed with ``error`` (best effort: never raises)."""
        message = f"{type(error).__name__}: {error}".strip()[:2000]
        try:
            self.store.set(f"lynx/failed/{self.rank}", message)
            self.store.add(_COUNT, 1)
        except Exception:  # noqa: BLE001 - the store itself may be gone; nothing more to do
            pass

    def check(self) -> None:
        """Raise :class:`RankFailedError` if any other rank has reported a failure."""
        self._last_check = time.monotonic()
        try:
            if int(self.store.add(_COUNT, 0)) == 0:
                return
            for r in range(self.world_size):
                key = f"lynx/failed/{r}"
                if r != self.rank and self.store.check([key]):
                    raise RankFailedError(r, self.store.get(key).decode(errors="replace"), seen_by=self.rank)
        except LynxRuntimeError:
            raise
        except Exception as err:  # noqa: BLE001
            raise LynxRuntimeError(
                f"rank {self.rank} lost contact with the job's store ({err}); rank 0, which hosts it, "
                "has probably died — see its error") from err

    def wait(self, work: Any, what: str, peer: int | None = None) -> float:
        """Wait for ``work`` (a ``dist.Work`` or None); returns the seconds spent waiting."""
        if work is None:
            return 0.0
        start = time.monotonic()
        while True:
            try:
                done = work.is_completed()
                if done:
                    work.wait()
                    return time.monotonic() - start
            except Exception as err:  # noqa: BLE001 - a broken connection: say who broke it
                self.check()
                raise self.broken(what, peer, err) from err
            now = time.monotonic()
            if now - self._last_check >= self.check_every_s:
                self.check()
            if now - start > self.timeout_s:
                self.check()
                who = f" from rank {peer}" if peer is not None else ""
                raise PeerTimeoutError(
                    f"rank {self.rank}: {what}{who} did not complete within {self.timeout_s:g} s and no rank "
                    f"reported an error; a peer may be hung or the link down (raise timeout_s if links are slow)")
            time.sleep(_POLL_S)

    def broken(self, what: str, peer: int | None, err: BaseException) -> LynxRuntimeError:
        """The error for a wait that failed while no rank had reported one: the peer died silently."""
        if peer is None:
            return LynxRuntimeError(f"rank {self.rank}: {what} failed: {err}")
        return LynxRuntimeError(
            f"rank {self.rank}: {what} with rank {peer} failed ({err}): rank {peer} ended without reporting an "
            f"error (killed, e.g. by the out-of-memory killer or a signal, or its machine went down); see its log")
