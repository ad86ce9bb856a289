"""Each rank's own random stream: what dropout in its pipeline stage draws from.

Every (stage, replica) of a run draws from a stream of its own, seeded
``rank_seed(seed, stage, replica) = seed + 1009·replica + stage``: stages draw different masks
(as the layers of one model do), replicas different ones (they train different rows), and
the stream does not depend on the world size beyond that (:func:`lynx.runtime.topology.rank_seed`).
The tensor-parallel ranks of a stage share its stream: a dropout on replicated activations
must draw the same mask on each of them.
:class:`RankRNG` holds the stream's state — the CPU generator's, and the rank's CUDA device's
where it runs on one — and swaps it in around each step (:meth:`RankRNG.active`,
``torch.random.fork_rng``): what the step draws comes from the stream alone, and the caller's
own random state (data shuffling, augmentation) is neither used nor advanced by it.
Recomputation replays the draws of the forward it repeats (:mod:`lynx.rewrite.lower`), so a
plan never changes a mask. :meth:`RankRNG.state_dict` / :meth:`RankRNG.load_state_dict` carry
the stream, so a run stopped and resumed draws what an uninterrupted one does.

Example::

    >>> import torch
    >>> rng = RankRNG(seed=0, stage=1, replica=0, device=torch.device("cpu"))
    >>> with rng.active():
    ...     first = torch.rand(2)
    >>> again = RankRNG(seed=0, stage=1, replica=0, device=torch.device("cpu"))
    >>> again.load_state_dict(RankRNG(seed=0, stage=1, replica=0, device=torch.device("cpu")).state_dict())
    >>> with again.active():
    ...     torch.equal(torch.rand(2), first)
    True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lynx.errors import LynxConfigError

from lynx.runtime.topology import rank_seed

__all__ = ["RankRNG"]


class RankRNG:
    """One rank's random stream (see the module docstring)."""

    def __init__(self, seed: int, stage: int, replica: int, device: torch.device) -> None:
        self.seed = rank_seed(int(seed), stage, replica)
        self.device = device
        self.cpu = torch.Generator().manual_seed(self.seed).get_state()
        self.cuda = None
        if device.type == "cuda":
            self.cuda = torch.Generator(device=device).manual_seed(self.seed).get_state()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stream inside the block; the caller's random state is restored after it."""
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            try:
                yield
            finally:
                self.cpu = torch.get_rng_state()
                if self.cuda is not None:
                    self.cuda = torch.cuda.get_rng_state(self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stream's state as tensors (copies): ``cpu`` and, on a GPU, ``cuda``."""
        state = {"cpu": self.cpu.clone()}
        if self.cuda is not None:
            state["cuda"] = self.cuda.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream :meth:`state_dict` saved."""
        cpu = state.get("cpu") if isinstance(state, dict) else None
        if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.numel() != self.cpu.numel():
            raise LynxConfigError("the state's RNG stream is not a CPU generator state (a uint8 tensor of "
                                  f"{self.cpu.numel()} bytes): save it with pipe.state_dict()")
        self.cpu = cpu.detach().to("cpu", copy=True)
        if self.cuda is not None and isinstance(state.get("cuda"), torch.Tensor):
            self.cuda = state["cuda"].detach().to("cpu", copy=True)
