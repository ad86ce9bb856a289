"""The vectorised paths equal their plain formulations bit for bit.

- bit packing: the multiply-based 1-bit packers and the byte-width packers against a bit-plane
  packer written here;
- Lion's bit-sliced majority vote against counting the votes;
- DeMo's batched bucket kernel (one DCT / top-k / scatter per chunk shape) against the
  per-tensor encode → top-k → decode → scatter_reduce(mean) it replaces, at W = 1 and 3.
"""

from __future__ import annotations

import pytest
import torch

from lynx.optim.bitpack import gather_flags, pack_bits, spread_flags, unpack_bits
from lynx.optim.dct import ChunkLayout, decode, encode
from lynx.optim.demo_batch import BucketKernel, from_grid
from lynx.optim.demo_payload import plan_bucket
from lynx.optim.lion import majority_bits


def plane_pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference packer: one bit plane per bit, LSB first, summed per byte."""
    flat = values.reshape(-1).to(torch.int64)
    planes = ((flat.unsqueeze(1) >> torch.arange(bits)) & 1).reshape(-1)  # (n·bits,)
    planes = torch.cat([planes, planes.new_zeros((-planes.numel()) % 8)])
    return (planes.reshape(-1, 8) * (1 << torch.arange(8))).sum(dim=1).to(torch.uint8)


def test_flags_all_bytes():
    every = torch.arange(256, dtype=torch.uint8)
    flags = spread_flags(every)  # (2048,)
    assert torch.equal(flags, ((every.unsqueeze(1).long() >> torch.arange(8)) & 1).to(torch.uint8).reshape(-1))
    assert torch.equal(gather_flags(flags), every)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 3, 12, 16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_pack_matches_bit_planes(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    values = torch.randint(0, 2**bits, (n,), generator=g)
    want = plane_pack(values, bits)
    assert torch.equal(pack_bits(values, bits), want)
    if bits == 1:
        assert torch.equal(pack_bits(values.bool(), bits), want)
    for dtype in (torch.int64, torch.uint8 if bits <= 8 else torch.int32):
        assert torch.equal(unpack_bits(want, bits, n, dtype=dtype), values.to(dtype))
    rows = torch.stack([want, want.flip(0)])  # (2, bytes): unpack works per row
    assert torch.equal(unpack_bits(rows, bits, n)[0], values)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 9])
def test_majority_bits_counts_votes(world):
    g = torch.Generator().manual_seed(world)
    ballots = torch.randint(0, 256, (world, 64), dtype=torch.uint8, generator=g)  # (W, m) packed
    ballots[:, :4] = ballots[:1, :4]  # some unanimous bytes
    ups = spread_flags(ballots).to(torch.int64).sum(dim=0)  # (8m,) ranks voting +1
    for tie in (0x55, 0xAA):
        tie_bits = spread_flags(torch.tensor([tie], dtype=torch.uint8)).bool().repeat(64)
        want = torch.where(2 * ups == world, tie_bits, 2 * ups > world)
        assert torch.equal(majority_bits(ballots, tie=tie), gather_flags(want.to(torch.uint8)))


SHAPES = [(128, 192), (192,), (3, 4, 8, 8), (64, 64), (5,), (50,), (128,), (7,), (96, 40)]  # (5,): dense


def per_tensor(momenta, plan, value_dtype):
    """The unbatched DeMo compression (error feedback applied): (values, indices) per tensor."""
    sent = []
    for m, tp in zip(momenta, plan.tensors):
        if not tp.compressed:
            sent.append(None)
            continue
        coeffs = encode(m, tp.layout)  # (n, E)
        idx = coeffs.abs().topk(tp.k, dim=1, sorted=False).indices
        vals = coeffs.gather(1, idx).to(value_dtype)
        m.sub_(decode(torch.zeros_like(coeffs).scatter_(1, idx, vals.to(coeffs.dtype)), tp.layout))
        sent.append((vals, idx))
    return sent


def mean_update(all_sent, tp, dtype):
    vals = torch.cat([s[0].to(dtype) for s in all_sent], dim=1)  # (n, W·k) in rank order
    idx = torch.cat([s[1] for s in all_sent], dim=1)
    mean = torch.zeros((tp.layout.n_chunks, tp.layout.chunk_elements), dtype=dtype)
    mean.scatter_reduce_(1, idx, vals, reduce="mean", include_self=False)
    return decode(mean, tp.layout).sign()


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("value_dtype", [torch.bfloat16, torch.float32])
def test_bucket_kernel_matches_per_tensor(world, value_dtype):
    plan = plan_bucket([(s, torch.float32) for s in SHAPES], topk=6, chunk=32, value_dtype=value_dtype)
    assert {tp.compressed for tp in plan.tensors} == {True, False}  # both kinds in one bucket
    kernels = [BucketKernel(plan, [torch.float32] * len(SHAPES), value_dtype, torch.device("cpu")) for _ in range(world)]
    g = torch.Generator().manual_seed(7)
    for _ in range(2):  # twice: the reused buffers must come back clean
        momenta = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(world)]
        momenta[0][3][:32] = 0.0  # whole zero chunks: ties in the top-k
        want_m = [[m.clone() for m in ms] for ms in momenta]
        want_sent = [per_tensor(ms, plan, value_dtype) for ms in want_m]
        # A non-contiguous momentum goes through the copying path.
        momenta[0][0] = momenta[0][0].t().contiguous().t()
        rows = torch.stack([k.compress(ms) for k, ms in zip(kernels, momenta)])  # (W, P)
        for ms, wms in zip(momenta, want_m):
            for j, tp in enumerate(plan.tensors):
                if tp.compressed:
                    assert torch.equal(ms[j], wms[j])
        signs = kernels[0].decompress(rows)
        for j, tp in enumerate(plan.tensors):
            if tp.compressed:
                want = mean_update([s[j] for s in want_sent], tp, torch.float32)
                assert torch.equal(from_grid(signs[j], tp.layout), want), SHAPES[j]
