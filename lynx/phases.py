"""Wall-clock seconds per phase of turning a model into a plan: where a `lynx plan` goes.

:class:`Phases` is an ordered ``{phase: seconds}`` dict that :func:`lynx.analyze` (capture,
profile, graph), the planning loop (setup, plan, search, simulate) and ``lynx plan`` (model,
write) fill in; :func:`lynx.compile` returns it as ``Compiled.phases``. The phases are
disjoint, so they add up to the time spent inside those calls:

* ``startup`` — from the process's start to the command's (``lynx plan`` only: the interpreter,
  importing torch, Lynx and the CLI);
* ``import`` — importing ``torch.export``'s tracer (``torch._dynamo``, ~1 s) before capture;
* ``model`` — building the model (``lynx plan`` only: a preset or ``module:factory``);
* ``capture`` — ``torch.export`` of one microbatch;
* ``profile`` — what autograd saves, on fake tensors;
* ``graph`` — the op graph with its layer classes and per-node times;
* ``setup`` — one-time solver setup: importing the solver (OR-tools for ``opt``, on its first
  use in the process; HEU needs none), never counted as search;
* ``plan`` — the planner's own work: partition, timelines, stage problems, the plan object;
* ``search`` — the solver over every stage and round (the plan's ``search_time_s``);
* ``simulate`` — replaying the decisions to score them (once per round, and the chosen plan);
* ``write`` — saving the plan (``lynx plan`` only).

Example::

    >>> from lynx.phases import Phases
    >>> phases = Phases()
    >>> with phases.timed("capture"):
    ...     pass
    >>> phases.add("search", 0.25)
    >>> list(phases), phases["search"]
    (['capture', 'search'], 0.25)
    >>> Phases({"capture": 0.5, "search": 0.25}).format()
    'capture 0.500 s, search 0.250 s (0.750 s in all)'
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Phases", "PHASES", "since_process_start"]

# The phases in the order a plan is made (what format() lists first)
PHASES = ("startup", "import", "model", "capture", "profile", "graph", "setup", "plan", "search", "simulate", "write")


class Phases(dict):
    """``{phase: seconds}``, added to as phases run (see module docstring)."""

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` more for ``name`` (a phase can run several times)."""
        self[name] = self.get(name, 0.0) + seconds

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Count the wall-clock time of the ``with`` body for ``name``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def update_from(self, other: dict) -> Phases:
        """Add another record's seconds phase by phase; returns self."""
        for name, seconds in other.items():
            self.add(name, seconds)
        return self

    def total(self) -> float:
        return sum(self.values())

    def format(self) -> str:
        """One line, phases in the order a plan is made: ``capture 0.612 s, … (1.234 s in all)``."""
        order = sorted(self, key=lambda n: (PHASES.index(n) if n in PHASES else len(PHASES), n))
        return ", ".join(f"{n} {self[n]:.3f} s" for n in order) + f" ({self.total():.3f} s in all)"


def since_process_start() -> float | None:
    """Seconds since this process started (Linux, 10 ms resolution; None where unknown)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            fields = stat.read().rsplit(")", 1)[1].split()  # (the command name may hold spaces)
            started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: field 22 of stat
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None
