"""measure_link: the throughput a NetBed's link really achieves, with gloo send/recv.

The nominal ``tbf`` rate is an upper bound: TCP/IP headers, the token bucket's burst and
gloo's own framing move the achieved figure below (or, for short transfers, above) it. Benchmarks print
this measured figure next to the nominal one.

Example::

    >>> from lynx.testbed import NetBed, measure_link
    >>> with NetBed(world_size=2, rate_mbit=10.0) as bed:
    ...     m = measure_link(bed, nbytes=2_000_000)
    >>> print(m)                                   # doctest: +SKIP
    10.0 Mbit/s nominal, 9.4 Mbit/s measured (2000000 B x 3 by gloo send/recv)
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass

from lynx.errors import LynxConfigError, LynxRuntimeError
from lynx.testbed.link_probe import MARKER
from lynx.testbed.netbed import NetBed

__all__ = ["LinkMeasurement", "measure_link"]


@dataclass(frozen=True)
class LinkMeasurement:
    """Achieved throughput of rank 0 → rank 1 on a bed (median over ``seconds``)."""

    nominal_mbit: float | None  # None: not rate-limited (loopback or unlimited veth)
    nbytes: int
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def measured_mbit(self) -> float:
        return self.nbytes * 8 / self.median_s / 1e6

    def __str__(self) -> str:
        nominal = f"{self.nominal_mbit:g} Mbit/s nominal" if self.nominal_mbit else "unlimited"
        return (f"{nominal}, {self.measured_mbit:.1f} Mbit/s measured "
                f"({self.nbytes} B x {len(self.seconds)} by gloo send/recv)")


def measure_link(bed: NetBed, nbytes: int | None = None, repeats: int = 3,
                 timeout_s: float = 120.0, pause_s: float = 0.0) -> LinkMeasurement:
    """Send ``nbytes`` from rank 0 to rank 1 ``repeats`` times over ``bed`` and time it
    (``pause_s``: the link rests that long before each, e.g. a ``tbf`` bucket refilled).

    ``nbytes`` defaults to about one second of traffic at the nominal rate (at least 1 MB,
    at most 64 MB), long enough that the tbf burst and TCP slow start do not dominate.
    """
    if bed.world_size < 2:
        raise LynxConfigError("measure_link needs a bed with world_size >= 2")
    if nbytes is None:
        rate = bed.rate_mbit if bed.rate_limited and bed.rate_mbit else 512.0
        nbytes = int(min(64e6, max(1e6, rate * 1e6 / 8)))
    if nbytes <= 0 or repeats <= 0:
        raise LynxConfigError(f"measure_link: nbytes and repeats must be > 0, got "
                              f"{nbytes} and {repeats}")
    results = bed.run([sys.executable, "-m", "lynx.testbed.link_probe", "--bytes", str(nbytes),
                       "--repeats", str(repeats), "--pause", str(pause_s)], timeout_s=timeout_s)
    for line in results[0].stdout.splitlines():
        if line.startswith(MARKER):
            data = json.loads(line[len(MARKER):])
            return LinkMeasurement(nominal_mbit=bed.rate_mbit if bed.rate_limited else None,
                                   nbytes=data["bytes"], seconds=list(data["seconds"]))
    raise LynxRuntimeError(f"measure_link: rank 0 printed no result; its stderr:\n"
                           f"{results[0].stderr[-2000:]}")
