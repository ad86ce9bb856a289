"""The vectorised paths equal their plain formulations bit for bit.

- bit packing: the multiply-based 1-bit packers and the byte-width packers against a bit-plane
  packer written here;
- Lion's bit-sliced majority vote against counting the votes;
- DeMo's batched bucket kernel (one DCT / top-k / scatter per chunk shape, DCT-domain momentum)
  against a per-tensor encode → momentum → top-k → error feedback → scatter_reduce(mean) →
  decode, at W = 1 and 3, over several steps; its row against pack_bits of the indices.
"""

from __future__ import annotations

import pytest
import torch

from lynx.optim.bitpack import gather_flags, pack_bits, spread_flags, unpack_bits
from lynx.optim.dct import decode, encode
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


def per_tensor(states, grads, settings, plan, value_dtype):
    """The unbatched DCT-domain DeMo step (error feedback applied to states): (values, indices) per tensor."""
    sent = []
    for state, g, setting, tp in zip(states, grads, settings, plan.tensors):
        if not tp.compressed:
            sent.append(None)
            continue
        decay, lr = setting
        state.mul_(decay).add_(encode(g, tp.layout), alpha=lr)  # (n, E)
        idx = torch.sort(state.abs(), dim=1, descending=True, stable=True).indices[:, : tp.k]  # ties → lower index
        picked = state.gather(1, idx)
        vals = picked.to(value_dtype, copy=True)
        state.scatter_(1, idx, picked - vals.to(state.dtype))
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
@pytest.mark.parametrize("mixed", [False, True])
def test_bucket_kernel_matches_per_tensor(world, value_dtype, mixed):
    plan = plan_bucket([(s, torch.float32) for s in SHAPES], topk=6, chunk=32, value_dtype=value_dtype)
    assert {tp.compressed for tp in plan.tensors} == {True, False}  # both kinds in one bucket
    kernels = [BucketKernel(plan, [torch.float32] * len(SHAPES), value_dtype, torch.device("cpu")) for _ in range(world)]
    # mixed: members of one chunk group with different (decay, lr), as from two param groups
    settings = [(0.9, 0.1) if mixed and j % 2 else (0.99, 0.01) for j in range(len(SHAPES))]
    want_states = [[torch.zeros(tp.layout.n_chunks, tp.layout.chunk_elements) for tp in plan.tensors]
                   for _ in range(world)]
    g = torch.Generator().manual_seed(7)
    for step in range(3):  # several steps: momentum carries over, reused buffers must come back clean
        grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(world)]
        grads[0][3][:32] = 0.0  # whole zero chunks: ties in the top-k (on the first step)
        want_sent = [per_tensor(st, gs, settings, plan, value_dtype) for st, gs in zip(want_states, grads)]
        # A non-contiguous gradient goes through the copying path.
        grads[0][0] = grads[0][0].t().contiguous().t()
        rows = torch.stack([k.compress(gs, settings) for k, gs in zip(kernels, grads)])  # (W, P)
        for kernel, states in zip(kernels, want_states):
            for j, tp in enumerate(plan.tensors):
                if tp.compressed:
                    assert torch.equal(kernel.momentum_of(j), states[j]), (step, SHAPES[j])
        signs = kernels[0].decompress(rows)
        for j, tp in enumerate(plan.tensors):
            if tp.compressed:
                want = mean_update([s[j] for s in want_sent], tp, torch.float32)
                assert torch.equal(from_grid(signs[j], tp.layout), want), SHAPES[j]


def test_bucket_kernel_row_holds_packed_indices():
    """The row's index region is pack_bits of each tensor's indices, values are the sent ones."""
    plan = plan_bucket([(s, torch.float32) for s in SHAPES], topk=6, chunk=32, value_dtype=torch.bfloat16)
    kernel = BucketKernel(plan, [torch.float32] * len(SHAPES), torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=g) for s in SHAPES]
    states = [torch.zeros(tp.layout.n_chunks, tp.layout.chunk_elements) for tp in plan.tensors]
    sent = per_tensor(states, grads, [(0.9, 1.0)] * len(SHAPES), plan, torch.bfloat16)
    row = kernel.compress(grads, [(0.9, 1.0)] * len(SHAPES))
    for tp, s in zip(plan.tensors, sent):
        if tp.compressed:  # per chunk the same (index, value) pairs; their order is unspecified
            vals, idx = s
            got_vals = row[tp.value_offset : tp.value_offset + tp.value_bytes].view(torch.bfloat16).view(vals.shape)
            packed = row[tp.index_offset : tp.index_offset + tp.index_bytes]
            got_idx = unpack_bits(packed, tp.index_bits, idx.numel()).view(idx.shape)
            order, got_order = idx.argsort(dim=1), got_idx.argsort(dim=1)
            assert torch.equal(got_idx.gather(1, got_order), idx.gather(1, order))
            assert torch.equal(got_vals.gather(1, got_order), vals.gather(1, order))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows,entries,k", [(9, 4096, 32), (5, 64, 32), (4, 841, 5), (6, 1000, 3), (3, 4096, 1), (2, 30, 30)])
def test_topk_rows_is_the_stable_sort_set(dtype, rows, entries, k):
    """The tournament picks what a stable descending sort of |x| puts first: ties → lower index."""
    from lynx.optim.topk import topk_rows

    g = torch.Generator().manual_seed(entries + k)
    for quantum in (None, 4.0, 0.5):  # coarse values: many ties, at the k-th place too
        x = torch.randn(rows, entries, generator=g)
        if quantum:
            x = (x * quantum).round() / quantum
        x[0] = 0.0  # a whole zero row
        x = x.to(dtype)
        want = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(topk_rows(x, k).sort(dim=1).values, want.sort(dim=1).values)
