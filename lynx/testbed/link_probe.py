"""Worker of :func:`lynx.testbed.measure_link`: times gloo send/recv between ranks 0 and 1.

Run by a :class:`~lynx.testbed.NetBed` on every rank (``python -m lynx.testbed.link_probe
--bytes N --repeats R [--pause S]``). Rank 0 sends ``N`` bytes to rank 1 and waits for a
one-byte acknowledgement, ``R`` times after a short warm-up (each after ``S`` seconds of rest); it prints one line
``LYNX_LINK {"bytes": N, "seconds": [...]}``. Other ranks only join the group.

Example::

    >>> from lynx.testbed import NetBed, measure_link
    >>> with NetBed(world_size=2, rate_mbit=100.0) as bed:
    ...     m = measure_link(bed)
    >>> 50 < m.measured_mbit < 110    # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import json
import time

__all__ = ["MARKER", "main"]

MARKER = "LYNX_LINK "


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds the link rests before each repeat")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    payload = torch.zeros(args.bytes, dtype=torch.uint8)  # (bytes,)
    ack = torch.zeros(1, dtype=torch.uint8)
    seconds = []
    if rank in (0, 1):
        # Warm-up (up to 256 KB, not timed): connects the pair and grows the TCP window.
        for timed in [False] + [True] * args.repeats:
            data = payload if timed else payload[: 1 << 18]
            if args.pause > 0 and rank == 0:   # a rested link (a tbf bucket full again), rank 1 in recv
                time.sleep(args.pause)
            start = time.perf_counter()
            if rank == 0:
                dist.send(data, dst=1)
                dist.recv(ack, src=1)
            else:
                dist.recv(data, src=0)
                dist.send(ack, dst=0)
            if timed:
                seconds.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        print(MARKER + json.dumps({"bytes": args.bytes, "seconds": seconds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
