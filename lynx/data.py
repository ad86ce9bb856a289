"""A byte-level text corpus every machine has: the Python standard library's own sources.

No download: the files are read from ``sysconfig.get_paths()["stdlib"]`` in sorted order, so the
same Python version gives the same bytes everywhere. :class:`StdlibBatches` is a picklable
microbatch source keyed by ``(step, dp_rank, microbatch)``: the data position of a run is just
its step, which makes resuming from a checkpoint exact.

Example::

    >>> from lynx.data import StdlibBatches
    >>> source = StdlibBatches(("idx", "targets"), batch=2, seq=16, max_bytes=1 << 16)
    >>> mbs = source(step=0, dp_rank=0, microbatches=2)
    >>> mbs[0]["idx"].shape, bool((mbs[0]["targets"][:, :-1] == mbs[0]["idx"][:, 1:]).all())
    (torch.Size([2, 16]), True)
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from lynx.errors import LynxConfigError

__all__ = ["stdlib_corpus", "StdlibBatches"]

VOCAB = 256


def _sources(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` outside ``site-packages`` and ``test`` folders, sorted as
    paths; those folders are never walked (an installed site-packages holds tens of thousands
    of files)."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "test")]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return sorted(found)


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Up to ``max_bytes`` bytes of the standard library's ``.py`` files as a uint8 tensor."""
    if max_bytes <= 0:
        raise LynxConfigError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in _sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise LynxConfigError(f"no Python sources found under {root}")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


@dataclass(frozen=True)
class StdlibBatches:
    """Microbatches of byte windows; ``targets`` is ``idx`` shifted by one byte.

    ``split="train"`` samples from the first 95% of the corpus, ``"eval"`` from the rest.
    """

    names: tuple[str, str]
    batch: int
    seq: int
    seed: int = 0
    max_bytes: int = 8 << 20
    split: str = "train"

    def _data(self) -> torch.Tensor:
        data = stdlib_corpus(self.max_bytes)
        cut = int(len(data) * 0.95)
        return data[:cut] if self.split == "train" else data[cut:]

    def __call__(self, step: int, dp_rank: int, microbatches: int) -> list[dict[str, torch.Tensor]]:
        data = self._data()
        if len(data) <= self.seq + 1:
            raise LynxConfigError(f"corpus split {self.split!r} has {len(data)} bytes, fewer than seq+1")
        out = []
        for j in range(microbatches):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 10_007 + dp_rank * 101 + j)
            starts = torch.randint(0, len(data) - self.seq - 1, (self.batch,), generator=gen)
            window = torch.stack([data[s: s + self.seq + 1] for s in starts.tolist()]).long()  # (B, T+1)
            out.append({self.names[0]: window[:, :-1], self.names[1]: window[:, 1:]})
        return out
