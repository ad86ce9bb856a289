"""One job per checkpoint directory: an advisory lock held for the life of the job.

Two jobs writing into one directory destroy each other's checkpoints (one removes the other's
half-written ``.step_N.tmp``; the other skips saves that now exist). :class:`CheckpointLock`
takes ``fcntl.flock`` on ``DIR/.lynx.lock`` and writes who holds it (host, pid, command, when
it started). A second job asking for it is refused at once with a message naming the holder.
The operating system releases the lock when the holding process ends, however it ends
(``kill -9`` included), so a lock is never left behind; the file stays, naming the last
holder. One process per job takes it (rank 0: its peers follow its decisions). Where
``fcntl`` does not exist (Windows) nothing is locked.

Example::

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with CheckpointLock(folder):
    ...     CheckpointLock(folder).acquire()       # another job on the same directory
    Traceback (most recent call last):
    ...
    lynx.errors.LynxCheckpointError: checkpoint directory ... is in use by another job (pid ...): ...
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from lynx.errors import LynxCheckpointError

__all__ = ["CheckpointLock", "LOCK_FILE"]

LOCK_FILE = ".lynx.lock"


class CheckpointLock:
    """An advisory lock on ``directory`` (created if missing); see the module docstring."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "CheckpointLock":
        """Take the lock, or raise :class:`LynxCheckpointError` naming the job that holds it."""
        if self._fd is not None:
            return self
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform
            return self
        if self.directory.exists() and not self.directory.is_dir():
            raise LynxCheckpointError(f"checkpoint directory {self.directory} is a file, not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(self.path)
            os.close(fd)
            raise LynxCheckpointError(
                f"checkpoint directory {self.directory} is in use by another job ({holder}): two jobs on one "
                f"directory destroy each other's checkpoints. Wait for it to end, or choose another directory"
            ) from None
        except OSError as err:
            os.close(fd)
            raise LynxCheckpointError(f"cannot lock checkpoint directory {self.directory}: {err}") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
                  "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Let the next job in (the file stays, naming the last holder)."""
        if self._fd is not None:
            os.close(self._fd)   # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "CheckpointLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _describe(path: Path) -> str:
    """Who holds the lock, from what it wrote (best effort: it may be writing right now)."""
    try:
        record = json.loads(path.read_text())
        return (f"pid {record['pid']} on {record['host']}, started {record['started']}: "
                f"{record['command']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "its process has not said who it is yet"
