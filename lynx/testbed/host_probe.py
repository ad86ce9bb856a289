"""The host's cost of a link's traffic: CPU time each rank loses per byte it sends or receives.

A software-shaped link (the bed's veth pairs, bridge and ``tbf`` queues) is processed by the
kernel on the ranks' own cores — softirqs charged to whatever thread runs there — so a rank
computing while its messages flow computes slower. :func:`measure_link_host` measures it: on
ranks 0 and 1 (each pinned to a core of its own, one thread) a fixed compute loop runs alone,
then again while both send each other ``messages`` messages of ``message_bytes`` (both
directions at once, as a pipeline's activations and gradients flow in its steady state), the
loop running until every message is through; the extra seconds over the bytes through the rank
(sent + received) are its cost per byte (:attr:`LinkHostMeasurement.host_s_per_byte`, the mean
of the two ranks: ``LinkSpec.host_s_per_byte``, which the timeline charges to the compute a
message overlaps). One direction alone measured much less on the bed (issue 27): the figure is
for traffic both ways.

The messages go as a pipeline sends them: one each way at a time, the pair waited for before
the next. Posted all at once (``streamed=True``) they cost the bed's host ~0.6× as much per byte
(on the 2-core VM, 7.0–8.5 ns/B streamed against 11.3–12.9 paced, three of each in one bed):
each message's own wake-ups and small control packets through the ``tbf`` queues weigh as much
as its bytes, and a pipeline pays them per message — over the bed its ranks' compute
lost 13–16 ns/B (gloo's threads' CPU time and softirqs on the rank's core, read from
``/proc``), twice what the streamed probe said. Which rank pays more changes from bed to bed and
does not follow the probe's per-rank split, hence one figure, the mean.

Run as a worker by a :class:`~lynx.testbed.NetBed` (``python -m lynx.testbed.host_probe``); it
prints ``LYNX_LINK_HOST {"rank": r, "idle_s": [...], "busy_s": [...], "bytes": n}`` per rank.

Example::

    >>> from lynx.testbed import NetBed
    >>> from lynx.testbed.host_probe import measure_link_host
    >>> with NetBed(world_size=2, rate_mbit=100.0) as bed:     # doctest: +SKIP
    ...     m = measure_link_host(bed)
    >>> m.host_s_per_byte > 0                                    # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from lynx.errors import LynxConfigError, LynxRuntimeError

__all__ = ["MARKER", "LinkHostMeasurement", "measure_link_host", "main"]

MARKER = "LYNX_LINK_HOST "


@dataclass(frozen=True)
class LinkHostMeasurement:
    """Per rank: seconds of the compute loop alone and with traffic (per repeat), bytes through it."""

    idle_s: list[list[float]]
    busy_s: list[list[float]]
    nbytes: list[int]

    def rank_s_per_byte(self, rank: int) -> float:
        extra = statistics.median(self.busy_s[rank]) - statistics.median(self.idle_s[rank])
        return max(0.0, extra) / self.nbytes[rank]

    @property
    def host_s_per_byte(self) -> float:
        """Mean over the ranks of the extra compute seconds per byte sent or received."""
        return statistics.mean(self.rank_s_per_byte(r) for r in range(len(self.nbytes)))

    def __str__(self) -> str:
        per = ", ".join(f"rank {r} {self.rank_s_per_byte(r) * 1e9:.1f}" for r in range(len(self.nbytes)))
        return f"link host cost {self.host_s_per_byte * 1e9:.1f} ns/B ({per}; traffic both ways)"


def measure_link_host(bed: object, message_bytes: int = 1 << 18, messages: int = 24, repeats: int = 3,
                      timeout_s: float = 300.0, streamed: bool = False) -> LinkHostMeasurement:
    """Run the probe on ``bed`` (a :class:`~lynx.testbed.NetBed` of 2 or more ranks) — see module docstring."""
    if getattr(bed, "world_size", 0) < 2:
        raise LynxConfigError("measure_link_host needs a bed with world_size >= 2")
    if message_bytes <= 0 or messages <= 0 or repeats <= 0:
        raise LynxConfigError(f"measure_link_host: message_bytes, messages and repeats must be > 0, got "
                              f"{message_bytes}, {messages}, {repeats}")
    results = bed.run([sys.executable, "-m", "lynx.testbed.host_probe", "--bytes", str(message_bytes),  # type: ignore[attr-defined]
                       "--messages", str(messages), "--repeats", str(repeats)] + (["--streamed"] if streamed else []),
                      env={"OMP_NUM_THREADS": "1"}, timeout_s=timeout_s)
    rows = {}
    for result in results[:2]:
        for line in result.stdout.splitlines():
            if line.startswith(MARKER):
                row = json.loads(line[len(MARKER):])
                rows[row["rank"]] = row
    if sorted(rows) != [0, 1]:
        raise LynxRuntimeError(f"measure_link_host: ranks 0 and 1 printed no result; rank 0's stderr:\n"
                               f"{results[0].stderr[-2000:]}")
    return LinkHostMeasurement(idle_s=[rows[r]["idle_s"] for r in (0, 1)], busy_s=[rows[r]["busy_s"] for r in (0, 1)],
                               nbytes=[rows[r]["bytes"] for r in (0, 1)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--messages", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streamed", action="store_true", help="post every message at once (see measure_link_host)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from lynx.runtime.sched_slice import request_short_slices

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank in (0, 1):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    request_short_slices()   # as a training rank (lynx.runtime.Pipeline) runs
    gen = torch.Generator().manual_seed(rank)
    # a transformer layer's kind of work at a small size: matmuls, an activation, their backward
    x = torch.randn(256, 256, generator=gen, requires_grad=True)   # (tokens, hidden)
    w1 = torch.randn(256, 1024, generator=gen, requires_grad=True)
    w2 = torch.randn(1024, 256, generator=gen, requires_grad=True)

    def one() -> None:
        ((x @ w1).relu() @ w2).sum().backward()

    n = args.bytes // 4
    idle, busy = [], []
    for _ in range(args.repeats + 1):   # the first round warms up (connects the pair)
        dist.barrier()
        done = threading.Event()

        def exchange() -> None:
            """One message each way at a time, each pair waited before the next (as a pipeline's
            steady state sends an activation and receives a gradient), or all posted at once
            (``--streamed``). gloo's Work learns it completed only inside wait() (the GIL released)."""
            if rank in (0, 1):
                works: list[Any] = []
                for k in range(args.messages):
                    works.append(dist.isend(torch.ones(n), 1 - rank, tag=2 * k + rank))
                    works.append(dist.irecv(torch.empty(n), 1 - rank, tag=2 * k + 1 - rank))
                    if not args.streamed:
                        for w in works:
                            w.wait()
                        works = []
                for w in works:
                    w.wait()
            done.set()

        threading.Thread(target=exchange, daemon=True).start()
        start, iters = time.perf_counter(), 0
        while not done.is_set() or iters < 2:
            one()
            iters += 1
        with_s = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()   # the same work, no traffic
        for _ in range(iters):
            one()
        idle.append(time.perf_counter() - start)
        busy.append(with_s)
    dist.barrier()
    if rank in (0, 1):
        print(MARKER + json.dumps({"rank": rank, "idle_s": idle[1:], "busy_s": busy[1:],
                                   "bytes": 2 * args.messages * n * 4}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
