"""Offloaded values at run time: copied to host memory after the forward, back before the backward.

A stage whose plan offloads nodes keeps their saved values out of device memory between a
microbatch's forward and its backward. :class:`HostStore` is the stage's side of it (a copy
stream and pinned buffers on CUDA); :class:`OffloadedValues` one microbatch's values on the host.
Copies move whole storages, so values that are views of one storage come back as views of one
storage, with the same dtype, offset, sizes and strides: the backward reads the same bytes it
would have read (gradients bitwise equal).

* **CUDA**: two copy streams, one per direction (the timeline's two lanes,
  :mod:`lynx.planner.copy_lanes`). The D2H copy runs on the store's ``d2h`` stream after the
  forward's kernels, into pinned host memory, and records an event per storage; the device
  storage is released to the caching allocator only once the copy is done (``record_stream``).
  A prefetch allocates on the ``h2d`` stream, waits there for *its own* storages' D2H events
  only (not for every copy-out issued before it: on a stage whose backward follows its forward,
  the last layers' copies are still running when the first layers' prefetches start), copies
  host → device and records an event; the compute stream waits on it right before the first
  reader (:func:`offload_wait`), so the copy runs beside the compute before it.
* **CPU**: the same code path, synchronously: each storage is copied into a separate host
  buffer and the original released (its D2H "event" is None: nothing to wait for); a prefetch
  copies it back into a fresh buffer. The CPU test
  suite exercises every step (memory accounted, gradients bitwise).

The backward graph calls :func:`offload_issue` (start a group's prefetch; its result, one
tensor per slot, holds their device memory from there) and :func:`offload_wait` (before the
group's first reader) — :mod:`lynx.rewrite.emit` places them.

Example::

    >>> import torch
    >>> store = HostStore(torch.device("cpu"))
    >>> base = torch.arange(6.0)
    >>> values = store.offload({3: base[1:4], 4: base.view(2, 3)})
    >>> values.nbytes, values.storages
    (24, 1)
    >>> a, b = values.restore([3, 4])
    >>> same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()   # one storage, as before
    >>> torch.equal(a, base[1:4]) and b.stride() == (3, 1) and same
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HostStore", "OffloadedValues", "offload_put", "offload_issue", "offload_wait"]


@dataclass
class _Slot:
    storage: int      # index into OffloadedValues.host
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class HostStore:
    """A stage's copy machinery: on CUDA a copy stream per direction and a pool of pinned host
    buffers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # one stream per direction: a prefetch must not queue behind copy-outs it does not read
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self._pool: dict[int, list[torch.Tensor]] = {}   # nbytes -> free pinned buffers

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        free = self._pool.get(nbytes)
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def give_back(self, buffers: Iterable[torch.Tensor]) -> None:
        """Host buffers a microbatch no longer needs (its backward ran): reused by later offloads."""
        if not self.cuda:
            return   # (plain host memory: the allocator's)
        for b in buffers:
            self._pool.setdefault(b.numel(), []).append(b)

    def offload(self, values: Mapping[int, torch.Tensor]) -> "OffloadedValues":
        """Copy ``values`` (slot → tensor) to the host, storage by storage; the caller drops its
        references, releasing the device memory (on CUDA once the copy stream is done)."""
        out = OffloadedValues(self)
        for slot, t in values.items():
            out.put(slot, t)
        return out

    def copy_out(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``t``'s whole storage, copied to a host buffer, and the copy's event (None on the
        CPU, where the copy is done on return). On CUDA the copy runs on the ``d2h`` stream,
        after what the current stream has queued; the device memory is reused only after it."""
        raw = _bytes_of(t)
        if not self.cuda:
            return raw.clone(), None   # a separate host buffer; the original is released
        assert self.d2h is not None
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))   # after the kernels making it
        with torch.cuda.stream(self.d2h):
            host = self._host_buffer(raw.numel())
            host.copy_(raw, non_blocking=True)
            raw.record_stream(self.d2h)   # freed for reuse only once this copy is done
            done = torch.cuda.Event()
            done.record(self.d2h)
        return host, done


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclass
class OffloadedValues:
    """One microbatch's offloaded values (see the module docstring)."""

    store: HostStore
    slots: dict[int, _Slot] = field(default_factory=dict)
    host: list[torch.Tensor] = field(default_factory=list)
    copied: list[Any] = field(default_factory=list)   # per host storage: its D2H copy's event (None: done)
    # groups the backward graph prefetches: group id -> (tensors, event or None)
    issued: dict[int, tuple[tuple[torch.Tensor, ...], Any]] = field(default_factory=dict)
    groups: Sequence[Sequence[int]] = ()   # group id -> slots (set by the stage before its backward)
    pending_event: Any = None              # a window prefetch's copies, waited on when the backward starts
    _index: dict[Any, int] = field(default_factory=dict)   # storage key -> index in host

    def put(self, slot: int, t: torch.Tensor, storage: Any = None) -> None:
        """Slot ``slot`` holds ``t``: its storage goes to the host (once per storage). ``storage``
        names it (the lowering knows which slots share one); by default its address, which is
        only safe while every value put is alive (a freed address is reused)."""
        key = ("ptr", t.untyped_storage().data_ptr()) if storage is None else storage
        k = self._index.get(key)
        if k is None:
            k = self._index[key] = len(self.host)
            host, done = self.store.copy_out(t)
            self.host.append(host)
            self.copied.append(done)
        self.slots[slot] = _Slot(k, t.dtype, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host)

    @property
    def storages(self) -> int:
        return len(self.host)

    def restore(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """Device tensors for ``slots`` (copies of their storages brought back; on CUDA
        asynchronously, the event in :attr:`pending_event` / returned by :meth:`restore_async`)."""
        tensors, event = self.restore_async(slots)
        if event is not None:
            self.pending_event = event
        return tensors

    def restore_async(self, slots: Sequence[int]) -> tuple[list[torch.Tensor], Any]:
        store = self.store
        device = store.device
        fresh: dict[int, torch.Tensor] = {}
        event = None
        if store.cuda:
            assert store.h2d is not None
            keys = list(dict.fromkeys(self.slots[s].storage for s in slots))
            with torch.cuda.stream(store.h2d):
                for k in keys:   # back only once out: this storage's copy-out, not every one before it
                    if self.copied[k] is not None:
                        store.h2d.wait_event(self.copied[k])
                    fresh[k] = torch.empty(self.host[k].numel(), dtype=torch.uint8, device=device)
                    fresh[k].copy_(self.host[k], non_blocking=True)
                event = torch.cuda.Event()
                event.record(store.h2d)
            for raw in fresh.values():   # read by the compute stream next: keep it until that is done
                raw.record_stream(torch.cuda.current_stream(device))
        else:
            for s in slots:
                k = self.slots[s].storage
                if k not in fresh:
                    fresh[k] = self.host[k].clone()
        out = []
        for s in slots:
            meta = self.slots[s]
            out.append(torch.empty(0, dtype=meta.dtype, device=device).set_(
                fresh[meta.storage].untyped_storage(), meta.offset, meta.size, meta.stride))
        return out, event

    def begin(self, groups: Sequence[Sequence[int]]) -> None:
        """A backward graph bringing back ``groups`` (group id -> slots) is about to run (each
        graph numbers its groups from 0)."""
        self.groups = groups
        self.issued.clear()

    def wait_pending(self) -> None:
        """The compute stream waits for the window prefetches' copies (CUDA; nothing on CPU)."""
        if self.pending_event is not None:
            torch.cuda.current_stream(self.store.device).wait_event(self.pending_event)
            self.pending_event = None

    def release(self) -> None:
        """The microbatch's backward ran: its host buffers go back to the store (on CUDA a later
        copy-out into one waits for the prefetches read from it: they ran on the other stream)."""
        if self.store.cuda and self.host:
            assert self.store.d2h is not None and self.store.h2d is not None
            self.store.d2h.wait_stream(self.store.h2d)
        self.store.give_back(self.host)
        self.host = []
        self.copied = []
        self.issued.clear()
        self._index.clear()


def offload_put(values: OffloadedValues, slot: int, storage: int, value: torch.Tensor) -> None:
    """A forward-graph node: ``value`` (slot ``slot``, in the lowering's storage ``storage``) was
    just computed; copy its storage to the host."""
    values.put(slot, value, storage)


def offload_issue(values: OffloadedValues, group: int) -> tuple[torch.Tensor, ...]:
    """Start bringing back group ``group``'s slots (a backward-graph node): their device memory
    is held from here."""
    tensors, event = values.restore_async(values.groups[group])
    values.issued[group] = (tuple(tensors), event)
    return tuple(tensors)


def offload_wait(values: OffloadedValues, group: int) -> None:
    """Before group ``group``'s first reader: the compute stream waits for its copies."""
    _, event = values.issued[group]
    if event is not None:
        torch.cuda.current_stream(values.store.device).wait_event(event)
