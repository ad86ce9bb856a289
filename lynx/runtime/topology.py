"""Where this rank sits: pipeline stage, data-parallel replica and tensor-parallel rank on a
``(pp, dp, tp)`` device mesh.

Ranks are laid out as ``torch.distributed.device_mesh.init_device_mesh(device, (pp, dp, tp),
mesh_dim_names=("pp", "dp", "tp"))`` does, tp innermost (the fastest links: one node's GPUs):
rank ``(s * dp + d) * tp + t`` runs TP rank ``t`` of stage ``s`` of replica ``d``. Pipeline
messages go between the same ``(d, t)`` of neighbouring stages (each TP rank holds the whole,
replicated, boundary value). Weights used by several stages (tied embeddings) get one process
group per ``(d, t)`` joining those stages, so their gradient contributions can be summed.

:func:`select_backend` picks the process-group backend and this rank's device: NCCL and
``cuda:<local rank>`` where CUDA is available, gloo and the CPU otherwise (one code path for
both; :class:`lynx.runtime.Pipeline` uses it). :func:`rank_seed` is the seed each (stage,
replica) draws its dropout masks from; :func:`free_port` a free TCP port on 127.0.0.1 for a
job started on this machine.

Example (inside an initialised process group)::

    topo = make_topology(pp=2, dp=2, tp=2)
    topo.stage, topo.dp_rank, topo.tp_rank, topo.prev_rank, topo.next_rank
    >>> select_backend(0, cuda=False)
    ('gloo', device(type='cpu'))
    >>> rank_seed(0, stage=1, dp_rank=0), rank_seed(0, stage=0, dp_rank=1)
    (1, 1009)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import socket

import torch
import torch.distributed as dist

from lynx.errors import LynxConfigError
from lynx.torch_private import default_store

__all__ = ["Topology", "make_topology", "select_backend", "rank_device", "tied_groups", "rank_seed", "free_port"]


def rank_seed(seed: int, stage: int, dp_rank: int) -> int:
    """The RNG seed of the rank running ``stage`` of replica ``dp_rank`` (its dropout draws)."""
    return seed + 1009 * dp_rank + stage


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a job's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def select_backend(local_rank: int = 0, *, cuda: bool | None = None) -> tuple[str, torch.device]:
    """``("nccl", cuda:<local_rank>)`` when CUDA (and NCCL) are available, else ``("gloo", cpu)``.

    ``cuda`` overrides the detection (tests). With fewer GPUs than local ranks the device
    index wraps around (several ranks per GPU: works with NCCL only on one process per GPU,
    so torchrun should start ``--nproc-per-node`` = number of GPUs).
    """
    if cuda is None:
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
    if local_rank < 0:
        raise LynxConfigError(f"local rank must be >= 0, got {local_rank}")
    if not cuda:
        return "gloo", torch.device("cpu")
    count = max(1, torch.cuda.device_count())
    return "nccl", torch.device("cuda", local_rank % count)


def rank_device() -> torch.device:
    """The device this rank computes on: its current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Topology:
    rank: int
    world: int
    pp: int
    dp: int
    stage: int
    dp_rank: int
    prev_rank: int | None
    next_rank: int | None
    dp_group: Any
    store: Any
    mesh: Any = None
    tp: int = 1
    tp_rank: int = 0

    def rank_of(self, stage: int, dp_rank: int, tp_rank: int | None = None) -> int:
        """The rank of ``(stage, dp_rank, tp_rank)`` (default: this rank's TP rank)."""
        return (stage * self.dp + dp_rank) * self.tp + (self.tp_rank if tp_rank is None else tp_rank)

    @property
    def tp_mesh(self) -> Any:
        """This rank's 1-D tensor-parallel mesh (``mesh["tp"]``)."""
        return self.mesh["tp"]


def make_topology(pp: int, dp: int = 1, device_type: str = "cpu", tp: int = 1) -> Topology:
    """This rank's place on a ``(pp, dp, tp)`` mesh over the default process group."""
    if not dist.is_initialized():
        raise LynxConfigError("torch.distributed is not initialised; launch with torchrun")
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp < 1 or dp < 1 or tp < 1 or pp * dp * tp != world:
        raise LynxConfigError(f"pp={pp} × dp={dp} × tp={tp} = {pp * dp * tp} must equal the world size {world}: "
                              f"launch pp × dp × tp processes (torchrun --nproc_per_node)")
    from torch.distributed.device_mesh import init_device_mesh

    if tp > 1:
        mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        tp_rank = mesh.get_local_rank("tp")
    else:  # no TP group to make: the (pp, dp) mesh of a run without tensor parallelism
        mesh, tp_rank = init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp")), 0
    stage, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    if rank != (stage * dp + dp_rank) * tp + tp_rank:  # the layout the peers below assume
        raise LynxConfigError(f"unexpected device-mesh layout: rank {rank} at (pp {stage}, dp {dp_rank}, tp {tp_rank})")
    store = default_store()
    topo = Topology(rank=rank, world=world, pp=pp, dp=dp, stage=stage, dp_rank=dp_rank, prev_rank=None,
                    next_rank=None, dp_group=mesh.get_group("dp") if dp > 1 else None, store=store, mesh=mesh,
                    tp=tp, tp_rank=tp_rank)
    topo.prev_rank = topo.rank_of(stage - 1, dp_rank) if stage > 0 else None
    topo.next_rank = topo.rank_of(stage + 1, dp_rank) if stage < pp - 1 else None
    return topo


def tied_groups(topo: Topology, stage_param_names: Sequence[set[str]]) -> dict[str, Any]:
    """For each parameter name this rank's stage shares with other stages, its sum group.

    Every rank must call this with the same ``stage_param_names`` (it creates process groups).
    """
    users: dict[str, tuple[int, ...]] = {}
    for s, names in enumerate(stage_param_names):
        for name in names:
            users[name] = users.get(name, ()) + (s,)
    shared = sorted({stages for stages in users.values() if len(stages) > 1})
    groups: dict[tuple[int, ...], Any] = {}
    for stages in shared:
        for d in range(topo.dp):
            for t in range(topo.tp):
                group = dist.new_group([topo.rank_of(s, d, t) for s in stages])
                if d == topo.dp_rank and t == topo.tp_rank and topo.stage in stages:
                    groups[stages] = group
    return {name: groups[stages] for name, stages in users.items() if stages in groups}
