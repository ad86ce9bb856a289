"""Bit packing of small non-negative integers into bytes, vectorised (no per-element Python).

The wire format is a little-endian bit stream: value ``i`` occupies bits
``[i·bits, (i+1)·bits)`` of the output, least significant bit first, and the stream is
zero-padded to whole bytes. Widths that divide a byte (1, 2, 4, 8) pack whole values per byte
with a few shift-or passes over ``n·bits/8`` bytes; other widths (DeMo's 12-bit indices, ...)
go through bit planes. Unpacking gathers the (at most ``ceil((bits+7)/8)``) bytes each value
touches and shifts it out, so it costs a handful of passes over the values whatever the width.

Example::

    >>> import torch
    >>> from lynx.optim.bitpack import pack_bits, unpack_bits
    >>> packed = pack_bits(torch.tensor([5, 0, 7, 2]), bits=3)   # 12 bits → 2 bytes
    >>> packed.tolist(), unpack_bits(packed, bits=3, count=4).tolist()
    ([197, 5], [5, 0, 7, 2])
    >>> pack_bits(torch.tensor([True, False, True, True]), bits=1).tolist()
    [13]
"""

from __future__ import annotations

import math

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_bytes", "gather_flags", "spread_flags"]

_BYTE_WIDTHS = (1, 2, 4, 8)  # widths that pack whole values into each byte
# Eight 0/1 bytes read as one little-endian int64 x = Σ b_j·2^(8j): x·GATHER puts Σ b_j·2^j in
# the top byte (the partial products never carry into it). SPREAD does the reverse.
_GATHER = 0x0102040810204080
_SPREAD_SELECT = -0x7FBFDFEFF7FBFDFF  # 0x8040201008040201 as int64: byte j keeps bit j
_ONES = 0x0101010101010101
_SEVENS = 0x7F7F7F7F7F7F7F7F


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits take: ``ceil(count·bits/8)``."""
    return math.ceil(count * bits / 8)


def _shift_or_columns(cols: torch.Tensor, bits: int) -> torch.Tensor:
    """``(m, per)`` uint8 values ``< 2**bits`` → ``(m,)`` bytes, column ``j`` at bit ``j·bits``."""
    per = cols.shape[1]
    out = cols[:, per - 1].clone()  # (m,)
    for j in range(per - 2, -1, -1):
        out.bitwise_left_shift_(bits).bitwise_or_(cols[:, j])
    return out


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a storage offset that allows a view as int64."""
    x = x.contiguous()
    return x if x.storage_offset() % 8 == 0 else x.clone()


def gather_flags(flags: torch.Tensor) -> torch.Tensor:
    """``(8m,)`` uint8 0/1 flags → ``(m,)`` bytes, flag ``j`` of each eight at bit ``j``."""
    words = _aligned(flags).view(torch.int64)  # (m,) eight flags each
    # int64 products wrap; the top byte (all we keep) is exact.
    return words.mul(_GATHER).bitwise_right_shift_(56).to(torch.uint8)  # (m,)


def spread_flags(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`gather_flags`: ``(..., m)`` bytes → ``(..., 8m)`` uint8 0/1 flags."""
    words = packed.to(torch.int64).mul_(_ONES).bitwise_and_(_SPREAD_SELECT)  # byte j: bit j or 0
    # Byte j is 0 or 2^j: adding 0x7F sets its top bit iff it was non-zero, without a carry.
    flags = words.add_(_SEVENS).bitwise_right_shift_(7).bitwise_and_(_ONES)  # (..., m) 0/1 bytes
    return flags.view(torch.uint8)  # (..., 8m)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers ``< 2**bits`` into ``ceil(n·bits/8)`` bytes (LSB first).

    Only the low ``bits`` bits of each value are kept (as a bit-plane packer would).
    """
    flat = values.reshape(-1)  # (n,)
    n = flat.numel()
    if bits in _BYTE_WIDTHS:
        if flat.dtype == torch.bool:
            small = flat.view(torch.uint8)  # (n,) 0/1, no copy
        else:
            small = flat.to(torch.uint8)  # (n,) low 8 bits, two's complement like the shifts
            if bits < 8:
                small = small & ((1 << bits) - 1)
        per = 8 // bits
        pad = (-n) % per
        if pad:
            small = torch.cat([small, small.new_zeros(pad)])
        if per == 1:
            return small.clone() if small.data_ptr() == flat.data_ptr() else small
        if per == 8:
            return gather_flags(small)  # (ceil(n/8),)
        return _shift_or_columns(small.reshape(-1, per), bits)  # (ceil(n/per),)
    # Bit planes: (n, bits) of 0/1, then 8 planes per byte.
    wide = torch.int32 if bits <= 31 else torch.int64
    shifts = torch.arange(bits, dtype=wide, device=flat.device)
    planes = ((flat.to(wide).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)  # (n·bits,)
    pad = (-planes.numel()) % 8
    if pad:
        planes = torch.cat([planes, planes.new_zeros(pad)])
    return gather_flags(planes)  # (ceil(n·bits/8),)


def unpack_bits(packed: torch.Tensor, bits: int, count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` values of every leading row.

    ``packed`` is ``(..., nbytes)`` uint8; each row was packed separately. Returns
    ``(..., count)`` in ``dtype`` (int64 by default; uint8 is enough up to 8 bits).
    """
    lead = packed.shape[:-1]
    if bits in _BYTE_WIDTHS:
        per = 8 // bits
        if per == 1:
            return packed[..., :count].to(dtype)
        if per == 8:
            return spread_flags(packed)[..., :count].to(dtype)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (per,)
        values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., nbytes, per)
        return values.reshape(*lead, packed.shape[-1] * per)[..., :count].to(dtype)
    # Each value spans at most `span` bytes starting at byte offset // 8: gather them into
    # one integer word and shift the value out.
    offsets = torch.arange(count, dtype=torch.int64, device=packed.device) * bits  # (count,)
    first, shift = offsets // 8, offsets % 8
    span = (7 + bits + 7) // 8
    nbytes = packed.shape[-1]
    padded = packed
    need = (count - 1) * bits // 8 + span if count else 0  # bytes the last value's word reads
    if need > nbytes:
        padded = torch.cat([packed, packed.new_zeros(*lead, need - nbytes)], dim=-1)
    word = torch.zeros(*lead, count, dtype=torch.int64, device=packed.device)  # (..., count)
    for j in range(span):
        word |= padded[..., first + j].to(torch.int64) << (8 * j)
    return ((word >> shift) & ((1 << bits) - 1)).to(dtype)
