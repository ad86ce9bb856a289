"""What :meth:`lynx.runtime.Pipeline.state_dict` holds and :meth:`~lynx.runtime.Pipeline.load_state_dict` puts back.

Per rank: its stage's tensors under the model's own parameter names (the pipe's holder module,
``torch.distributed.checkpoint.state_dict``'s model state), its random stream keyed by stage and
replica (:mod:`lynx.runtime.rank_rng`), its step count, and with an optimizer that optimizer's
state keyed by parameter name (torchtitan's form for pipeline stages: each stage's entries are
its own, nothing collides across stages). A compressed optimizer keeps a momentum per replica
(:func:`lynx.runtime.data_parallel.syncs_own_buckets`): one entry per replica, not
de-duplicated. Save them with :func:`lynx.runtime.checkpoint.save_state` (nothing unpickled on
load) or ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from typing import Any

from lynx.errors import LynxConfigError
from lynx.runtime.data_parallel import syncs_own_buckets

__all__ = ["state_dict", "load_state_dict", "rng_key"]


def rng_key(pipe: Any) -> str:
    """The key of ``pipe``'s random stream in a state: its stage and replica."""
    return f"stage{pipe.topology.stage}.replica{pipe.topology.dp_rank}"


def state_dict(pipe: Any, optimizer: Any = None) -> dict[str, Any]:
    """``pipe``'s stage tensors by the model's names, its random stream and step count (and
    ``optimizer``'s state by the same names)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    holder = pipe._holder()
    state: dict[str, Any] = {"model": get_model_state_dict(holder), "steps": pipe.steps_done,
                             # per rank: DCP and save_state keep each rank's own stream
                             "rng": {rng_key(pipe): pipe.rng.state_dict()}}
    if optimizer is not None:
        opt = getattr(optimizer, "inner", optimizer)
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        osd = get_optimizer_state_dict(holder, opt, options=options)
        state["optimizer"] = {f"replica{pipe.topology.dp_rank}": osd} if syncs_own_buckets(opt) else osd
    return state


def load_state_dict(pipe: Any, state: dict[str, Any], optimizer: Any = None) -> None:
    """Put :func:`state_dict`'s content (e.g. after ``dcp.load``) into ``pipe``'s stage and ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    holder = pipe._holder()
    set_model_state_dict(holder, state["model"])
    if "rng" in state:   # absent in states saved before Pipeline owned the random streams
        key = rng_key(pipe)
        if key not in state["rng"]:
            raise LynxConfigError(f"the state holds the random streams of {sorted(state['rng'])}, not this "
                                  f"rank's ({key}): it was saved by another mesh")
        pipe.rng.load_state_dict(state["rng"][key])
    if "steps" in state:
        pipe.steps_done = int(state["steps"])
    if optimizer is not None:
        if "optimizer" not in state:
            raise LynxConfigError("load_state_dict got an optimizer but the state holds none: "
                                  "save with pipe.state_dict(optimizer)")
        opt = getattr(optimizer, "inner", optimizer)
        osd = state["optimizer"]
        osd = osd[f"replica{pipe.topology.dp_rank}"] if syncs_own_buckets(opt) else osd
        set_optimizer_state_dict(holder, opt, osd, options=StateDictOptions(flatten_optimizer_state_dict=True))
