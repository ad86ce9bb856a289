"""Tensor parallelism, executed: lynx.runtime.Pipeline over pp × tp with recompute in TP windows.

Three models (tests/runtime/tp_models.py: lynx's GPT at gpt-tiny's shape, a ``transformers``
Llama with sdpa and grouped-query attention, a plain ``nn.Module`` GPT), each with an HEU plan
that recomputes — inside TP windows too — and with the same sharded stages keeping everything,
trained 5 AdamW steps in a world of 2 processes (tp 2) and one of 4 (pp 2 × tp 2, 1F1B, and
GPipe for lynx's GPT); each world runs all of them in turn. Against single-process PyTorch on
the same batches: per-step losses within 1e-5 relative, first-step gradients within the fp32
bound below. Against the sharded run without recomputation: losses, gradients and final
parameters **bitwise** equal (recomputation re-runs the same ops, random ones from their saved
state). The generated backward code issues every TP window's recomputation between an all-reduce
and the ``wait_tensor`` of that all-reduce, and the run hides some of it there (hidden seconds >
0). Each rank's peak saved activation bytes are within 5% of the plan's per-rank prediction. The
4-process world also runs tp 2 × dp 2 with DeMo on ``pipe.dp_group``: replicas agree after its
updates, and so do the TP ranks' replicated parameters.

The gradient bound. Tensor parallelism changes the order of floating-point sums and nothing
else: a row-parallel linear sums its ``n`` input features as ``tp`` partial sums that an
all-reduce adds; the backward all-reduces add the column-parallel linears' partial input
gradients. Two orders of an ``n``-term sum differ by at most ``2(n-1)·u·Σ|terms|`` (``u = 2⁻²⁴``);
a layer's gradient passes through at most two such sums per sublayer, so over ``L`` layers a
gradient element differs by at most ``≈ 4·L·n·u`` times the magnitude of the values summed,
which we bound by the largest gradient of the layer: ``|Δg| ≤ 4·L·n·u·G`` with ``n`` the widest
reduction (the MLP's hidden width, 4 × 32 here) and ``G`` the largest gradient element of the
tensor's layer (of the tensor itself outside the layers). Not the tensor's own: a gradient that
cancels — attention's q and k near a uniform softmax, the key bias (softmax ignores a shift of
every key) — is far smaller than the terms it sums.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tp_models as tm  # noqa: E402

from lynx.frontend.sharding import shard_tensor  # noqa: E402
from lynx.runtime.sched_slice import SHORT_SLICE_S, custom_slices  # noqa: E402
from lynx.testing import spawn_world  # noqa: E402

U = 2.0 ** -24
LAYERS, WIDEST = 4, 128
GRAD_BOUND = 4 * LAYERS * WIDEST * U


def _kinds() -> list[str]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ["gpt", "plain"]
    return list(tm.KINDS)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple]:
    return {kind: tm.reference(kind) for kind in _kinds()}


def _layer_scale(name: str, grads: dict) -> float:
    """The largest gradient of the layer ``name`` belongs to (``blocks.2``, ``model.layers.0``): the
    size of the values its sums add, which a gradient that cancels does not shrink."""
    parts = name.split(".")
    digit = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if digit is None:
        return 0.0
    prefix = ".".join(parts[:digit + 1]) + "."
    return max(float(g.abs().max()) for n, g in grads.items() if n.startswith(prefix))


def _check(results: list[dict], prepared: dict, references: dict, tp: int) -> None:
    for kind, prep in prepared.items():
        ref_losses, ref_grads = references[prep.get("kind", kind)]
        sharding = prep["sharding"]
        assert tm.in_tp_windows(prep["heu"][0]), f"{kind}: the HEU plan recomputes nothing inside TP windows"
        hidden, windows = 0.0, []
        for rank in results:
            got, base = rank[kind]["heu"], rank[kind]["none"]
            # the same sharded stages without recomputation: bitwise
            assert got["losses"] == base["losses"], f"{kind} rank {rank[kind]['rank']}: losses differ from 'none'"
            for name, grad in got["grads"].items():
                assert torch.equal(grad, base["grads"][name]), f"{kind}: gradient of {name} differs from 'none'"
            for name, value in got["params"].items():
                assert torch.equal(value, base["params"][name]), f"{kind}: parameter {name} differs from 'none'"
            # single-process PyTorch: losses within 1e-5 relative, gradients within the fp32 bound
            for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{kind} step {step}: loss {a} vs PyTorch {b}"
            t = rank[kind]["tp_rank"]
            for name, grad in got["grads"].items():
                sharded = sharding.sharded_params([name]).get(name)
                want = shard_tensor(ref_grads[name], sharded[0], sharded[1], t, tp) if sharded else ref_grads[name]
                assert grad.shape == want.shape, f"{kind}: {name} holds {tuple(grad.shape)}, not its shard"
                scale = max(float(want.abs().max()), _layer_scale(name, ref_grads))
                assert float((grad - want).abs().max()) <= GRAD_BOUND * scale + 1e-30, (
                    f"{kind} rank {rank[kind]['rank']}: gradient of {name} off by "
                    f"{float((grad - want).abs().max()):.3g} (bound {GRAD_BOUND * scale:.3g})")
            for run in (got, base):   # what a TP rank holds for backward: as the plan priced it
                assert abs(run["peak"] - run["predicted_peak"]) <= 0.05 * run["predicted_peak"], (
                    f"{kind} rank {rank[kind]['rank']}: peak {run['peak']} B vs predicted {run['predicted_peak']} B")
            hidden += got["hidden"]
            windows += got["windows"]
        assert windows, f"{kind}: no TP window in the generated backward code"
        assert all(same and ops > 0 for same, ops in windows), (
            f"{kind}: a TP window's recompute is not between an all-reduce and its wait: {windows}")
        assert hidden > 0, f"{kind}: no recompute hidden in a TP window"
    if custom_slices():   # every thread of a CPU rank, gloo's included, on short slices (lynx.runtime.sched_slice)
        for rank in results:
            for kind in prepared:
                shown = [s for s in rank[kind]["slices"] if s is not None]
                assert shown and all(s == SHORT_SLICE_S for s in shown), f"{kind}: thread slices {rank[kind]['slices']}"


def test_tp2_matches_single_process_pytorch(references):
    prepared = {kind: tm.plans(kind, pp=1, tp=2) for kind in _kinds()}
    mismatch = ("gpt", tm.plans("gpt", pp=2, tp=2))
    results = spawn_world(tm.world_main, 2, prepared, mismatch, timeout_s=600)
    _check(results, prepared, references, tp=2)
    assert "pp × dp × tp = 4" in results[0]["mismatch"], results[0]["mismatch"]


def test_pp2_tp2_matches_single_process_pytorch(references):
    prepared = {kind: tm.plans(kind, pp=2, tp=2) for kind in _kinds()}
    prepared["gpt/gpipe"] = tm.plans("gpt", pp=2, tp=2, schedule="gpipe")   # the other schedule TP runs under
    results = spawn_world(tm.world_main, 4, prepared, None, tm.plans_dp("gpt", tp=2, dp=2), timeout_s=600)
    _check(results, prepared, references, tp=2)
    # the same world as tp 2 × dp 2 with DeMo over the data-parallel group only: each TP rank's
    # replicas agree after its updates, replicated parameters agree across the TP ranks too
    demo = [r["demo"] for r in results]
    assert all(d["losses"] == demo[0]["losses"] and all(loss == loss for loss in d["losses"]) for d in demo)
    for d in demo:
        twin = next(e for e in demo if e["tp_rank"] == d["tp_rank"] and e["dp_rank"] != d["dp_rank"])
        for name, value in d["params"].items():
            assert torch.equal(value, twin["params"][name]), f"replicas differ in {name} after DeMo"
    other = next(e for e in demo if e["tp_rank"] != demo[0]["tp_rank"])
    sharding = prepared["gpt"]["sharding"]
    for name, value in demo[0]["params"].items():
        if not sharding.sharded_params([name]):
            assert torch.equal(value, other["params"][name]), f"TP ranks differ in replicated {name}"
