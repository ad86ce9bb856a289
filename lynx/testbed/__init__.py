"""A limited-bandwidth test bed: ranks in their own network namespaces, links limited by tc tbf.

DeMo and Distributed Lion are made for clusters whose links are slow relative to compute.
To measure them (and the runtime's windows) on one machine, :class:`NetBed` puts each rank in
its own Linux network namespace, joins the namespaces through a bridge in a hub namespace
with veth pairs, and limits each rank's link in both directions with a ``tbf`` qdisc::

     ns lynx<pid>x<n>r0          ns lynx<pid>x<n>hub            ns lynx<pid>x<n>r1
    [rank 0] lynx0 ==tbf== r0 ==[ br0 ]== r1 ==tbf== lynx0 [rank 1]     ...
      10.213.0.1/24                                               10.213.0.2/24

Everything — bridge included — lives in namespaces the bed creates; the host's interfaces
are untouched and no route leads outside 10.213.0.0/24. gloo is bound to ``lynx0``
(``GLOO_SOCKET_IFNAME``) and ``MASTER_ADDR`` is rank 0's address.

Requirements: root and iproute2 (``ip``, ``tc``). Without them the bed falls back to
loopback (127.0.0.1, no limit), logs a warning saying why, and ``bed.rate_limited`` is False.

Cleanup: namespaces are deleted by ``close()`` / the ``with`` block, by an ``atexit`` hook,
and — for those of a process that was killed — by :func:`cleanup_stale`, which each new bed
runs first (names carry the owner's pid, so live beds are never touched). Ranks are killed
(their whole process group) when one fails, on timeout, and on interrupt.

Running any command (the API other benchmarks use, e.g. ``benchmarks/overlap_cpu.py``)::

    >>> import sys
    >>> from lynx.testbed import NetBed, measure_link
    >>> with NetBed(world_size=4, rate_mbit=100.0) as bed:       # doctest: +SKIP
    ...     print(measure_link(bed))                              # gloo send/recv r0 -> r1
    ...     results = bed.run([sys.executable, "train.py", "--steps", "10"],
    ...                       env={"OMP_NUM_THREADS": "1"}, timeout_s=600)
    ...     print(results[0].stdout)

Each rank gets ``RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
GLOO_SOCKET_IFNAME``, so ``torch.distributed.init_process_group("gloo")`` with the default
``env://`` works unchanged. ``bed.run`` returns one :class:`RankResult` (exit code, stdout,
stderr, seconds) per rank; if a rank fails it stops the others and raises
:class:`LynxTestbedError` naming the rank (``check=False`` returns the results instead).
"""

from lynx.testbed.measure import LinkMeasurement, measure_link
from lynx.testbed.netbed import Command, LynxTestbedError, NetBed, RankResult
from lynx.testbed.netns import TbfShape, cleanup_stale

__all__ = [
    "Command",
    "LinkMeasurement",
    "LynxTestbedError",
    "NetBed",
    "RankResult",
    "TbfShape",
    "cleanup_stale",
    "measure_link",
]
