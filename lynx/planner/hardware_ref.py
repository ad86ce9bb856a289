"""What ``--hardware`` takes, resolved: a spec, a preset name, ``"auto"`` or a hardware file's path.

This is the one entry behind ``--hardware`` (every CLI command, ``examples/train_gpt.py``),
``lynx.compile(hardware=...)`` and :class:`lynx.CompileConfig`: presets come from
:mod:`lynx.planner.hardware`, files from :mod:`lynx.planner.hardware_files`, ``auto`` from
:mod:`lynx.planner.hardware_cache` (this machine, measured once).

Example::

    >>> links = resolve_hardware("a100-25gbe").links
    >>> links["dp"].beta_bytes_per_s == links["pp"].beta_bytes_per_s
    True
    >>> resolve_hardware("tpu-v5")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lynx.errors.LynxConfigError: unknown hardware 'tpu-v5': give a preset (...), 'auto' (this machine, ...) or ...
"""

from __future__ import annotations

import os
from pathlib import Path

from lynx.errors import LynxConfigError
from lynx.planner.hardware import HARDWARE_PRESETS, HardwareSpec
from lynx.planner.hardware_cache import auto_hardware
from lynx.planner.hardware_files import DOCS_HINT, HARDWARE_SUFFIXES, load_hardware_file

__all__ = ["resolve_hardware"]


def resolve_hardware(ref: "str | os.PathLike | HardwareSpec") -> HardwareSpec:
    """A spec as it is, a preset name, ``"auto"`` (this host, measured once and cached) or a hardware file's path."""
    if isinstance(ref, HardwareSpec):
        return ref
    if not isinstance(ref, (str, os.PathLike)):
        raise LynxConfigError(
            f"hardware must be a preset name, a hardware file's path, 'auto' or a lynx.HardwareSpec, "
            f"got {type(ref).__name__}"
        )
    text = os.fspath(ref)
    if text in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[text]
    if text == "auto":
        return auto_hardware()
    path = Path(text).expanduser()
    if path.suffix.lower() in HARDWARE_SUFFIXES or path.exists() or os.sep in text:
        return load_hardware_file(path)
    raise LynxConfigError(
        f"unknown hardware {text!r}: give a preset ({', '.join(HARDWARE_PRESETS)}), 'auto' (this machine, "
        f"measured once by `lynx calibrate`) or the path of a hardware file (.json or .yaml; {DOCS_HINT})"
    )
