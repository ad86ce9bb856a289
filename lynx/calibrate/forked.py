"""The calibration's few-process measurements: start them, take their results, leave nothing behind.

Each measurement that needs two ranks (a link, the all-reduces, the runtime's own cost, a
tensor-parallel stage) forks its processes, which put what they measured on a queue.
:func:`collect` starts them, takes ``expected`` results (waiting at most ``timeout_s`` for
each), then joins every process, killing one that lingers.

A measurement whose ranks first build and trace a pipeline stage (seconds of CPU, nothing timed)
is started early as a :class:`Staged` one: its ranks prepare while this process captures the
references on the other core, then wait for :meth:`Staged.results`, which lets them measure on
cores no preparation shares any more — or for :meth:`Staged.run_block`, which lets them time one
block of runs while this process idles, so that a measurement's blocks can sit between this
process's own repeats and span the calibration, not a few seconds of it.

:func:`pin_to_core` puts a rank on a core of its own, as a training job's busy ranks run: left to
the scheduler, two ranks of a 2-core host sometimes shared a core for a whole measurement, and a
1 MiB gloo round trip read 4.7 GB/s in one calibration and 7.8 in the next.

    >>> import multiprocessing as mp
    >>> ctx = mp.get_context("spawn")
    >>> collect([], ctx.Queue(), 0, timeout_s=1.0)
    ([], None)
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["collect", "pin_to_core", "Staged", "Gate", "GO_WAIT_S", "staged_rank", "rank_env", "why_not"]

# how long a prepared rank waits to be let measure: the calibration's CPU repeats come between
GO_WAIT_S = 900.0
# more blocks of runs than a measurement lets go (Gate.abandon_blocks)
_MAX_BLOCKS = 64


def collect(procs: list[Any], queue: Any, expected: int, timeout_s: float,
            started: bool = False) -> tuple[list[Any], str | None]:
    """Start ``procs`` (unless ``started``); the first ``expected`` items they put on ``queue``,
    and None — or the items that came and why the rest did not (a worker died or hung)."""
    if not started:
        for p in procs:
            p.start()
    items: list[Any] = []
    try:
        for _ in range(expected):
            items.append(queue.get(timeout=timeout_s))
    except Exception:  # noqa: BLE001 - queue.Empty: a worker died or hung
        return items, f"no result within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return items, None


class Gate:
    """Between a :class:`Staged` rank and this process: the rank says it is prepared (or failed
    preparing), then waits to be let measure — at once, or (:meth:`next_block`) one block of
    runs at a time, each when this process lets it (:meth:`Staged.run_block`)."""

    def __init__(self, ctx: Any, ranks: int = 1) -> None:
        self._prepared, self._go, self._said = ctx.Semaphore(0), ctx.Event(), False
        # a block's go per rank (a shared one would let a quick rank take another's), done shared
        self._blocks, self._block_done = [ctx.Semaphore(0) for _ in range(ranks)], ctx.Semaphore(0)

    def prepared(self, wait_s: float) -> None:
        """In the rank: prepared; returns once let measure (raises after ``wait_s`` without)."""
        self.failed()
        if not self._go.wait(wait_s):
            from lynx.errors import LynxRuntimeError

            raise LynxRuntimeError(f"prepared, but not let measure within {wait_s:.0f} s")

    def next_block(self, rank: int, wait_s: float) -> None:
        """In rank ``rank``: wait until this process lets its next block of runs go (raises
        after ``wait_s`` without)."""
        if not self._blocks[rank].acquire(timeout=wait_s):
            from lynx.errors import LynxRuntimeError

            raise LynxRuntimeError(f"prepared, but no block of runs let go within {wait_s:.0f} s")

    def block_done(self) -> None:
        """In the rank: its block of runs is done."""
        self._block_done.release()

    def abandon_blocks(self) -> None:
        """In a rank that failed: no block waits on it any more (:meth:`Staged.run_block`)."""
        for _ in range(_MAX_BLOCKS):
            self._block_done.release()

    def failed(self) -> None:
        """In the rank: done preparing, one way or the other (said once per rank)."""
        if not self._said:
            self._said = True
            self._prepared.release()


def staged_rank(target: Any, rank: int, gate: Gate | None, queue: Any, *args: Any) -> None:
    """A forked rank's whole life (a :class:`Staged` one's, or with no ``gate`` one that
    measures at once): ``(rank, target(rank, gate, *args))`` on ``queue``, or
    ``(rank, "rank R: Error: message")`` if it raised (the gate then says this rank is done
    preparing, so nothing waits on it); then the process ends without the interpreter's
    teardown, which would hang on a process group's threads still alive
    (see :mod:`lynx.process_group_guard`). The rank's threads run with the short scheduler
    slices a training rank's do (:mod:`lynx.runtime.sched_slice`), so what it times is what
    a training rank's hand-offs cost."""
    from lynx.runtime.sched_slice import request_short_slices

    request_short_slices()
    try:
        queue.put((rank, target(rank, gate, *args)))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises a LynxRuntimeError
        if gate is not None:
            gate.failed()
            gate.abandon_blocks()
        queue.put((rank, f"rank {rank}: {type(err).__name__}: {err}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def why_not(results: dict[int, Any], missing: str | None) -> str:
    """Why ranks' results are missing: the ``"rank R: ..."`` each failed one sent
    (:func:`staged_rank`) and :func:`collect`'s own reason, joined ("" when there is none)."""
    return "; ".join([r for r in results.values() if isinstance(r, str)] + ([missing] if missing else []))


def rank_env(rank: int, world: int, port: int) -> None:
    """This forked rank's ``torch.distributed`` environment: rank ``rank`` of ``world`` meeting
    on 127.0.0.1:``port``. Under torchrun the parent's ``TORCHELASTIC_*`` variables would send
    the rank to its agent's store, not this measurement's own: they are dropped."""
    for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
        del os.environ[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


class Staged:
    """Forked ranks started now that prepare, then wait until :meth:`results` lets them measure.

    ``target(rank, gate, *args)`` prepares, calls ``gate.prepared(...)``, measures and returns
    its result; :func:`staged_rank` puts that (or why it failed) on the queue and ends the rank.
    :meth:`wait_prepared` holds this process until every rank is prepared, so no preparation
    overlaps a timed loop here; :meth:`cancel` (or leaving a ``with`` block) ends ranks never
    let go."""

    def __init__(self, target: Any, ranks: int, args: tuple, timeout_s: float) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self.queue, self.gate, self.timeout_s = ctx.Queue(), Gate(ctx, ranks), timeout_s
        self.procs = [ctx.Process(target=staged_rank, args=(target, rank, self.gate, self.queue, *args),
                                  daemon=True) for rank in range(ranks)]
        for p in self.procs:
            p.start()
        self._waiting = len(self.procs)

    def wait_prepared(self) -> bool:
        """Until every rank is prepared or failed preparing (at most ``timeout_s`` each); False
        if one was still preparing then."""
        while self._waiting:
            if not self.gate._prepared.acquire(timeout=self.timeout_s):
                return False
            self._waiting -= 1
        return True

    def run_block(self) -> bool:
        """Let every rank time one block of runs (:meth:`Gate.next_block`) and wait until all
        have (at most ``timeout_s`` each); False if one had not by then. This process idles
        meanwhile, so the block has the cores to itself."""
        self.gate._go.set()
        for go in self.gate._blocks:
            go.release()
        return all(self.gate._block_done.acquire(timeout=self.timeout_s) for _ in self.procs)

    def results(self) -> tuple[list[Any], str | None]:
        """Let the ranks measure; what they put on the queue, as :func:`collect`."""
        self.gate._go.set()
        return collect(self.procs, self.queue, len(self.procs), self.timeout_s, started=True)

    def cancel(self) -> None:
        """End ranks still waiting (the calibration failed before it let them measure)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


def pin_to_core(rank: int) -> int | None:
    """Keep this process (and every thread it starts from now on) on the ``rank``-th of the
    CPUs it may use, where it may use two or more; that CPU, or None (one CPU, or no affinity
    control on this platform: the scheduler places it)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    cpu = allowed[rank % len(allowed)]
    os.sched_setaffinity(0, {cpu})
    return cpu
