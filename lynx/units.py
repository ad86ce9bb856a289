"""Byte sizes: one parser and one formatter for every size Lynx reads or prints.

Example::

    >>> from lynx.units import format_size, parse_size
    >>> parse_size("60GiB") == 60 * 2**30, parse_size("500MB"), parse_size(4096)
    (True, 500000000, 4096)
    >>> format_size(3 * 2**30), format_size(1536), format_size(12)
    ('3.00 GiB', '1.50 KiB', '12 B')
"""

from __future__ import annotations

import math
import re
from typing import Any, Union

from lynx.errors import LynxConfigError

__all__ = ["parse_size", "format_size", "dtype_bytes", "MAX_SIZE"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# No device or host holds an exbibyte: a size above it is a typo (1e99 was read as a budget)
MAX_SIZE = 2**60
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Union[int, float, str]) -> int:
    """Bytes from ``int`` bytes or a size string such as ``"60GiB"``, ``"500MB"``, ``"2e9"``."""
    if isinstance(value, bool):
        raise LynxConfigError(f"a memory size must be bytes or a string like '60GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise LynxConfigError(f"a memory size must be a positive, finite number of bytes, got {value!r}")
        return _bounded(int(value), value)
    if not isinstance(value, str):
        raise LynxConfigError(f"a memory size must be bytes or a string like '60GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise LynxConfigError(
            f"cannot read memory size {value!r}: use bytes or a number with a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '60GiB'")
    number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number) or int(number) <= 0:
        raise LynxConfigError(f"a memory size must be positive and finite, got {value!r}")
    return _bounded(int(number), value)


def _bounded(size: int, given: Any) -> int:
    if size > MAX_SIZE:
        raise LynxConfigError(f"memory size {given!r} is {size:.3g} bytes, more than any machine holds "
                              f"(at most {MAX_SIZE:.3g} bytes, 1 EiB): check the number and its unit")
    return size


def format_size(nbytes: Union[int, float]) -> str:
    """Human-readable binary size, e.g. ``format_size(3 * 2**30) == '3.00 GiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given as a torch dtype or its name (default 2)."""
    text = str(dtype or "float16").lower().removeprefix("torch.")
    table = {"float16": 2, "half": 2, "bfloat16": 2, "fp16": 2, "bf16": 2, "float32": 4, "float": 4,
             "fp32": 4, "float64": 8, "double": 8, "int8": 1, "uint8": 1}
    return table.get(text, 2)
