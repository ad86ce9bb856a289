"""NetBed: launch one process per rank, each in its own rate-limited network namespace.

See :mod:`lynx.testbed` for the picture and the guarantees. A rank is a subprocess started as
``ip netns exec <ns> <command>`` in its own session, with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` (rank 0's address), ``MASTER_PORT`` and
``GLOO_SOCKET_IFNAME`` set, so a script that calls
``torch.distributed.init_process_group("gloo")`` runs over the limited link unchanged.

Example (as root; elsewhere it falls back to loopback and says so)::

    >>> import sys
    >>> from lynx.testbed import NetBed
    >>> with NetBed(world_size=2, rate_mbit=100.0) as bed:
    ...     results = bed.run([sys.executable, "-c", "import os; print(os.environ['RANK'])"])
    >>> [r.stdout.strip() for r in results]
    ['0', '1']
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence, Union

from lynx.errors import LynxConfigError, LynxRuntimeError
from lynx.testbed.netns import (
    RANK_IFNAME,
    NamespaceError,
    TbfShape,
    Topology,
    bed_prefix,
    cleanup_stale,
    create_topology,
    delete_namespaces,
)

__all__ = ["NetBed", "RankResult", "LynxTestbedError", "Command"]

# The same argv for every rank, or a function rank -> argv (e.g. rank-specific arguments).
Command = Union[Sequence[str], Callable[[int], Sequence[str]]]

log = logging.getLogger("lynx.testbed")
_SEQ = itertools.count()
_POLL_S = 0.02
_KILL_GRACE_S = 2.0


class LynxTestbedError(LynxRuntimeError):
    """A rank failed or the run timed out; ``results`` holds every rank's exit code and output."""

    def __init__(self, message: str, results: list["RankResult"], failed_rank: int | None):
        super().__init__(message)
        self.results = results
        self.failed_rank = failed_rank


@dataclass(frozen=True)
class RankResult:
    """How one rank's process ended. ``returncode`` < 0 means killed by that signal;
    ``killed_by_bed`` says the bed killed it (timeout, or another rank failed)."""

    rank: int
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float
    killed_by_bed: bool = False


class NetBed:
    """``world_size`` ranks, each in a namespace whose link is limited to ``rate_mbit``.

    Args:
        world_size: number of ranks (processes per :meth:`run`).
        rate_mbit: link rate per rank and direction in Mbit/s (10^6 bit/s); ``None`` for
            namespaces without a limit (veth speed).
        latency_ms: queueing delay the tbf queue may add at the rate (sets its ``limit``).
        mode: ``"auto"`` — namespaces if possible, else loopback with a logged warning;
            ``"netns"`` — namespaces or raise; ``"loopback"`` — 127.0.0.1, never limited.
        ip, tc: the iproute2 binaries (a missing one makes ``"auto"`` fall back).

    ``rate_limited`` says whether links are really limited; ``fallback_reason`` why not.
    """

    def __init__(self, world_size: int, rate_mbit: float | None = 100.0, *,
                 latency_ms: float = 50.0,
                 mode: Literal["auto", "netns", "loopback"] = "auto",
                 ip: str = "ip", tc: str = "tc") -> None:
        if not isinstance(world_size, int) or not 1 <= world_size <= 250:
            raise LynxConfigError(f"NetBed: world_size must be an int in 1..250, got {world_size!r}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise LynxConfigError(f"NetBed: rate_mbit must be > 0 or None, got {rate_mbit!r}")
        if not latency_ms > 0:
            raise LynxConfigError(f"NetBed: latency_ms must be > 0, got {latency_ms!r}")
        if mode not in ("auto", "netns", "loopback"):
            raise LynxConfigError(
                f"NetBed: mode must be 'auto', 'netns' or 'loopback', got {mode!r}")
        self.world_size = world_size
        self.rate_mbit = rate_mbit
        self.shape = TbfShape.for_rate(rate_mbit, latency_ms) if rate_mbit is not None else None
        self.fallback_reason: str | None = None
        self._ip = ip
        self._topology: Topology | None = None
        self._runs = 0
        if mode == "loopback":
            self.fallback_reason = "mode='loopback' requested"
            return
        try:
            if os.geteuid() != 0:
                raise NamespaceError("not running as root (network namespaces need CAP_SYS_ADMIN)")
            cleanup_stale(ip)
            self._topology = create_topology(bed_prefix(next(_SEQ)), world_size, self.shape,
                                             ip=ip, tc=tc)
        except NamespaceError as exc:
            if mode == "netns":
                raise
            self.fallback_reason = str(exc)
            log.warning("lynx.testbed: cannot create network namespaces (%s); falling back to "
                        "loopback 127.0.0.1 WITHOUT a rate limit", exc)
            return
        atexit.register(self.close)

    # -- what a rank sees -------------------------------------------------------------
    @property
    def rate_limited(self) -> bool:
        """True when ranks talk over tbf-limited veth links, False on the loopback fallback."""
        return self._topology is not None and self.shape is not None

    @property
    def uses_namespaces(self) -> bool:
        return self._topology is not None

    @property
    def namespaces(self) -> list[str]:
        """Namespaces this bed owns (rank namespaces, then the hub); empty once closed."""
        return [] if self._topology is None else self._topology.namespaces

    @property
    def addresses(self) -> list[str]:
        if self._topology is None:
            return ["127.0.0.1"] * self.world_size
        return list(self._topology.addresses)

    @property
    def ifname(self) -> str:
        return RANK_IFNAME if self._topology is not None else "lo"

    def exec_prefix(self, rank: int) -> list[str]:
        """Argv prefix that runs a command in ``rank``'s namespace (empty on loopback)."""
        self._check_rank(rank)
        if self._topology is None:
            return []
        return [self._ip, "netns", "exec", self._topology.rank_namespaces[rank]]

    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """The torch.distributed environment of ``rank`` (to merge over ``os.environ``)."""
        self._check_rank(rank)
        return {
            "RANK": str(rank), "LOCAL_RANK": "0" if self._topology else str(rank),
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": "1" if self._topology
            else str(self.world_size),
            "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": self.ifname,
        }

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LynxConfigError(f"NetBed: rank {rank} out of range 0..{self.world_size - 1}")

    def _free_port(self) -> int:
        self._runs += 1
        if self._topology is not None:
            # Fresh namespaces own all their ports; a new one per run avoids TIME_WAIT.
            return 29500 + self._runs % 1000
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    # -- running ----------------------------------------------------------------------
    def run(self, command: Command, env: Mapping[str, str] | None = None,
            timeout_s: float = 300.0, cwd: str | None = None,
            check: bool = True) -> list[RankResult]:
        """Run ``command`` once per rank, concurrently, and wait for all.

        ``command`` is an argv (the same for every rank; ranks tell themselves apart by the
        ``RANK`` variable) or a callable ``rank -> argv``.

        ``env`` is merged over ``os.environ`` and under the rank variables. If a rank exits
        non-zero, the others are killed and (with ``check``) a :class:`LynxTestbedError`
        names the first rank that failed, with its stderr tail. On ``timeout_s`` every rank
        still running is killed and the error names them. Returns results in rank order.
        """
        if self._topology is None and self.fallback_reason is None:
            raise LynxRuntimeError("NetBed.run after close(): make a new NetBed")
        argvs = [list(command(k) if callable(command) else command)
                 for k in range(self.world_size)]
        if not all(argvs):
            raise LynxConfigError("NetBed.run: command is empty")
        port = self._free_port()
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="lynx-netbed-") as tmp:
            procs, files = [], []
            try:
                for rank in range(self.world_size):
                    out = open(os.path.join(tmp, f"{rank}.out"), "w+b")
                    err = open(os.path.join(tmp, f"{rank}.err"), "w+b")
                    files.append((out, err))
                    procs.append(subprocess.Popen(
                        [*self.exec_prefix(rank), *argvs[rank]], cwd=cwd, stdout=out, stderr=err,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                        env={**os.environ, **(env or {}), **self.rank_env(rank, port)}))
                first_failed, killed, timed_out, ends = self._wait(procs, start, timeout_s)
            finally:
                # Also on KeyboardInterrupt or a failed Popen: never leave a rank behind, nor
                # anything a rank spawned into its session (its process group).
                for p in procs:
                    _kill_group(p)
            results = []
            for rank, (p, (out, err)) in enumerate(zip(procs, files)):
                out.seek(0)
                err.seek(0)
                results.append(RankResult(
                    rank=rank, returncode=p.returncode if p.returncode is not None else -9,
                    stdout=out.read().decode(errors="replace"),
                    stderr=err.read().decode(errors="replace"),
                    elapsed_s=ends[rank], killed_by_bed=rank in killed))
                out.close()
                err.close()
        if check and timed_out:
            running = sorted(killed)
            raise LynxTestbedError(
                f"NetBed.run timed out after {timeout_s:.0f} s: rank(s) {running} still running "
                f"were killed. Raise timeout_s, or look for a hang (stderr of rank "
                f"{running[0]}: {_tail(results[running[0]].stderr)})", results, None)
        if check and first_failed is not None:
            r = results[first_failed]
            raise LynxTestbedError(
                f"NetBed.run: rank {first_failed} failed with exit code {r.returncode}; the "
                f"other ranks were stopped. stderr of rank {first_failed}:\n{_tail(r.stderr)}",
                results, first_failed)
        return results

    def _wait(self, procs: list[subprocess.Popen], start: float,
              timeout_s: float) -> tuple[int | None, set[int], bool, list[float]]:
        """Poll until all exit, one fails (kill the rest) or time runs out (kill all)."""
        ends: list[float | None] = [None] * len(procs)

        def elapsed() -> list[float]:
            now = time.monotonic() - start
            return [now if e is None else e for e in ends]

        while True:
            codes = [p.poll() for p in procs]
            for k, c in enumerate(codes):
                if c is not None and ends[k] is None:
                    ends[k] = time.monotonic() - start
            failed = [k for k, c in enumerate(codes) if c is not None and c != 0]
            if failed:
                # Among ranks found failed in the same poll, the lowest is reported; the
                # others usually fail *because* of it (a closed gloo connection).
                killed = {k for k, c in enumerate(codes) if c is None}
                times = elapsed()
                for k in killed:
                    _kill_group(procs[k])
                return failed[0], killed, False, times
            if all(c is not None for c in codes):
                return None, set(), False, elapsed()
            if time.monotonic() - start > timeout_s:
                killed = {k for k, c in enumerate(codes) if c is None}
                times = elapsed()
                for k in killed:
                    _kill_group(procs[k])
                return None, killed, True, times
            time.sleep(_POLL_S)

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """Delete this bed's namespaces (idempotent; also registered with ``atexit``)."""
        if self._topology is None:
            return
        left = delete_namespaces(self._topology.namespaces, ip=self._ip)
        self._topology = None
        self.fallback_reason = self.fallback_reason or "closed"
        atexit.unregister(self.close)
        if left:
            log.warning("lynx.testbed: could not delete namespaces %s; run "
                        "lynx.testbed.cleanup_stale() or `ip netns del` them", left)

    def __enter__(self) -> "NetBed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = (f"netns {self._topology.hub[:-3]}*" if self._topology else
                 f"loopback ({self.fallback_reason})")
        rate = f"{self.rate_mbit} Mbit/s" if self.rate_limited else "unlimited"
        return f"NetBed(world_size={self.world_size}, {rate}, {where})"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the rank's process group (it and anything it spawned), SIGKILL if it lingers.

    The group is the session ``start_new_session`` made for this rank, so only processes
    this bed started are signalled. For a rank that already exited, this sweeps what it
    may have left running in its group (an ESRCH when there is nothing is ignored).
    """
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, grace in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty)"
