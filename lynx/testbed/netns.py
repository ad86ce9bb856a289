"""Network namespaces, veth pairs, a bridge and ``tc tbf`` rate limits, made and removed with iproute2.

This is the plumbing under :class:`lynx.testbed.NetBed`. A topology for ``W`` ranks is
``W + 1`` namespaces that all belong to this process (their names carry its pid)::

    <prefix>hub      bridge "br0" with one port "r<k>" per rank     (no address, no route)
    <prefix>r<k>     "lo" and "lynx0" = 10.213.0.<k+1>/24            (rank k's processes run here)

``lynx0`` in rank k's namespace and ``r<k>`` in the hub are the two ends of one veth pair.
With a rate, both ends get a ``tbf`` root qdisc: ``lynx0`` limits what rank k sends,
``r<k>`` what it receives — each rank has its own full-duplex link to a switch, like a
machine on Ethernet. Nothing touches the host's interfaces, and the namespaces have no route
outside their /24, so no packet can leave them.

Example (root only)::

    >>> from lynx.testbed.netns import TbfShape, bed_prefix, create_topology, delete_namespaces
    >>> topo = create_topology(bed_prefix(999), world_size=2, shape=TbfShape.for_rate(100.0))
    >>> topo.addresses
    ['10.213.0.1', '10.213.0.2']
    >>> delete_namespaces(topo.namespaces)   # returns what could not be deleted
    []
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from lynx.errors import LynxRuntimeError

__all__ = [
    "NAME_PREFIX",
    "RANK_IFNAME",
    "SUBNET",
    "NamespaceError",
    "TbfShape",
    "Topology",
    "bed_prefix",
    "cleanup_stale",
    "create_topology",
    "delete_namespaces",
    "list_namespaces",
]

NAME_PREFIX = "lynx"
RANK_IFNAME = "lynx0"
SUBNET = "10.213.0"
# lynx<pid>x<seq>hub | lynx<pid>x<seq>r<rank>: the pid says whose they are, so
# cleanup_stale() can remove those of dead processes without touching live ones.
_NAME_RE = re.compile(rf"^{NAME_PREFIX}(\d+)x(\d+)(hub|r\d+)$")
_GSO_MAX_BYTES = 65536 + 1024  # a TSO/GSO super-packet on veth, with headers


class NamespaceError(LynxRuntimeError):
    """An ``ip``/``tc`` command failed while building or removing the test bed."""


@dataclass(frozen=True)
class TbfShape:
    """Token-bucket parameters of one direction of a rank's link.

    ``burst_bytes`` — bucket size. It must hold a whole GSO super-packet (64 KiB) or tbf
    splits every packet in software; above that, 1 ms of traffic, so the token refill is
    not limited by timer resolution at high rates. ``limit_bytes`` — the queue in front of
    the bucket: ``latency_ms`` of traffic at the rate (at least two bursts), a switch-like
    buffer that lets TCP fill the link without unbounded queueing delay.
    """

    rate_bit: int
    burst_bytes: int
    limit_bytes: int

    @classmethod
    def for_rate(cls, rate_mbit: float, latency_ms: float = 50.0) -> "TbfShape":
        rate_bit = int(round(rate_mbit * 1e6))
        bytes_per_ms = rate_bit / 8 / 1000
        burst = max(_GSO_MAX_BYTES, int(bytes_per_ms))
        limit = max(2 * burst, int(bytes_per_ms * latency_ms))
        return cls(rate_bit=rate_bit, burst_bytes=burst, limit_bytes=limit)

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bit}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


@dataclass(frozen=True)
class Topology:
    """What :func:`create_topology` made: namespace names and each rank's address."""

    hub: str
    rank_namespaces: list[str]
    addresses: list[str]
    shape: TbfShape | None

    @property
    def namespaces(self) -> list[str]:
        return [*self.rank_namespaces, self.hub]


def bed_prefix(seq: int, pid: int | None = None) -> str:
    """Name prefix of one bed's namespaces: unique per process (pid) and per bed (seq)."""
    return f"{NAME_PREFIX}{os.getpid() if pid is None else pid}x{seq}"


def _run(argv: list[str]) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NamespaceError(f"`{' '.join(argv)}` could not run: {exc}") from exc
    if proc.returncode != 0:
        raise NamespaceError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def create_topology(prefix: str, world_size: int, shape: TbfShape | None,
                    ip: str = "ip", tc: str = "tc") -> Topology:
    """Make the hub, one namespace per rank, their veth links and (with ``shape``) the tbf limits.

    On any failure everything made so far is deleted before the :class:`NamespaceError`
    propagates, so a half-built bed never outlives the call.
    """
    for tool in [ip] + ([tc] if shape is not None else []):
        if shutil.which(tool) is None:
            raise NamespaceError(f"`{tool}` not found on PATH (install iproute2)")
    if not 1 <= world_size <= 250:
        raise NamespaceError(f"world_size must be in 1..250 for a /24 subnet, got {world_size}")
    hub = f"{prefix}hub"
    ranks = [f"{prefix}r{k}" for k in range(world_size)]
    made: list[str] = []
    try:
        _run([ip, "netns", "add", hub])
        made.append(hub)
        _run([ip, "-n", hub, "link", "add", "br0", "type", "bridge"])
        _run([ip, "-n", hub, "link", "set", "br0", "up"])
        for k, ns in enumerate(ranks):
            _run([ip, "netns", "add", ns])
            made.append(ns)
            _run([ip, "-n", ns, "link", "set", "lo", "up"])
            _run([ip, "-n", ns, "link", "add", RANK_IFNAME, "type", "veth",
                  "peer", "name", f"r{k}", "netns", hub])
            _run([ip, "-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", RANK_IFNAME])
            _run([ip, "-n", ns, "link", "set", RANK_IFNAME, "up"])
            _run([ip, "-n", hub, "link", "set", f"r{k}", "master", "br0", "up"])
            if shape is not None:
                _run([tc, "-n", ns, "qdisc", "add", "dev", RANK_IFNAME, "root", *shape.tc_args()])
                _run([tc, "-n", hub, "qdisc", "add", "dev", f"r{k}", "root", *shape.tc_args()])
    except NamespaceError:
        delete_namespaces(made, ip=ip)
        raise
    return Topology(hub=hub, rank_namespaces=ranks,
                    addresses=[f"{SUBNET}.{k + 1}" for k in range(world_size)], shape=shape)


def list_namespaces(ip: str = "ip") -> list[str]:
    """Names of all network namespaces ``ip netns`` knows (empty if ``ip`` is missing)."""
    if shutil.which(ip) is None:
        return []
    try:
        out = _run([ip, "netns", "list"])
    except NamespaceError:
        return []
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_namespaces(names: list[str], ip: str = "ip") -> list[str]:
    """Delete the given namespaces (veths and the bridge go with them); returns any left over.

    Never raises: it runs from ``__exit__`` and ``atexit``, where a second error would hide
    the first. What could not be deleted is returned so the caller can report it.
    """
    left: list[str] = []
    for name in names:
        try:
            _run([ip, "netns", "del", name])
        except NamespaceError:
            if name in list_namespaces(ip):
                left.append(name)
    return left


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(ip: str = "ip") -> list[str]:
    """Delete Lynx test-bed namespaces whose owning process is dead; returns the names deleted.

    Namespaces of a live process (this one included) are left alone, so concurrent test
    beds never remove each other's.
    """
    stale = []
    for name in list_namespaces(ip):
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            stale.append(name)
    # Rank namespaces before hubs (sorted puts "hub" before "r0"; order does not matter for
    # correctness, as each namespace is independent, but keep it tidy).
    left = delete_namespaces(sorted(stale, key=lambda n: n.endswith("hub")), ip=ip)
    return [n for n in stale if n not in left]
