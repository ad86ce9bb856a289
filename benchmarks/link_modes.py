"""Why the gloo link's β moves between calibrations: where the host runs this VM's two vCPUs.

Forks ``--pairs`` fresh pairs of processes, one after another, each pinned to a core of its own
as ``lynx calibrate``'s link ranks are (:func:`lynx.calibrate.forked.pin_to_core`), and prints per
pair:

- where the host runs the two vCPUs, seen from inside: two threads pinned to cores 0 and 1 (a
  small C program, where a C compiler is found) bounce a cache line — the fastest round trip
  over 20 batches of 10,000, in ns — and one writes 1 MiB that the other then reads, in GB/s
  (the fastest of 40; beside it a read of the reader's own 1 MiB). The lines come from the
  other core: fast while the two vCPUs share a cache, slow where they do not;
- the gloo link as :func:`lynx.calibrate.links.link_trips` times it: α (half the fastest
  1-element round trip) and, per size from 64 KiB to 4 MiB, β (the size over the fastest one
  way beyond α) as the median and the best of ``--repeats`` repeats of 40 trips, the slope
  between 1 and 4 MiB, and 8 messages of 1 MiB streamed back to back then acknowledged.

On the development VM (2 vCPUs, KVM, AMD EPYC) the probe read two states, switching from one
second to the next: a cache line round trip of ~100 ns and a 1 MiB hand-off at ~22-25 GB/s, or
~400-500 ns and ~10-12 GB/s; and gloo's β fell in two states, ~6.5-8 GB/s at 1 MiB (α ~36 µs)
or ~3.3 GB/s (α ~43 µs), at every size, in the slope and streamed alike. Quiet, one
calibration's repeats mix the two (``lynx calibrate`` takes the best repeat for β since
calibration method 6). Run it near-quiet:
``flock /tmp/notes/bench.lock nice -n -5 python benchmarks/link_modes.py``.

    python benchmarks/link_modes.py --pairs 4
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lynx.calibrate.forked import collect, pin_to_core  # noqa: E402

SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)   # bytes: 64 KiB to 4 MiB
STREAM_BYTES = 1 << 20   # each message of the stream


# Two threads pinned to cores 0 and 1 bounce a cache line (the round trip, ns), then the first
# writes 1 MiB that the second reads (GB/s), beside the first reading its own 1 MiB: C, since a
# Python loop's own ~0.4 µs per turn hides a cache line's 0.1-0.45 µs.
PROBE_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static _Atomic int flag __attribute__((aligned(64)));
static char *buf; static size_t N = 1 << 20; static volatile long sink;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void pin(int c) {
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(c, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}
static long sum(void) { long s = 0; for (size_t i = 0; i < N; i += 8) s += *(long *)(buf + i); return s; }
static void *peer(void *a) {
  pin(1);
  for (int i = 0; i < 200000; i++) { while (atomic_load(&flag) != 1); atomic_store(&flag, 0); }
  for (int r = 0; r < 40; r++) { while (atomic_load(&flag) != 2); sink = sum(); atomic_store(&flag, 3); }
  return a;
}
int main(void) {
  buf = aligned_alloc(4096, N); memset(buf, 1, N);
  pthread_t t; pthread_create(&t, 0, peer, 0); pin(0);
  double trip = 1e9, handoff = 1e9, own = 1e9;
  for (int k = 0; k < 20; k++) {
    double t0 = now();
    for (int i = 0; i < 10000; i++) { atomic_store(&flag, 1); while (atomic_load(&flag) != 0); }
    double d = (now() - t0) / 10000; if (d < trip) trip = d;
  }
  for (int r = 0; r < 40; r++) {
    memset(buf, r, N); double t0 = now(); atomic_store(&flag, 2); while (atomic_load(&flag) != 3);
    double d = now() - t0; if (d < handoff) handoff = d;
  }
  pthread_join(t, 0);
  for (int r = 0; r < 20; r++) {
    memset(buf, r, N); double t0 = now(); sink = sum(); double d = now() - t0; if (d < own) own = d;
  }
  printf("%.0f %.2f %.2f\n", trip * 1e9, N / handoff / 1e9, N / own / 1e9);
  return 0;
}
"""


def cache_probe(folder: str) -> str:
    """The two cores' cache line round trip and 1 MiB hand-off, in words (needs a C compiler)."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return "cache probe skipped (no C compiler or fewer than 2 cores)"
    binary = os.path.join(folder, "probe")
    if not os.path.exists(binary):
        source = os.path.join(folder, "probe.c")
        Path(source).write_text(PROBE_C)
        subprocess.run([cc, "-O2", "-pthread", "-o", binary, source], check=True)
    trip, handoff, own = subprocess.run([binary], capture_output=True, text=True, check=True).stdout.split()
    return f"cache line round trip {trip} ns, 1 MiB hand-off {handoff} GB/s (own {own})"


def _link(rank: int, store_path: str, repeats: int, out: "mp.Queue") -> None:
    """Both ranks: round trips per size, and a stream; rank 0 puts the seconds on ``out``."""
    pin_to_core(rank)
    torch.set_num_threads(1)
    group = dist.ProcessGroupGloo(dist.FileStore(store_path, 2), rank, 2, datetime.timedelta(seconds=60))
    peer = 1 - rank
    small = torch.zeros(1)
    bufs = {n: torch.zeros(n // 4) for n in SIZES}
    stream_bufs = [torch.zeros(STREAM_BYTES // 4) for _ in range(8)]

    def trip(buf: torch.Tensor) -> float:
        start = time.perf_counter()
        first, second = (group.send, group.recv) if rank == 0 else (group.recv, group.send)
        first([buf], peer, 0).wait()
        second([buf], peer, 0).wait()
        return time.perf_counter() - start

    def stream() -> float:
        start = time.perf_counter()
        post = group.send if rank == 0 else group.recv
        for work in [post([b], peer, 0) for b in stream_bufs]:
            work.wait()
        (group.recv if rank == 0 else group.send)([small], peer, 1).wait()
        return time.perf_counter() - start

    for buf in (small, *bufs.values()):   # warm-up: connections, buffers
        for _ in range(3):
            trip(buf)
    stream()
    rows = [(min(trip(small) for _ in range(100)), {n: min(trip(b) for _ in range(40)) for n, b in bufs.items()},
             min(stream() for _ in range(10))) for _ in range(repeats)]
    if rank == 0:
        out.put(rows)


def link_rows(repeats: int) -> list:
    """Per repeat: the fastest 1-element trip, the fastest trip per size, the fastest stream."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="lynx-link-modes-") as folder:
        out = ctx.Queue()
        procs = [ctx.Process(target=_link, args=(r, os.path.join(folder, "store"), repeats, out)) for r in range(2)]
        items, missing = collect(procs, out, 1, timeout_s=300)   # rank 0's rows; a hung pair is killed
    if missing:
        raise SystemExit(f"link_modes: the pinned pair gave no rows ({missing})")
    return items[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lynx-link-modes-probe-") as folder:
        for pair in range(args.pairs):
            cache = cache_probe(folder)
            rows = link_rows(args.repeats)
            alpha = min(r[0] for r in rows) / 2
            parts = []
            for n in SIZES:
                betas = [n / (r[1][n] / 2 - alpha) / 1e9 for r in rows]
                parts.append(f"{n >> 10} KiB {statistics.median(betas):.2f} (best {max(betas):.2f})")
            one, four = (statistics.median(r[1][n] for r in rows) for n in (1 << 20, 1 << 22))
            slope = 3 * (1 << 20) / ((four - one) / 2) / 1e9
            streamed = statistics.median(8 * STREAM_BYTES / (r[2] - 2 * alpha) / 1e9 for r in rows)
            print(f"pair {pair + 1} (load {os.getloadavg()[0]:.2f}): {cache}; α {alpha * 1e6:.1f} µs; "
                  f"β GB/s {', '.join(parts)}; slope 1-4 MiB {slope:.2f}; "
                  f"8 × 1 MiB streamed {streamed:.2f}", flush=True)


if __name__ == "__main__":
    main()
