"""The vectorised paths equal their plain formulations: bit for bit where no reduction is reordered.

- bit packing: the multiply-based 1-bit packers and the byte-width packers against a bit-plane
  packer written here;
- Lion's bit-sliced majority vote against counting the votes;
- DeMo's batched bucket kernel (one DCT / top-k / scatter per chunk shape, DCT-domain momentum)
  against DeMo's step in exact arithmetic, at W = 1 and 3, over several steps. Not bitwise: a
  stacked DCT and a per-tensor one are GEMMs of different shapes, and a BLAS sums them in
  orders that depend on the shape, the thread count and the CPU (2 threads on an AVX2 MKL
  path differ in the last bits). The transforms are held to a bound derived from fp32
  rounding (``rounding.py``); everything after them (top-k, rounding of the sent values,
  error feedback, packing, the mean over ranks) is checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from lynx.optim.bitpack import gather_flags, pack_bits, spread_flags, unpack_bits
from lynx.optim.demo_batch import BucketKernel, from_grid
from lynx.optim.demo_payload import plan_bucket
from lynx.optim.lion import majority_bits

from rounding import decode_bound, encode_bound, exact_decode, exact_encode, gamma


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


def row_entries(row, tp, value_dtype):
    """One tensor's ``(values, indices)``, ``(n_chunks, k)`` each, read back out of a payload row."""
    n = tp.layout.n_chunks * tp.k
    vals = row[tp.value_offset : tp.value_offset + tp.value_bytes].view(value_dtype).view(-1, tp.k)
    packed = row[tp.index_offset : tp.index_offset + tp.index_bytes]
    return vals, unpack_bits(packed, tp.index_bits, n).view(-1, tp.k)


def check_compress(kernel, before, grads, settings, row, value_dtype, where):
    """The kernel's step against DeMo's in exact arithmetic, within the derived fp32 bound.

    A stacked DCT and a per-tensor one may sum in different orders (tests/optim/rounding.py),
    so the momentum is compared with the bound, not bit for bit. What the kernel does after the
    transform uses no reduction and is checked exactly: the sent indices are the stable top-k
    of its own momentum, the values their rounding, the momentum keeps only the rounding error.
    """
    for j, tp in enumerate(kernel.plan.tensors):
        if not tp.compressed:
            continue
        decay, lr = settings[j]
        vals, idx = row_entries(row, tp, value_dtype)  # (n, k) each
        after = kernel.momentum_of(j)  # (n, E) with the sent part removed
        stepped = after.scatter(1, idx, after.gather(1, idx) + vals.float())  # exact: residual + rounded
        top = torch.sort(stepped.abs(), dim=1, descending=True, stable=True).indices[:, : tp.k]
        assert torch.equal(idx.sort(dim=1).values, top.sort(dim=1).values), (where, SHAPES[j])
        assert torch.equal(vals, stepped.gather(1, idx).to(value_dtype)), (where, SHAPES[j])
        # M ← β·M + lr·DCT(g): three roundings (β and lr to fp32, the product, the sum) and the DCT's.
        exact = decay * before[j].double() + lr * exact_encode(grads[j], tp.layout)
        bound = gamma(3) * (decay * before[j].double().abs()) + (1 + gamma(3)) * abs(lr) * encode_bound(
            grads[j], tp.layout
        )
        bound += gamma(3) * abs(lr) * exact_encode(grads[j], tp.layout).abs()
        assert ((stepped.double() - exact).abs() <= bound).all(), (where, SHAPES[j])
        assert bound.max() <= 1e-4 * exact.abs().max(), "the bound must be tight enough to catch a wrong kernel"


def check_decompress(signs, rows, plan, value_dtype):
    """Every rank's rows → ``sign(IDCT(mean))``: the sign is exact wherever the bound decides it.

    The mean over the ranks that sent a coefficient is elementwise (a sum in rank order, then a
    division) and reproduced here with the same ops; the inverse DCT is compared with its bound:
    where ``|exact| >`` the bound, any fp32 order gives the exact sign, and all-zero sums give 0.
    """
    undecided = total = 0
    for j, tp in enumerate(plan.tensors):
        if not tp.compressed:
            continue
        sent = [row_entries(row, tp, value_dtype) for row in rows]
        vals = torch.cat([v.float() for v, _ in sent], dim=1)  # (n, W·k) in rank order
        idx = torch.cat([i for _, i in sent], dim=1)
        mean = torch.zeros((tp.layout.n_chunks, tp.layout.chunk_elements))
        mean.scatter_reduce_(1, idx, vals, reduce="mean", include_self=False)
        exact, bound = exact_decode(mean, tp.layout), decode_bound(mean, tp.layout)
        decided = (exact.abs() > bound) | (bound == 0)
        got = from_grid(signs[j], tp.layout)
        assert torch.equal(got[decided], exact.sign().float()[decided]), SHAPES[j]
        undecided += int((~decided).sum())
        total += decided.numel()
    assert undecided <= 1e-3 * total, f"{undecided} of {total} signs within rounding of 0"


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("value_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mixed", [False, True])
def test_bucket_kernel_matches_demo_step(world, value_dtype, mixed):
    plan = plan_bucket([(s, torch.float32) for s in SHAPES], topk=6, chunk=32, value_dtype=value_dtype)
    assert {tp.compressed for tp in plan.tensors} == {True, False}  # both kinds in one bucket
    kernels = [
        BucketKernel(plan, [torch.float32] * len(SHAPES), value_dtype, torch.device("cpu")) for _ in range(world)
    ]
    # mixed: members of one chunk group with different (decay, lr), as from two param groups
    settings = [(0.9, 0.1) if mixed and j % 2 else (0.99, 0.01) for j in range(len(SHAPES))]
    g = torch.Generator().manual_seed(7)
    for step in range(3):  # several steps: momentum carries over, reused buffers must come back clean
        grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(world)]
        grads[0][3][:32] = 0.0  # whole zero chunks: ties in the top-k (on the first step)
        rows = []
        for rank, (kernel, gs) in enumerate(zip(kernels, grads)):
            before = {j: kernel.momentum_of(j).clone() for j, tp in enumerate(plan.tensors) if tp.compressed}
            given = list(gs)
            given[0] = gs[0].t().contiguous().t()  # a non-contiguous gradient goes through the copying path
            rows.append(kernel.compress(given, settings))
            check_compress(kernel, before, gs, settings, rows[-1], value_dtype, (step, rank))
        gathered = torch.stack(rows)  # (W, P)
        signs = kernels[0].decompress(gathered)
        check_decompress(signs, rows, plan, value_dtype)
        for other in kernels[1:]:  # replicas run the same ops on the same rows: bitwise
            theirs = other.decompress(gathered)
            assert all(torch.equal(theirs[j], signs[j]) for j in signs)


def test_bucket_kernel_rounding_bound_can_fail():
    """The bound catches a real error: a step whose decay is off by 0.1% fails it."""
    plan = plan_bucket([((64, 64), torch.float32)], topk=6, chunk=32, value_dtype=torch.float32)
    kernel = BucketKernel(plan, [torch.float32], torch.float32, torch.device("cpu"))
    grads = [torch.randn(64, 64, generator=torch.Generator().manual_seed(1))]
    kernel.compress(grads, [(0.9, 0.1)])
    before = {0: kernel.momentum_of(0).clone()}
    row = kernel.compress(grads, [(0.9, 0.1)])
    check_compress(kernel, before, grads, [(0.9, 0.1)], row, torch.float32, "true step")
    with pytest.raises(AssertionError):
        check_compress(kernel, before, grads, [(0.9 * 1.001, 0.1)], row, torch.float32, "decay off by 0.1%")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "rows,entries,k", [(9, 4096, 32), (5, 64, 32), (4, 841, 5), (6, 1000, 3), (3, 4096, 1), (2, 30, 30)]
)
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
