"""Window ids: the typed name of an idle interval recomputation may fill.

A :class:`WindowId` names a window by its place in the schedule, not its time, so the same
ids exist in every replay and a plan made on one replay can be scored on another. Inside the
code windows are these values (hashed, compared and ordered by their text); only the plan's
JSON holds them as strings, read back with :meth:`WindowId.parse`.

* ``recv_grad`` / ``recv_act``: the wait for a pipeline receive of ``microbatch`` before its
  backward or forward on ``device`` (``chunk`` under interleaved schedules, several chunks per
  device): ``s0.recv_grad.mb3``, ``s0.recv_act.c2.mb1``;
* ``tp_allreduce``: the tensor-parallel all-reduces inside ``layer``'s backward of
  ``microbatch``: ``s1.tp.l5.b.mb0``;
* ``dp_collective``: the data-parallel collective of ``block``'s gradients: ``s0.dp.b2``.

Example::

    >>> w = WindowId.recv(0, "recv_grad", microbatch=3)
    >>> str(w), w.kind, w.microbatch, w.chunk
    ('s0.recv_grad.mb3', 'recv_grad', 3, None)
    >>> WindowId.parse("s1.tp.l5.b.mb0") == WindowId.tp(1, layer=5, microbatch=0)
    True
    >>> WindowId.parse("s0.recv_act.c2.mb1").chunk, WindowId.dp(0, block=2).place
    (2, (0, 'dp_collective'))
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from lynx.errors import LynxConfigError

__all__ = ["WindowId", "WINDOW_KINDS", "as_window_id"]

WINDOW_KINDS = ("recv_grad", "recv_act", "tp_allreduce", "dp_collective")

_PATTERNS = (
    (re.compile(r"^s(\d+)\.(recv_grad|recv_act)\.mb(\d+)$"), lambda g: WindowId(int(g[0]), g[1], int(g[2]))),
    (re.compile(r"^s(\d+)\.(recv_grad|recv_act)\.c(\d+)\.mb(\d+)$"),
     lambda g: WindowId(int(g[0]), g[1], int(g[3]), chunk=int(g[2]))),
    (re.compile(r"^s(\d+)\.tp\.l(\d+)\.b\.mb(\d+)$"),
     lambda g: WindowId(int(g[0]), "tp_allreduce", int(g[2]), layer=int(g[1]))),
    (re.compile(r"^s(\d+)\.dp\.b(\d+)$"), lambda g: WindowId(int(g[0]), "dp_collective", block=int(g[1]))),
)


@dataclass(frozen=True, eq=False)
class WindowId:
    """One window of one device (see module docstring); equal, hashed and ordered by its text."""

    device: int
    kind: str
    microbatch: Optional[int] = None
    chunk: Optional[int] = None
    layer: Optional[int] = None
    block: Optional[int] = None
    text: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in WINDOW_KINDS:
            raise LynxConfigError(f"window kind must be one of {WINDOW_KINDS}, got {self.kind!r}")
        needs = {"recv_grad": ("microbatch",), "recv_act": ("microbatch",), "tp_allreduce": ("microbatch", "layer"),
                 "dp_collective": ("block",)}[self.kind]
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise LynxConfigError(f"a {self.kind} window needs {', '.join(missing)}")
        object.__setattr__(self, "text", self._format())

    def _format(self) -> str:
        s = f"s{self.device}"
        if self.kind in ("recv_grad", "recv_act"):
            chunk = "" if self.chunk is None else f".c{self.chunk}"
            return f"{s}.{self.kind}{chunk}.mb{self.microbatch}"
        if self.kind == "tp_allreduce":
            return f"{s}.tp.l{self.layer}.b.mb{self.microbatch}"
        return f"{s}.dp.b{self.block}"

    # ---------------------------------------------------------------- constructors
    @staticmethod
    def recv(device: int, kind: str, microbatch: int, chunk: Optional[int] = None) -> "WindowId":
        """The wait for a pipeline receive (``recv_grad`` or ``recv_act``) of ``microbatch``."""
        if kind not in ("recv_grad", "recv_act"):
            raise LynxConfigError(f"a receive window is recv_grad or recv_act, got {kind!r}")
        return WindowId(device, kind, microbatch, chunk=chunk)

    @staticmethod
    def tp(device: int, layer: int, microbatch: int) -> "WindowId":
        return WindowId(device, "tp_allreduce", microbatch, layer=layer)

    @staticmethod
    def dp(device: int, block: int) -> "WindowId":
        return WindowId(device, "dp_collective", block=block)

    @staticmethod
    def parse(text: str) -> "WindowId":
        """The window a plan's string names; a clear error for anything else."""
        for pattern, make in _PATTERNS:
            match = pattern.match(text) if isinstance(text, str) else None
            if match:
                return make(match.groups())
        raise LynxConfigError(f"{text!r} is not a Lynx window id (e.g. 's0.recv_grad.mb3', 's0.recv_grad.c2.mb3', "
                              "'s1.tp.l5.b.mb0', 's0.dp.b2')")

    # ---------------------------------------------------------------- value
    @property
    def place(self) -> tuple[int, str]:
        """``(device, kind)``."""
        return self.device, self.kind

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return repr(self.text)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, WindowId) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __lt__(self, other: "WindowId") -> bool:
        return self.text < other.text

    def __reduce__(self) -> Any:   # pickles as its text (process pools, spawned ranks)
        return (WindowId.parse, (self.text,))


def as_window_id(value: "WindowId | str") -> WindowId:
    """``value`` as a :class:`WindowId` (a plan's string is parsed)."""
    return value if isinstance(value, WindowId) else WindowId.parse(value)
