"""Measuring this host for the cost model (``lynx calibrate``, ``hardware="auto"``).

:func:`calibrate_host` returns a :class:`~lynx.planner.hardware.HardwareSpec` measured here, with a
``calibration`` block (time taken, spread over repeats, load); :mod:`lynx.planner.hardware_files`
writes it, :mod:`lynx.planner.hardware_cache` keeps this host's copy for ``auto``.
"""

from lynx.calibrate.host import calibrate_host

__all__ = ["calibrate_host"]
