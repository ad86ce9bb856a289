"""How many bytes a stage holds for backward, per category: live and peak.

The lowering knows, per value a microbatch keeps, which storage it lives in and how many bytes
that storage has (from the joint graph's metadata; each storage counted once, parameters
never). So the meter is arithmetic at graph boundaries — the forward graph adds what it left
behind, a recompute graph what it brought back, the microbatch's release subtracts it all —
with nothing that runs per saved tensor. Categories separate what the plan predicts
(``"stage"``: kept saved values, recomputed values, the values the stage sends) from values
held only to recompute from (``"held"``) and received values a stage saves (``"boundary"``).

Example::

    >>> meter = SavedBytesMeter()
    >>> meter.hold("stage", 16); meter.hold("held", 4)
    >>> meter.live_bytes, meter.peak_by["stage"]
    (20, 16)
    >>> meter.free("stage", 16)
    >>> meter.live_bytes, meter.peak_bytes
    (4, 20)
"""

from __future__ import annotations

import functools
import weakref

import torch

__all__ = ["SavedBytesMeter"]


class SavedBytesMeter:
    """Live and peak bytes held for backward, per category (see module docstring)."""

    def __init__(self, parent: "SavedBytesMeter | None" = None) -> None:
        self.parent = parent   # e.g. the rank's meter over its chunks' (interleaved schedules)
        self.live_by: dict[str, int] = {}
        self.peak_by: dict[str, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._watched: dict[int, tuple[weakref.ref, int, str]] = {}

    def hold(self, category: str, nbytes: int) -> None:
        """``nbytes`` more are resident under ``category``."""
        live = self.live_by[category] = self.live_by.get(category, 0) + nbytes
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if live > self.peak_by.get(category, 0):
            self.peak_by[category] = live
        if self.parent is not None:
            self.parent.hold(category, nbytes)

    def free(self, category: str, nbytes: int) -> None:
        """``nbytes`` under ``category`` were released."""
        self.live_by[category] = self.live_by.get(category, 0) - nbytes
        self.live_bytes -= nbytes
        if self.parent is not None:
            self.parent.free(category, nbytes)

    def add(self, t: torch.Tensor, category: str) -> None:
        """Count ``t``'s storage (once) until it is freed: for executors the lowering does not
        describe, e.g. the ``torch.utils.checkpoint`` baseline of ``benchmarks/overlap_cpu.py``.

        A weak reference on the storage subtracts its bytes when it dies."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self._watched.get(key)
        if entry is not None and entry[0]() is storage:
            return
        nbytes = storage.nbytes()
        self._watched[key] = (weakref.ref(storage, functools.partial(self._expire, key)), nbytes, category)
        self.hold(category, nbytes)

    def _expire(self, key: int, ref: weakref.ref) -> None:
        entry = self._watched.get(key)
        if entry is not None and entry[0] is ref:
            del self._watched[key]
            self.free(entry[2], entry[1])

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_by = dict(self.live_by)
