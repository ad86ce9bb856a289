"""DistributedLion: exactly Lion at W=1; majority vote and average at W=3; ties at W=2."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from optim_spawn import run_world
from lynx.errors import LynxConfigError, LynxRuntimeError
from lynx.optim import DistributedLion
from lynx.optim.lion import lion_wire_bytes

LR, BETAS, WD = 0.01, (0.9, 0.99), 0.1
BUCKET_BYTES = 256  # several buckets


def make_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(10, 4), (4, 3), (3,), (5, 5, 2)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def loss_of(params: list[torch.Tensor], rank: int, step: int) -> torch.Tensor:
    emb, w, b, extra = params
    g = torch.Generator().manual_seed(1000 * step + rank)
    vocab = 6 if rank == 0 else 8  # rows 8, 9 never used: their δ is exactly 0 on every rank
    tokens = torch.randint(0, vocab, (6,), generator=g)
    y = torch.randn(6, 3, generator=g)
    out = emb[tokens] @ w + b  # (6, 3)
    return (out - y).pow(2).mean() + extra.pow(2).sum() * 1e-2 * (1 + rank)


def textbook_lion_step(params, grads, momenta):
    """Lion as published (Chen et al. 2023, Algorithm 2 with decoupled weight decay)."""
    for p, g, m in zip(params, grads, momenta):
        p.mul_(1 - LR * WD)
        update = m.clone().mul_(BETAS[0]).add(g, alpha=1 - BETAS[0]).sign_()
        p.add_(update, alpha=-LR)
        m.mul_(BETAS[1]).add_(g, alpha=1 - BETAS[1])


def test_world_one_is_exactly_lion():
    mine, ref = make_params(), [p.detach().clone() for p in make_params()]
    momenta = [torch.zeros_like(p) for p in ref]
    opt = DistributedLion(mine, lr=LR, betas=BETAS, weight_decay=WD, bucket_bytes=BUCKET_BYTES)
    for t in range(20):
        opt.zero_grad()
        loss_of(mine, 0, t).backward()
        opt.step()
        shadow = [p.clone().requires_grad_() for p in ref]
        loss_of(shadow, 0, t).backward()
        with torch.no_grad():
            textbook_lion_step(ref, [p.grad for p in shadow], momenta)
        assert all(torch.equal(a.detach(), b) for a, b in zip(mine, ref)), f"step {t}"
    decayed = make_params()[0][8:].detach() * (1 - LR * WD) ** 20
    assert torch.allclose(mine[0][8:].detach(), decayed, atol=1e-6)  # unused rows: sign(0) = 0, only decay
    assert opt.last_step_collectives == 0


def expected_update(deltas: list[torch.Tensor], mode: str, step: int) -> torch.Tensor:
    """Σδ aggregation with the documented conventions; ``deltas`` are one bucket's, per rank."""
    world = len(deltas)
    if mode == "avg":
        return torch.stack(deltas).sum(dim=0) / world
    j = torch.arange(deltas[0].numel())
    cast = [torch.where(d == 0, torch.where((j + step + r) % 2 == 0, 1.0, -1.0), d) for r, d in enumerate(deltas)]
    total = torch.stack(cast).sum(dim=0)
    return torch.where(total == 0, torch.where((j + step) % 2 == 0, 1.0, -1.0), total.sign())


def _check_vote(rank: int, world: int, mode: str, steps: int, gather_below: int | None = None) -> dict:
    params = make_params()
    opt = DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, mode=mode, bucket_bytes=BUCKET_BYTES)
    if gather_below is not None:
        opt.avg_gather_below = gather_below
    momenta = [torch.zeros_like(p) for p in params]
    counts = {"n": 0}
    originals = {n: getattr(dist, n) for n in ("all_gather_single", "all_reduce", "all_to_all_single")}
    ties = mismatches = 0
    for t in range(steps):
        opt.zero_grad()
        loss_of(params, rank, t).backward()
        before = [p.detach().clone() for p in params]
        grads = [p.grad.clone() for p in params]
        deltas = [m.mul(BETAS[0]).add(g, alpha=1 - BETAS[0]).sign() for m, g in zip(momenta, grads)]
        for m, g in zip(momenta, grads):
            m.mul_(BETAS[1]).add_(g, alpha=1 - BETAS[1])
        everyone = []  # every rank's δ, gathered by the test itself
        for d in deltas:
            parts = [torch.empty_like(d) for _ in range(world)]
            dist.all_gather(parts, d)
            everyone.append(parts)
        for name, fn in originals.items():
            setattr(dist, name, lambda *a, _fn=fn, **k: (counts.__setitem__("n", counts["n"] + 1), _fn(*a, **k))[1])
        opt.step()
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for members in opt.buckets:
            per_rank = [torch.cat([everyone[i][r].reshape(-1) for i in members]) for r in range(world)]
            if mode == "mavo":
                ties += int((torch.stack(per_rank).sum(0) == 0).sum())
            want = expected_update(per_rank, mode, t)
            offset = 0
            for i in members:
                n = params[i].numel()
                exp = before[i].mul(1 - LR * WD).add(want[offset : offset + n].reshape(params[i].shape), alpha=-LR)
                mismatches += int(not torch.equal(exp, params[i].detach()))
                offset += n
    analytic = lion_wire_bytes([p.numel() for p in params], world, mode, rank=rank, bucket_bytes=BUCKET_BYTES,
                               avg_gather_below=opt.avg_gather_below)
    return dict(mismatches=mismatches, ties=ties, bytes=opt.last_step_bytes, analytic=analytic,
                collectives=counts["n"] // steps, counted=opt.last_step_collectives, buckets=len(opt.buckets),
                final=[p.detach().clone() for p in params])


def _resume(rank: int, world: int) -> tuple[list[float], list[float]]:
    def run(params, opt, start, n):
        out = []
        for t in range(start, start + n):
            opt.zero_grad()
            loss = loss_of(params, rank, t)
            loss.backward()
            opt.step()
            out.append(float(loss.detach()))
        return out

    params = make_params()
    opt = DistributedLion(params, lr=LR, weight_decay=WD)
    run(params, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    straight = run(params, opt, 3, 4)
    buf.seek(0)
    saved = torch.load(buf)
    resumed_params = [p.clone().requires_grad_() for p in saved["params"]]
    resumed = DistributedLion(resumed_params, lr=LR, weight_decay=WD)
    resumed.load_state_dict(saved["opt"])
    return straight, run(resumed_params, resumed, 3, 4)


def _world_three(rank: int, world: int) -> dict:
    named = [(f"block{i}.weight", p) for i, p in enumerate(make_params())]
    if rank == 2:
        with torch.no_grad():
            named[1][1][0, 0] += 1.0
    try:
        DistributedLion(named)
        mismatch = None
    except LynxRuntimeError as e:
        mismatch = str(e)
    return dict(
        mavo=_check_vote(rank, world, "mavo", 8),
        avg_gather=_check_vote(rank, world, "avg", 4),
        avg_reduce=_check_vote(rank, world, "avg", 4, gather_below=0),
        resume=_resume(rank, world),
        mismatch=mismatch,
    )


def _world_two(rank: int, world: int) -> dict:
    return dict(mavo=_check_vote(rank, world, "mavo", 6))


@pytest.fixture(scope="module")
def world_three():
    return run_world(_world_three, 3, timeout=150)


@pytest.mark.parametrize("case", ["mavo", "avg_gather", "avg_reduce"])
def test_world_three_aggregates(world_three, case):
    for r in range(3):
        res = world_three[r][case]
        assert res["mismatches"] == 0
        assert res["bytes"]["sent"] == res["analytic"]["sent"] > 0
        assert res["bytes"]["received"] == res["analytic"]["received"]
        assert res["collectives"] == res["counted"] == res["analytic"]["collectives"] <= 2 * res["buckets"]
        assert res["buckets"] >= 2
        assert all(torch.equal(a, b) for a, b in zip(res["final"], world_three[0][case]["final"]))  # replicas


def test_world_three_resume_and_mismatch(world_three):
    for r in range(3):
        straight, resumed = world_three[r]["resume"]
        assert straight == resumed
        assert "block1.weight" in world_three[r]["mismatch"]


def test_world_two_ties_follow_documented_rule():
    results = run_world(_world_two, 2, timeout=120)
    for res in results:
        assert res["mavo"]["ties"] > 0  # ties do occur at even W, and resolve as documented
        assert res["mavo"]["mismatches"] == 0


def test_mavo_is_one_bit_each_way():
    numels = [2048 * 2048] * 4
    for world in (2, 4, 8, 16):
        lion = lion_wire_bytes(numels, world, "mavo")
        allreduce = 2 * (world - 1) / world * 4 * sum(numels)
        assert lion["sent"] == pytest.approx(allreduce / 32)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(lr=-1.0), "lr"), (dict(mode="median"), "unknown mode"), (dict(betas=(0.9, 1.0)), "betas"),
     (dict(weight_decay=-1.0), "weight_decay")],
)
def test_bad_input(kwargs, match):
    with pytest.raises(LynxConfigError, match=match):
        DistributedLion(make_params(), **kwargs)
