"""Lynx: plan and run activation recomputation inside communication windows.

Example::

    >>> import lynx
    >>> model, inputs = lynx.models.build_preset("gpt-tiny", device="cpu")
    >>> report = lynx.inspect_model(model, inputs, target="cpu")
    >>> report.totals.saved_bytes > 0
    True
"""

from __future__ import annotations

import importlib
from typing import Any

from lynx.errors import (
    LynxBudgetError,
    LynxCaptureError,
    LynxConfigError,
    LynxError,
    LynxFingerprintError,
    LynxPlanError,
    LynxProfileError,
    LynxRuntimeError,
)

__version__ = "0.1.0"

# Public names resolved on first use, so `import lynx` stays fast and each stage of the
# data flow (capture → profile → graph → timeline → solve → plan → simulate → rewrite →
# runtime) is imported only when needed.
_LAZY = {
    "analyze": ("lynx.frontend.analyze", "analyze"),
    "capture": ("lynx.frontend.capture", "capture"),
    "compile": ("lynx.compiler", "compile"),
    "profile": ("lynx.frontend.profile", "profile"),
    "simulate": ("lynx.planner.simulator", "simulate"),
    "models": ("lynx.models", None),
    "Captured": ("lynx.frontend.capture", "Captured"),
    "Profile": ("lynx.frontend.profile", "Profile"),
    "build_graph": ("lynx.frontend.graph", "build_graph"),
    "HardwareSpec": ("lynx.planner.hardware", "HardwareSpec"),
    "LinkSpec": ("lynx.planner.hardware", "LinkSpec"),
    "get_hardware": ("lynx.planner.hardware", "get_hardware"),
    "resolve_hardware": ("lynx.planner.hardware_ref", "resolve_hardware"),
    "Analysis": ("lynx.frontend.analyze", "Analysis"),
    "inspect_model": ("lynx.frontend.inspect", "inspect_model"),
    "CompileConfig": ("lynx.config", "CompileConfig"),
    "Compiled": ("lynx.compiler", "Compiled"),
    "Plan": ("lynx.plan", "Plan"),
    "optim": ("lynx.optim", None),
    "runtime": ("lynx.runtime", None),
}

__all__ = [
    "LynxError",
    "LynxConfigError",
    "LynxCaptureError",
    "LynxProfileError",
    "LynxPlanError",
    "LynxBudgetError",
    "LynxFingerprintError",
    "LynxRuntimeError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lynx' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
