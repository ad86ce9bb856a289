"""Point-to-point transfer of stage boundary values (activations forward, gradients back).

Shapes and dtypes of what crosses a boundary come from the captured graph (``meta["val"]`` of
each boundary node, one microbatch), so receive buffers are allocated before anything
arrives. Which boundary values need a gradient is learnt once per boundary: the sender's first
activation message is preceded by a one-byte-per-value flag tensor (tag :func:`flags_tag`).
Every other message carries the tag of its kind, boundary and microbatch
(:func:`lynx.planner.schedule.message_tag`), so receives posted early to open windows can
never take another message's place on gloo. NCCL ignores tags and matches in posting order
per pair of ranks; ``Pipeline`` refuses a schedule whose lists would break that order there
(:func:`lynx.planner.schedule.link_order_problems`). Plain ``isend`` / ``irecv`` per tensor
are used rather than ``batch_isend_irecv``: each boundary carries one or a few tensors, and
gloo runs them as separate operations either way.

Example::

    >>> flags_tag(3)
    1073741827
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import LynxRuntimeError

__all__ = ["flags_tag", "BoundaryMeta", "boundary_meta", "post_recv", "post_send", "Pollable"]


def flags_tag(boundary: int) -> int:
    """The tag of the one-off requires-grad flags crossing ``boundary`` (above every message tag)."""
    return (1 << 30) + boundary


class _WaitPool:
    """Daemon threads that block in ``dist.Work.wait()`` on the runtime's behalf.

    A thread whose work completed waits for the next one, and a new thread starts only when
    every thread is busy, so a work never queues behind another (one that completes late cannot
    hold up one the runner waits on). Starting a thread blocks until it runs — milliseconds on
    a loaded core, for each of a step's 16+ messages per rank — so threads are reused.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)   # a forked child has none of the threads

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._idle = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._serve, args=(job,), daemon=True).start()

    def _serve(self, job: Callable[[], None] | None) -> None:
        while job is not None:
            job()
            job = None   # hold nothing of a finished work while idle
            with self._lock:
                self._idle += 1
            job = self._jobs.get()


_WAITERS = _WaitPool()


class Pollable:
    """A ``dist.Work`` whose completion can be polled.

    gloo's send/receive works only learn they are complete inside ``wait()``
    (``is_completed()`` stays False until then), so a pooled daemon thread waits (the GIL is
    released while it blocks) and sets an event; the runtime polls the event while it recomputes.
    Handing a work to that thread costs a thread switch (milliseconds on a loaded core), so
    unless ``watch`` (a window polls it), the hand-over waits until someone first asks —
    usually a rank about to block on it anyway.
    """

    def __init__(self, work: Any, *, watch: bool = True) -> None:
        self._work = work
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._watched = False
        if watch:
            self._watch()

    def _watch(self) -> None:
        if not self._watched:
            self._watched = True
            _WAITERS.submit(self._wait)

    def _wait(self) -> None:
        try:
            self._work.wait()
        except BaseException as err:  # noqa: BLE001 - re-raised by wait()
            self._error = err
        self._done.set()

    def is_completed(self) -> bool:
        self._watch()
        return self._done.is_set()

    def block(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for completion (woken at once when it completes, unlike
        polling with sleeps); never raises — :meth:`wait` reports a failure."""
        self._watch()
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        self._watch()
        finished = self._done.wait(timeout)
        if self._error is not None:
            raise self._error
        return finished


@dataclass(frozen=True)
class BoundaryMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def boundary_meta(stage_gm: Any, names: Sequence[str]) -> list[BoundaryMeta]:
    """Shape and dtype of each boundary value ``names`` of a stage graph (from ``meta['val']``)."""
    vals = {}
    for node in stage_gm.graph.nodes:
        name = node.meta.get("lynx_name", node.name)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            vals[name] = val
    missing = [n for n in names if n not in vals]
    if missing:
        raise LynxRuntimeError(f"no shape known for boundary values {missing}: capture with torch.export "
                               "(symbolic_trace graphs carry no shapes) to run stages across ranks")
    return [BoundaryMeta(n, tuple(int(d) for d in vals[n].shape), vals[n].dtype) for n in names]


def post_recv(metas: Sequence[BoundaryMeta], peer: int, tag: int, device: torch.device,
              only: Sequence[bool] | None = None, watch: bool = True) -> tuple[list[torch.Tensor | None], list[Any]]:
    """Post receives for ``metas`` from ``peer`` (``only`` selects which); returns buffers and works
    (``watch``: see :class:`Pollable`)."""
    buffers: list[torch.Tensor | None] = []
    works = []
    for i, meta in enumerate(metas):
        if only is not None and not only[i]:
            buffers.append(None)
            continue
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        buffers.append(buf)
        works.append(Pollable(dist.irecv(buf, peer, tag=tag), watch=watch))
    return buffers, works


def post_send(tensors: Sequence[torch.Tensor | None], peer: int, tag: int) -> tuple[list[Any], list[torch.Tensor]]:
    """Post sends of the non-None ``tensors`` to ``peer``; returns the works and the tensors to
    keep alive until they complete."""
    payload = [t.detach().contiguous() for t in tensors if t is not None]
    return [Pollable(dist.isend(t, peer, tag=tag), watch=False) for t in payload], payload
