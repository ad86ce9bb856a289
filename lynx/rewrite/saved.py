"""Who owns a saved tensor, and how many saved bytes are alive.

The profile attributes every tensor autograd saves to the fx node that produced its storage
(or, for tensors created inside an op such as a dropout mask, to the node that was running).
The rewrite must drop exactly what the plan accounted for, so it applies the profile's rule
(:class:`lynx.frontend.profile.SaveTracker`), keyed on live storages (see :class:`SaveTracker` below).

:class:`SavedBytesMeter` counts the bytes of distinct storages the stage holds for backward
(kept saved tensors and recomputed ones in the cache) while they are alive, using weak
references on the storages, so the peak it reports is what was really resident.

Example::

    >>> import torch
    >>> meter = SavedBytesMeter()
    >>> t = torch.zeros(4)
    >>> meter.add(t, "stage")
    >>> meter.live_bytes, meter.peak_bytes
    (16, 16)
    >>> del t
    >>> meter.live_bytes, meter.peak_bytes
    (0, 16)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lynx.frontend.profile import SaveTracker as _ProfileSaveTracker
from lynx.frontend.profile import storage_key as _profile_storage_key

__all__ = ["storage_key", "SaveTracker", "SavedBytesMeter", "tensor_leaves"]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a node's (possibly nested) output, in pytree order."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


# The rule is the profile's, shared so that what a stage drops is exactly what the profile
# counted (its storages are tracked with weak references, so reused addresses are not confused).
SaveTracker = _ProfileSaveTracker
storage_key = _profile_storage_key


class SavedBytesMeter:
    """Live and peak bytes of distinct storages held for backward, per category.

    ``add(t, category)`` registers ``t``'s storage once; its bytes count until the storage is
    freed (a weak-reference finaliser subtracts them). Categories let the caller separate
    bytes owned by the stage's nodes (what the plan predicts) from other held tensors.
    """

    def __init__(self) -> None:
        self._live: dict[int, tuple[weakref.ref, int, str]] = {}
        self.live_by: dict[str, int] = {}
        self.peak_by: dict[str, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, t: torch.Tensor, category: str) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self._live.get(key)
        if entry is not None and entry[0]() is storage:
            return
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, lambda _r, k=key: self._drop(k, _r))
        self._live[key] = (ref, nbytes, category)
        self.live_by[category] = self.live_by.get(category, 0) + nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_by[category] = max(self.peak_by.get(category, 0), self.live_by[category])

    def _drop(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is None or entry[0] is not ref:
            return
        del self._live[key]
        _, nbytes, category = entry
        self.live_by[category] -= nbytes
        self.live_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_by = dict(self.live_by)
