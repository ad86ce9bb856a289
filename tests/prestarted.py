"""Start a script's ranks from the fork server that has already imported torch and Lynx.

A rank started afresh spends ~4-5 s of CPU importing torch, ``torch.export`` and Lynx before the
script's first line of its own; tests/examples starts ~30 ranks. :func:`start_rank` starts each
from the fork server :func:`lynx.testing.world.spawn_world` uses (it imported them once and runs
no thread), and the child then runs the script as ``python script.py ARGS`` would: ``__main__``,
``sys.argv``, ``sys.path[0]`` the script's folder, the rank's environment and working directory,
stdin from /dev/null, stdout and stderr to files, the exit code of ``sys.exit`` (a traceback and
1 for an exception), non-daemon threads joined and ``atexit`` run at the end. A child is a
process of its own (its own pid, signals, exit): :class:`Rank` shows it as ``subprocess.Popen``
does (``poll``, ``communicate``, ``kill``, ``send_signal``, ``returncode``).

What a fork shares with the server and a fresh process would not: the modules imported (a
script still runs its own ``import`` lines, which bind its names) and the string hash seed.
Tests about a fresh interpreter start one (tests/examples/test_train_gpt.py's ``full_run``).

:func:`start_world` starts a script's ranks as ``torchrun --standalone --nproc_per_node N``
would, each with the environment torchrun gives a rank; :func:`run_world` waits for them. A
test about torchrun itself (its agent, its root-cause report) runs torchrun
(tests/runtime/test_user_pipeline_failures.py).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from lynx.testing.world import _rank_context

__all__ = ["Rank", "start_rank", "start_world", "run_world"]


class Rank:
    """A rank started by :func:`start_rank`, with the ``subprocess.Popen`` methods the tests use."""

    def __init__(self, process: Any, out: Path, err: Path) -> None:
        self._process, self._out, self._err = process, out, err
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode   # negative: the signal that ended it, as Popen says

    def poll(self) -> int | None:
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.returncode is None:
            self._process.kill()


def start_rank(script: str | Path, args: list[str], env: dict[str, str], cwd: str | Path | None = None) -> Rank:
    """``python script ARGS`` with ``env`` in ``cwd``, forked from the fork server."""
    folder = Path(tempfile.mkdtemp(prefix="rank-"))
    out, err = folder / "stdout", folder / "stderr"
    process = _rank_context().Process(
        target=_run_script, args=(str(script), [str(a) for a in args], dict(env), str(cwd or os.getcwd()),
                                  str(out), str(err)))
    process.start()
    return Rank(process, out, err)


def start_world(script: str | Path, args: list[str], world: int, env: dict[str, str] | None = None,
                cwd: str | Path | None = None) -> list[Rank]:
    """``script ARGS`` on ``world`` ranks with the environment torchrun gives each (``RANK``,
    ``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``PORT``:
    a free local port, as ``--standalone``) on top of ``env`` (default: this process's)."""
    from lynx.runtime.topology import free_port

    base, port = dict(os.environ if env is None else env), str(free_port())
    return [start_rank(script, args, dict(base, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0", WORLD_SIZE=str(world),
                                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                       cwd)
            for r in range(world)]


def run_world(ranks: list[Rank], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for ``ranks`` (each at most ``timeout`` s); (exit code, stdout, stderr) per rank. A rank
    still running then is killed."""
    try:
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
        return [(rank.returncode, out, err) for rank, (out, err) in zip(ranks, outputs)]
    finally:
        for rank in ranks:
            rank.kill()


def _run_script(script: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the child: become ``python script ARGS`` and never return."""
    code = 1
    try:
        os.chdir(cwd)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT),
                                (2, err, os.O_WRONLY | os.O_CREAT)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *argv]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:   # as the interpreter does: the traceback on stderr, exit 1
            import traceback

            traceback.print_exc()
        for thread in threading.enumerate():   # as the interpreter does at exit
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        os._exit(code)
