"""Top-k per row with a defined tie rule, by a tournament over groups: DeMo's coefficient pick.

``topk_rows(x, k)`` returns, for every row of an ``(N, E)`` tensor, the indices of its ``k``
largest magnitudes ``|x|``, **ties broken towards the lower index** — the set a
stable descending sort would put first (the rule of the NumPy reference in ``tests/optim``).
The order of the ``k`` indices within a row is unspecified.

How: the row is cut into groups of ``s`` entries (and the groups into groups again while that
pays). Ordering groups by ``(group maximum desc, group index asc)``, the ``k`` best entries lie
in the ``k`` best groups: a group outside them has ``k`` groups ahead of it, each holding an
entry that beats every entry of the outsider (larger, or equal and at a lower index, since
groups are contiguous). So one ``amax`` per level, then a ``torch.topk`` over ``k·s``
candidates per level, top down. Keys are made unique — ``(value bits << b) | (n − 1 − index)``
in an int64, the bits of a non-negative float ordering as the float does — so ``torch.topk``
(which breaks ties arbitrarily) picks exactly this set. Float dtypes whose bits do not leave
room for the index (float64) use a stable sort instead: same set, slower.

For DeMo's 64×64 chunks and ``k = 32`` (4096 entries per row): levels of 8 and 8, three
``topk`` over 64, 256 and 256 candidates instead of one over 4096: faster on a CPU core than
``abs`` + one ``torch.topk`` (the ``topk`` calls are half of it; levels of 4 or of pairs were no
faster: each level costs a few small ops). The timings per step: ``docs/optimizers.md``.

Example::

    >>> import torch
    >>> from lynx.optim.topk import topk_rows
    >>> m = torch.tensor([[1.0, 3.0, -3.0, 0.5, 3.0, 2.0]])
    >>> sorted(topk_rows(m, 2)[0].tolist())        # three 3.0s: the two lowest indices win
    [1, 2]
"""

from __future__ import annotations

import torch

__all__ = ["topk_rows", "group_levels"]

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_VALUE_BITS = {torch.float32: 31, torch.float16: 15, torch.bfloat16: 15}  # sign bit is 0


def _bits(n: int) -> int:
    return max(1, (n - 1).bit_length())


def group_levels(entries: int, k: int, smallest: int = 8) -> list[int]:
    """Group sizes, bottom up, for rows of ``entries``: each level keeps ``k·s < n/2`` candidates."""
    sizes: list[int] = []
    n = entries
    while n > 4 * k:
        s = next((d for d in range(smallest, n // (2 * k) + 1) if n % d == 0), None)
        if s is None:
            break
        sizes.append(s)
        n //= s
    return sizes


def _pick(values: torch.Tensor, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Among candidates ``ids`` (N, c) with integer ``values`` (N, c), the k best ids."""
    key = (values.to(torch.int64) << _bits(n)) | (n - 1 - ids)  # unique: lower id wins a tie
    return ids.gather(1, key.topk(k, dim=1, sorted=False).indices)  # (N, k)


def topk_rows(x: torch.Tensor, k: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Indices ``(N, k)`` of the k largest ``|x|`` of each row of ``x`` ``(N, E)``, ties → lower index.

    ``scratch`` (``x``'s shape and dtype) is an optional reusable buffer for the magnitudes.
    """
    n_rows, entries = x.shape
    if not 0 < k <= entries:
        raise ValueError(f"topk_rows: k={k} must be in 1..{entries} (the row length)")
    view = _INT_VIEW.get(x.dtype)
    if view is None or _VALUE_BITS[x.dtype] + _bits(entries) > 63:
        return torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    sizes = group_levels(entries, k)
    device = x.device
    if not sizes:
        bits = torch.abs(x, out=scratch).view(view)  # (N, E)
        return _pick(bits, torch.arange(entries, device=device).expand(n_rows, -1), entries, k)
    # The bottom level's magnitudes are stored group-minor: mag[n, i, g] = |x[n, g·s + i]|, so
    # the groups' maxima are a reduction over the outer dimension (fast), and group g is still
    # the contiguous index range [g·s, g·s + s).
    s0, groups = sizes[0], entries // sizes[0]
    mag = (
        torch.empty((n_rows, s0, groups), dtype=x.dtype, device=device)
        if scratch is None
        else scratch.view(n_rows, s0, groups)
    )
    torch.abs(x.view(n_rows, groups, s0).transpose(1, 2), out=mag)  # (N, s0, G), contiguous
    bottom = mag.view(view)  # (N, s0, G) integer bits, ordered as the floats
    levels = [bottom.amax(1)]  # (N, G) group maxima
    for s in sizes[1:]:
        levels.append(levels[-1].view(n_rows, -1, s).amax(2))  # (N, n/s) maxima of groups of groups
    top = levels[-1]
    chosen = _pick(top, torch.arange(top.shape[1], device=device).expand(n_rows, -1), top.shape[1], k)  # (N, k)
    for depth in range(len(levels) - 2, -1, -1):  # walk down: chosen groups' members are candidates
        lower = levels[depth]
        s = lower.shape[1] // levels[depth + 1].shape[1]
        ids = (chosen.unsqueeze(2) * s + torch.arange(s, device=device)).reshape(n_rows, -1)  # (N, k·s)
        chosen = _pick(lower.gather(1, ids), ids, lower.shape[1], k)
    within = torch.arange(s0, device=device)
    ids = (chosen.unsqueeze(2) * s0 + within).reshape(n_rows, -1)  # (N, k·s0) entry indices
    where = (within * groups + chosen.unsqueeze(2)).reshape(n_rows, -1)  # their places in ``bottom``
    return _pick(bottom.reshape(n_rows, -1).gather(1, where), ids, entries, k)
