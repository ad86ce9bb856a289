"""Bit packing, chunked DCT, bucketing and wire-byte formulas."""

from __future__ import annotations

import math

import pytest
import torch

from lynx.optim.buckets import (
    all_gather_bytes,
    assign_buckets,
    bits_for,
    pack_bits,
    ring_all_reduce_bytes,
    smallest_int_dtype,
    unpack_bits,
)
from lynx.optim.dct import ChunkLayout, dct_matrix, decode, encode, largest_divisor_at_most
from lynx.optim.demo_payload import plan_bucket, plan_tensor


@pytest.mark.parametrize("bits", [1, 2, 3, 6, 8, 11, 12, 13])
def test_pack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (3, 37), generator=g)
    packed = torch.stack([pack_bits(row, bits) for row in values])  # (3, bytes)
    assert packed.dtype == torch.uint8 and packed.shape[1] == math.ceil(37 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 37), values)


def test_index_sizes():
    assert [bits_for(n) for n in (1, 2, 3, 64, 65, 4096)] == [1, 1, 2, 6, 7, 12]
    assert smallest_int_dtype(256) == torch.uint8
    assert smallest_int_dtype(4096) == torch.int16
    assert smallest_int_dtype(2**20) == torch.int32


def test_dct_matrix_is_the_orthonormal_dct2():
    n = 7
    d = dct_matrix(n, torch.float64)
    for k in range(n):
        for i in range(n):
            scale = math.sqrt((1 if k == 0 else 2) / n)
            assert d[k, i].item() == pytest.approx(scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n)), abs=1e-12)
    assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize(
    "shape, chunk_shape",
    [((), (1,)), ((50257,), (29,)), ((128, 96), (64, 48)), ((4, 3, 10), (12, 10)), ((2048, 6144), (64, 64))],
)
def test_layouts_and_roundtrip(shape, chunk_shape):
    layout = ChunkLayout.for_shape(shape, 64)
    assert layout.chunk_shape == chunk_shape
    if math.prod(shape) <= 200_000:
        x = torch.randn(shape, dtype=torch.float64)
        coeffs = encode(x, layout)
        assert coeffs.shape == (layout.n_chunks, layout.chunk_elements)
        assert torch.allclose(decode(coeffs, layout), x, atol=1e-10)
        assert coeffs.square().sum().item() == pytest.approx(x.square().sum().item())  # orthonormal


def test_largest_divisor():
    assert largest_divisor_at_most(50257, 64) == 29
    assert largest_divisor_at_most(51200, 64) == 64
    assert largest_divisor_at_most(7, 64) == 7


def test_dense_when_compression_does_not_pay():
    assert not plan_tensor((3,), torch.float32, topk=32, chunk=64, value_dtype=torch.bfloat16).compressed
    assert plan_tensor((64,), torch.float32, topk=32, chunk=64, value_dtype=torch.bfloat16).compressed
    assert not plan_tensor((64,), torch.float32, topk=63, chunk=64, value_dtype=torch.float32).compressed
    plan = plan_bucket([((64, 64), torch.float32), ((3,), torch.float32)], 32, 64, torch.bfloat16)
    assert plan.dense_numel == 3 and plan.sparse_bytes % 8 == 0
    assert plan.sparse_bytes == 32 * 2 + 32 * 12 // 8


def test_buckets_reverse_order_and_size():
    buckets = assign_buckets([100, 100, 100, 500, 50], bucket_bytes=200)
    assert buckets == [[4], [3], [2, 1], [0]]
    assert sorted(i for b in buckets for i in b) == list(range(5))


def test_wire_formulas():
    assert ring_all_reduce_bytes(800, 8) == 1400.0
    assert ring_all_reduce_bytes(800, 1) == 0.0
    assert all_gather_bytes(10, 8) == 70.0


def test_no_param_groups_after_construction():
    from lynx.errors import LynxConfigError
    from lynx.optim import DistributedLion

    opt = DistributedLion([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(LynxConfigError, match="constructor"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


@pytest.mark.parametrize("name", ["demo", "lion"])
def test_lr_set_after_load_state_dict_is_used(name):
    """load_state_dict replaces the group dicts: an lr set on the new ones must take effect."""
    from lynx.optim import DeMo, DistributedLion

    def make(params):
        return DeMo(params, lr=0.1) if name == "demo" else DistributedLion(params, lr=0.1)

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8, generator=g)), torch.nn.Parameter(torch.randn(8, generator=g))]
    opt = make(params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    resumed = make(params)
    resumed.load_state_dict(opt.state_dict())
    for group in resumed.param_groups:
        group["lr"] = 0.0  # no update at all
    before = [p.detach().clone() for p in params]
    resumed.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    for group in resumed.param_groups:
        group["lr"] = 0.1
    resumed.step()
    assert not all(torch.equal(p, b) for p, b in zip(params, before))
