"""DeMo against an independent reference at W=1 and W=2, replicas, bytes, async API, resume."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from demo_reference import ReferenceDeMo
from optim_spawn import run_world
from lynx.errors import LynxConfigError, LynxRuntimeError
from lynx.optim import DeMo
from lynx.optim.demo_payload import demo_wire_bytes

SHAPES = [(16, 24), (24,), (2, 3, 8), (3,)]  # matrix, vector, 3-D, a vector sent dense
SETTINGS = dict(lr=0.01, compression_decay=0.9, compression_topk=5, compression_chunk=8, weight_decay=0.1)
BUCKET_BYTES = 1024  # several buckets for these few small tensors


def make_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in SHAPES]


def loss_of(params: list[torch.Tensor], rank: int, step: int) -> torch.Tensor:
    w1, b1, w3, s = params
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)  # (B, 16)
    y = torch.randn(8, 2, generator=g, dtype=torch.float64)  # (B, 2)
    h = torch.tanh(x @ w1 + b1)  # (B, 24)
    out = (h @ w3.reshape(24, 2)) * s[0] + s[1]  # (B, 2)
    return (out - y).pow(2).mean() + 0.1 * s[2] ** 2


def grads_at(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    ps = [p.detach().clone().requires_grad_() for p in params]
    loss_of(ps, rank, step).backward()
    return [p.grad for p in ps]


def train(params, opt, rank, steps, start=0, record=None):
    losses = []
    for t in range(start, start + steps):
        opt.zero_grad()
        loss = loss_of(params, rank, t)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if record is not None:
            record.append([p.detach().clone() for p in params])
    return losses


def reference_run(world: int, steps: int, value_dtype: torch.dtype) -> list[list[torch.Tensor]]:
    ref = ReferenceDeMo(make_params(), world, value_dtype=value_dtype, topk=SETTINGS["compression_topk"],
                        chunk=SETTINGS["compression_chunk"], lr=SETTINGS["lr"], decay=SETTINGS["compression_decay"],
                        weight_decay=SETTINGS["weight_decay"])
    history = []
    for t in range(steps):
        current = ref.tensors()
        ref.step([grads_at(current, r, t) for r in range(world)])
        history.append(ref.tensors())
    return history


@pytest.mark.parametrize("value_dtype", [torch.bfloat16, torch.float64])
def test_world_one_matches_reference(value_dtype):
    params = make_params()
    opt = DeMo(params, **SETTINGS, value_dtype=value_dtype, bucket_bytes=BUCKET_BYTES)
    assert len(opt.buckets) >= 2
    assert [tp.compressed for plan in opt._plans for tp in plan.tensors].count(False) == 1  # the (3,) vector
    record: list = []
    train(params, opt, 0, 10, record=record)
    for mine, ref in zip(record, reference_run(1, 10, value_dtype)):
        for a, b in zip(mine, ref):
            assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert opt.last_step_bytes == {"sent": 0.0, "received": 0.0}


def _count_collectives() -> dict[str, int]:
    counts = {"n": 0}
    for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce", "all_to_all_single"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*a, _original=original, **kw):
            counts["n"] += 1
            return _original(*a, **kw)

        setattr(dist, name, counted)
    return counts


def _world_two(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    out: dict = {}
    # 1. 50 steps, every parameter recorded, bytes and collectives of the last step.
    params = make_params()
    opt = DeMo(params, **SETTINGS, bucket_bytes=BUCKET_BYTES)
    counts = _count_collectives()
    record: list = []
    train(params, opt, rank, 50, record=record)
    out["history"] = record
    out["bytes"] = opt.last_step_bytes
    out["analytic"] = demo_wire_bytes(
        SHAPES, world, param_dtype=torch.float64, topk=5, chunk=8, bucket_bytes=BUCKET_BYTES
    )
    out["collectives"] = counts["n"] // 50
    out["counted_by_opt"] = opt.last_step_collectives
    out["buckets"] = len(opt.buckets)
    # 2. Async API: launch buckets one by one (as gradients would become ready), then finish.
    a, b = make_params(), make_params()
    opt_a = DeMo(a, **SETTINGS, bucket_bytes=BUCKET_BYTES)
    opt_b = DeMo(b, **SETTINGS, bucket_bytes=BUCKET_BYTES)
    for t in range(3):
        train(a, opt_a, rank, 1, start=t)
        loss_of(b, rank, t).backward()
        handles = [opt_b.launch(opt_b.bucket_of(b[i])) for i in reversed(range(len(b)))]
        handles[0].wait()
        opt_b.finish()
        opt_b.zero_grad()
    out["async_equal"] = all(torch.equal(x, y) for x, y in zip(a, b))
    # 3. Save after 3 steps, resume in a fresh optimizer: the following losses are identical.
    params = make_params()
    opt = DeMo(params, **SETTINGS)
    train(params, opt, rank, 3)
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    straight = train(params, opt, rank, 4, start=3)
    buf.seek(0)
    saved = torch.load(buf)
    resumed_params = [p.clone().requires_grad_() for p in saved["params"]]
    resumed = DeMo(resumed_params, **SETTINGS)
    resumed.load_state_dict(saved["opt"])
    out["resume"] = (straight, train(resumed_params, resumed, rank, 4, start=3))
    # 4. Replicas that differ at start are reported by name.
    named = [(f"layer{i}.weight", p) for i, p in enumerate(make_params())]
    if rank == 1:
        with torch.no_grad():
            named[2][1][0, 0, 0] += 1e-3
    try:
        DeMo(named, lr=0.01)
        out["mismatch"] = None
    except LynxRuntimeError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def world_two():
    return run_world(_world_two, 2, timeout=150)


def test_world_two_matches_reference_and_replicas_identical(world_two):
    reference = reference_run(2, 50, torch.bfloat16)
    for t, ref in enumerate(reference):
        for r in range(2):
            for mine, expected in zip(world_two[r]["history"][t], ref):
                assert torch.allclose(mine, expected, atol=1e-6, rtol=0), f"step {t} rank {r}"
        for x, y in zip(world_two[0]["history"][t], world_two[1]["history"][t]):
            assert torch.equal(x, y), f"replicas differ at step {t}"


def test_world_two_bytes_and_collectives(world_two):
    for r in range(2):
        res = world_two[r]
        assert res["bytes"]["sent"] == res["analytic"]["sent"] > 0
        assert res["bytes"]["received"] == res["analytic"]["received"]
        assert res["collectives"] == res["counted_by_opt"] == res["analytic"]["collectives"]
        assert res["collectives"] <= 2 * res["buckets"]


def test_world_two_async_resume_and_mismatch(world_two):
    for r in range(2):
        assert world_two[r]["async_equal"]
        straight, resumed = world_two[r]["resume"]
        assert straight == resumed
        assert "layer2.weight" in world_two[r]["mismatch"]


def test_collectives_do_not_grow_with_tensor_count():
    shapes = [(64, 64)] * 40 + [(64,)] * 40
    one_bucket = demo_wire_bytes(shapes, 8, bucket_bytes=10**9)
    assert one_bucket["collectives"] == 1 and one_bucket["buckets"] == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1e-3), "lr"),
        (dict(lr=1e-3, compression_topk=65, compression_chunk=8), "compression_topk"),
        (dict(lr=1e-3, compression_decay=1.0), "compression_decay"),
        (dict(lr=1e-3, weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(LynxConfigError, match=match):
        DeMo(make_params(), **kwargs)


def test_process_group_without_init():
    with pytest.raises(LynxConfigError, match="init_process_group"):
        DeMo(make_params(), lr=1e-3, process_group=object())


def gpt13b_shapes(h: int = 2048, layers: int = 24, vocab: int = 51200, seq: int = 2048) -> list[tuple[int, ...]]:
    per_layer = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    return [(vocab, h), (seq, h)] + per_layer * layers + [(h,), (h,), (vocab, h)]


def test_wire_bytes_bar_gpt13b():
    shapes = gpt13b_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    allreduce = 2 * 7 / 8 * 4 * n
    assert allreduce / demo_wire_bytes(shapes, 8)["sent"] >= 32


def test_parameter_layout_momentum_from_an_older_checkpoint_is_transformed():
    """A state_dict with a parameter-layout "momentum" for a compressed tensor loads as its DCT."""
    from lynx.optim.dct import ChunkLayout, decode

    params = make_params()
    opt = DeMo(params, **SETTINGS, bucket_bytes=BUCKET_BYTES)
    train(params, opt, 0, 2)
    state = opt.state_dict()
    old_style, want = {}, {}
    for pid, entry in state["state"].items():
        entry = dict(entry)
        if "momentum_dct" in entry:
            shape = tuple(params[pid].shape)
            m = decode(entry.pop("momentum_dct").clone(), ChunkLayout.for_shape(shape, SETTINGS["compression_chunk"]))
            entry["momentum"] = m  # what the parameter-domain DeMo stored
            want[pid] = opt.state[params[pid]]["momentum_dct"].clone()
        old_style[pid] = entry
    assert want  # compressed tensors exist
    resumed = DeMo([p.detach().clone().requires_grad_() for p in params], **SETTINGS, bucket_bytes=BUCKET_BYTES)
    resumed.load_state_dict({"state": old_style, "param_groups": state["param_groups"]})
    for b in range(len(resumed.buckets)):
        resumed._kernel(b, torch.device("cpu"))  # what the first launch does
    for pid, m in want.items():
        got = resumed.state[resumed.param_groups[0]["params"][pid]]
        assert "momentum" not in got
        assert torch.allclose(got["momentum_dct"], m, atol=1e-12, rtol=0)
