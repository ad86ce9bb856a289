"""Lynx's error types: each says what was wrong, where, and what to do.

Every error a user can provoke with bad input derives from :class:`LynxError`, so a caller
(and the CLI) can catch one type and print its message instead of a traceback.

Example::

    >>> from lynx.errors import LynxConfigError
    >>> try:
    ...     raise LynxConfigError("pp must be >= 1, got 0")
    ... except LynxError as e:
    ...     print(e)
    pp must be >= 1, got 0
"""

__all__ = [
    "LynxError",
    "LynxConfigError",
    "LynxCaptureError",
    "LynxProfileError",
    "LynxPlanError",
    "LynxBudgetError",
    "LynxFingerprintError",
    "LynxRuntimeError",
    "LynxCheckpointError",
    "LynxNonFiniteError",
]


class LynxError(Exception):
    """Base class of every error Lynx raises for bad input or an impossible request.

    ``every_rank`` is True on an error every rank of a job raised alike (the ranks agreed on
    it), so one of them — rank 0 — need say it.
    """

    every_rank: bool = False


class LynxConfigError(LynxError, ValueError):
    """A setting is out of range, unknown or inconsistent with the others."""


class LynxCaptureError(LynxError):
    """The model could not be captured as a graph (data-dependent control flow, ...)."""


class LynxProfileError(LynxError):
    """The captured graph could not be run to measure it (wrong input shapes, ...)."""


class LynxPlanError(LynxError):
    """A plan file is corrupt, of an unknown version, or cannot be made."""


class LynxBudgetError(LynxPlanError):
    """No plan fits the memory budget."""


class LynxFingerprintError(LynxPlanError):
    """A plan was made for another model or configuration."""


class LynxRuntimeError(LynxError):
    """A distributed run failed (a rank raised, a peer timed out, ...)."""


class LynxCheckpointError(LynxConfigError):
    """A checkpoint is missing, damaged, of another format, or its directory is in use."""


class LynxNonFiniteError(LynxRuntimeError):
    """A training step produced a NaN or infinite loss or gradient (raised on every rank alike)."""

    every_rank = True
