"""The progress ``lynx calibrate`` shows while it measures: a bar on a terminal, else a line per step."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import rich.progress

__all__ = ["CalibrationProgress"]


class CalibrationProgress:
    """Progress on stderr: a rich bar on a terminal, a line per step otherwise."""

    def __init__(self, active: bool) -> None:
        self.active, self.count, self.n = active, 0, 0
        self.bar: Optional[rich.progress.Progress] = None   # on a terminal, from total() on
        self.task: Optional[rich.progress.TaskID] = None
        self.started = time.perf_counter()

    def total(self, n: int) -> None:
        self.n = n
        if self.active and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("calibrate"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=n)

    def step(self, what: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            assert self.task is not None   # added with the bar (total)
            self.bar.update(self.task, completed=self.count, description=what)
        else:
            print(
                f"calibrate [{self.count + 1}/{self.n}] {time.perf_counter() - self.started:5.1f} s  {what}",
                file=sys.stderr,
                flush=True,
            )
        self.count += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
