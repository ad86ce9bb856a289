"""End every rank of a job cleanly when one raises: non-zero exits naming the failed rank.

A training script launched by ``torchrun`` runs its own loop; when one rank raises (in its own
code or inside a step), the others are blocked in a send, receive or collective. The
:class:`~lynx.runtime.faults.FaultMonitor` makes them stop with a
:class:`~lynx.runtime.faults.RankFailedError` once the failed rank has reported to the job's
store. :func:`install_failure_exit` turns an uncaught exception into that protocol:

- the rank whose own error it is writes torchrun's error file (so torchrun's "Root Cause"
  names it), reports to the store, prints ``lynx: rank R failed: ...`` after the traceback,
  waits (at most ``linger_s``) until the other ranks have seen it — it may host the store —
  and leaves with ``os._exit(1)``;
- a rank stopped because of another writes an error file one second later (torchrun picks
  the earliest as the root cause), prints ``lynx: rank R stops: rank F failed: ...`` and
  leaves with ``os._exit(1)`` as well;
- an error every rank raises alike (:class:`~lynx.errors.LynxNonFiniteError`: the ranks agreed
  on it) is printed once, by rank 0, as ``lynx: stopped on every rank: ...``; every rank leaves
  with ``os._exit(1)``.

``os._exit`` skips interpreter teardown: receives posted to a peer that is gone never
complete, and gloo's threads waiting on them would abort the process (SIGABRT, "terminate
called without an active exception") if teardown ran.

Example::

    >>> import sys, torch.distributed as dist
    >>> from lynx.runtime.faults import FaultMonitor
    >>> hook = install_failure_exit(FaultMonitor(dist.HashStore(), rank=0, world_size=1))
    >>> sys.excepthook == hook.excepthook
    True
    >>> hook.remove(); sys.excepthook is hook.previous
    True
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

__all__ = ["FailureExit", "install_failure_exit"]

_STOPPED = "lynx/stopped"


class FailureExit:
    """The installed hook (see module docstring); :meth:`remove` restores the previous one."""

    def __init__(self, monitor: Any, linger_s: float = 3.0) -> None:
        self.monitor, self.linger_s = monitor, linger_s
        self.previous = sys.excepthook

    def excepthook(self, kind: type, error: BaseException, tb: Any) -> None:
        from lynx.runtime.faults import RankFailedError

        from lynx.errors import LynxNonFiniteError

        rank = self.monitor.rank
        try:
            if isinstance(error, LynxNonFiniteError):
                # raised on every rank alike after they compared notes: one message, no waiting
                if rank == 0:
                    _write_error_file(error, tb, offset_s=0)
                    print(f"lynx: stopped on every rank: {type(error).__name__}: {error}", file=sys.stderr,
                          flush=True)
                return
            caused_by_peer = isinstance(error, RankFailedError)
            self.previous(kind, error, tb)
            if caused_by_peer:
                _write_error_file(error, tb, offset_s=1)
                print(f"lynx: rank {rank} stops: {error}", file=sys.stderr, flush=True)
                try:
                    self.monitor.store.add(_STOPPED, 1)
                except Exception:  # noqa: BLE001 - the store may be gone with its host
                    pass
            else:
                _write_error_file(error, tb, offset_s=0)
                self.monitor.report(error)
                print(f"lynx: rank {rank} failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                self._linger()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _linger(self) -> None:
        """Wait until every other rank has seen the failure (this rank may host the store)."""
        others = self.monitor.world_size - 1
        deadline = time.monotonic() + self.linger_s
        while others > 0 and time.monotonic() < deadline:
            try:
                if int(self.monitor.store.add(_STOPPED, 0)) >= others:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.005)

    def remove(self) -> None:
        if sys.excepthook == self.excepthook:
            sys.excepthook = self.previous


def install_failure_exit(monitor: Any, linger_s: float = 3.0) -> FailureExit:
    """Make an uncaught exception end this rank as described in the module docstring."""
    hook = FailureExit(monitor, linger_s)
    sys.excepthook = hook.excepthook
    return hook


def _write_error_file(error: BaseException, tb: Any, offset_s: int) -> None:
    """torchrun's per-rank error file (what ``torch.distributed.elastic``'s ``@record`` writes)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(type(error), error, tb)),
                                      "timestamp": str(int(time.time()) + offset_s)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
