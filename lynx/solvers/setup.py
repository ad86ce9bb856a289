"""One-time solver setup, timed apart from search: importing a solver and the CP-SAT engine.

Importing OR-tools costs ~0.5 s in a fresh process (its Python layer pulls in pandas) — ten
times a whole HEU plan. That is setup, not search: :func:`prepare` imports a solver before the
planner starts its search clock (OPT and checkmate import CP-SAT there), and HEU, which needs
CP-SAT only for tiny stages and its rare exact fallback, imports it through :func:`cpsat`
when it first does. Every such first import adds its seconds to :func:`setup_seconds`, which
the planning loop subtracts from the search clock and reports as the ``setup`` phase
(:mod:`lynx.phases`), so ``search_time_s`` is the search a user waits for in a fresh process.

Example::

    >>> from lynx.solvers.setup import prepare, setup_seconds
    >>> before = setup_seconds()
    >>> prepare("heu").__name__
    'solve_heu'
    >>> setup_seconds() >= before
    True
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["REGISTRY", "OFFLOAD_SOLVERS", "prepare", "cpsat", "setup_seconds"]

# solver name -> (module, function); the module is imported on first use
REGISTRY: dict[str, tuple[str, str]] = {
    "opt": ("lynx.solvers.opt", "solve_opt"),
    "heu": ("lynx.solvers.heu.solve", "solve_heu"),
    "none": ("lynx.solvers.baselines", "solve_none"),
    "full": ("lynx.solvers.baselines", "solve_full"),
    "full-block": ("lynx.solvers.baselines", "solve_full_block"),
    "selective": ("lynx.solvers.baselines", "solve_selective"),
    "checkmate": ("lynx.solvers.checkmate", "solve_checkmate"),
    # offload baselines (offload=True): PipeOffload's policy, Megatron's module offloading
    "offload-all": ("lynx.solvers.offload_baselines", "solve_offload_all"),
    "offload-modules": ("lynx.solvers.offload_baselines", "solve_offload_modules"),
}
# solvers that decide offload, or need the copy lanes offload=True gives
OFFLOAD_SOLVERS = ("offload-all", "offload-modules")

_spent = [0.0]  # seconds of first imports so far in this process (see setup_seconds)


def _import(module: str) -> ModuleType:
    """``module``, imported now if it is not yet, the seconds that takes counted as setup."""
    found = sys.modules.get(module)
    if found is not None:
        return found
    started = time.perf_counter()
    try:
        return importlib.import_module(module)
    finally:
        _spent[0] += time.perf_counter() - started


def prepare(name: str) -> Callable[..., Any]:
    """Solver ``name``'s function, its module imported (a KeyError for an unknown name: the
    caller, :func:`lynx.solvers.solve`, says which names are valid)."""
    module, attr = REGISTRY[name]
    return getattr(_import(module), attr)


def cpsat() -> ModuleType:
    """:mod:`lynx.solvers.cpsat` (OR-tools' CP-SAT), imported on first use."""
    return _import("lynx.solvers.cpsat")


def setup_seconds() -> float:
    """Seconds this process has spent on first imports of solvers and CP-SAT."""
    return _spent[0]
