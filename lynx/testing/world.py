"""Start a job's ranks on this machine: ``world`` processes in one process group, a function each.

:func:`spawn_world` starts the processes (:func:`_rank_context`), sets the environment
``torchrun`` would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free
``MASTER_PORT``), joins them in a process group with the backend :class:`lynx.runtime.Pipeline`
picks (NCCL on a rank's GPU where CUDA is available, gloo on the CPU otherwise) and calls
``fn(*args)`` on each. The function builds its :class:`~lynx.runtime.Pipeline` (s) — several
in turn share the group — and returns something picklable. A rank that raises reports to the
job's store, so the others stop with :class:`~lynx.runtime.RankFailedError` naming it instead
of waiting; :func:`spawn_world` then raises one :class:`~lynx.errors.LynxRuntimeError` naming the
rank whose own error it was, with every rank's first line (``err.rank_errors``).
:class:`InjectedFailure` is what a test raises on purpose.

Example (``fn`` must be importable by the child processes: a module-level function)::

    def train(steps):
        pipe = lynx.runtime.Pipeline(compiled_on_this_rank(), exit_on_error=False)
        return [float(pipe.step(*batch)) for batch in batches[:steps]]

    losses_by_rank = spawn_world(train, 2, 3, timeout_s=120)
"""

from __future__ import annotations

import io
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import LynxRuntimeError

__all__ = ["spawn_world", "preload", "InjectedFailure"]

# what every rank imports first: the fork server imports it once, each rank starts from a copy.
# Besides torch, what a rank that compiles and runs a Pipeline imports on its first capture
# (torch.export's tracer: ~2 CPU-s per fresh interpreter) and Lynx's compiler and runtime; none
# of them starts a thread, so forking after importing them is safe. lynx.solvers.cpsat: a rank
# that plans imports it (ortools and pandas, ~0.4 CPU-s a rank). :func:`preload` adds more
_PRELOAD = ["torch", "torch.distributed", "torch.export._trace", "lynx.compiler", "lynx.frontend.analyze",
            "lynx.rewrite", "lynx.runtime", "lynx.solvers.cpsat", "lynx.testing.world"]


class InjectedFailure(RuntimeError):
    """A failure a test raises on purpose on one rank (fault injection)."""


def _rank_context() -> Any:
    """The ``multiprocessing`` context ranks start in: a fork server that has imported torch
    and torch.export's tracer (a rank starts in ~0.1 s instead of the ~4 CPU-s a fresh
    interpreter takes to import them), or spawn where there is no fork server (Windows). Like
    spawn, and unlike fork, no rank inherits the parent's threads or CUDA state; unlike spawn it
    inherits the fork server's environment, so the caller passes its own
    (:func:`_apply_environment`).

    >>> _rank_context().get_start_method() in ("forkserver", "spawn")
    True
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)   # takes effect when the server starts (once per process)
    return ctx


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` as well, so that no rank pays for them: a package
    the ranks of this process's worlds import besides torch and Lynx (``transformers`` and a
    model's module: ~2 CPU-s a rank). In force for the fork server this process starts, i.e. when
    called before its first world; a module that does not import is skipped (as the fork server
    skips it). The modules must start no thread on import (a fork copies only the forking one).

    >>> preload("json")
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _apply_environment(environ: dict[str, str]) -> None:
    """Make this rank's environment the parent's at start (what spawn gives)."""
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


def spawn_world(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0,
                threads: int = 1) -> list[Any]:
    """``fn(*args)`` on ``world`` local ranks; the return values by rank (see module docstring).

    ``threads``: ``torch.set_num_threads`` in every rank (1: identical kernels and rounding to a
    single-threaded reference)."""
    from lynx.runtime.topology import free_port

    ctx = _rank_context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, threads, fn, args, queue, environ), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LynxRuntimeError(f"the world did not finish within {timeout_s:g} s; ranks without a "
                                       f"result: {sorted(set(range(world)) - set(results))}")
            try:
                item = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and p.exitcode]
                if dead:
                    raise LynxRuntimeError(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) "
                                           "without a result") from None
                continue
            results[item[1]] = item
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = {r: item for r, item in results.items() if item[0] == "error"}
    if errors:
        own = [r for r, item in errors.items() if item[3]] or sorted(errors)
        first = errors[own[0]]
        detail = "\n".join(f"  rank {r}: {item[2].splitlines()[0]}" for r, item in sorted(errors.items()))
        err = LynxRuntimeError(f"rank {own[0]} failed: {first[2]}\n{detail}\n{first[4]}")
        err.rank_errors = {r: item[2] for r, item in errors.items()}  # type: ignore[attr-defined]
        raise err
    return [torch.load(io.BytesIO(results[r][2]), weights_only=False) for r in range(world)]


def _rank_main(rank: int, world: int, port: int, threads: int, fn: Callable[..., Any], args: tuple,
               queue: Any, environ: dict[str, str]) -> None:
    from lynx.runtime.topology import select_backend

    _apply_environment(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        backend, device = select_backend(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
        result = fn(*args)
        buffer = io.BytesIO()   # bytes, not tensors: a queue would share memory this process frees on exit
        torch.save(result, buffer)
        queue.put(("ok", rank, buffer.getvalue()))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        own = not _caused_by_peer(err)
        if own and dist.is_initialized():
            _report(err, rank, world)
        queue.put(("error", rank, f"{type(err).__name__}: {err}", own, traceback.format_exc(limit=8)))
        # receives posted to a peer that is gone never complete; their threads would abort the
        # interpreter at exit: the report is out, leave without teardown
        queue.close()
        queue.join_thread()
        os._exit(1)
    try:
        dist.barrier()   # rank 0 hosts the store: nobody tears down while a peer still needs it
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _report(err: BaseException, rank: int, world: int) -> None:
    """Tell the other ranks through the job's store (what Pipeline's failure exit does under torchrun)."""
    from lynx.runtime.faults import FaultMonitor
    from lynx.torch_private import default_store

    FaultMonitor(default_store(), rank=rank, world_size=world).report(err)


def _caused_by_peer(err: BaseException) -> bool:
    from lynx.runtime.faults import PeerTimeoutError, RankFailedError

    return isinstance(err, (RankFailedError, PeerTimeoutError))
