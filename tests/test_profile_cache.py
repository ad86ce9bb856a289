"""lynx.frontend.profile_cache: a graph profiled once is read back field for field, keyed so that
another shape, target, parameter dtype or graph is another profile; a damaged file is profiled
again; captures whose code the key cannot see, and ``LYNX_PROFILE_CACHE=0``, skip the cache."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import lynx
from lynx.frontend import profile_cache
from lynx.frontend.capture import capture
from lynx.frontend.profile import profile
from lynx.frontend.profile_cache import cached_profile, profile_key
from lynx.models import build_preset
from lynx.planner.fingerprint import graph_fingerprint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LYNX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LYNX_PROFILE_CACHE", raising=False)
    return tmp_path / "profiles"


def _never(*args, **kwargs):
    raise AssertionError("profiled again: the cache was not read")


def test_a_hit_is_the_same_profile_and_plan(cache, monkeypatch) -> None:
    model, inputs = build_preset("gpt-tiny", seq=16, microbatch=2)
    settings = dict(pp=2, microbatches=2, hardware="cpu-local", memory_budget="1GiB", solver="heu")
    cold = lynx.compile(model, inputs, **settings)
    assert len(list(cache.glob("*.json"))) == 1
    monkeypatch.setattr(profile_cache, "profile", _never)
    warm = lynx.compile(model, inputs, **settings)
    assert warm.analysis.profile == cold.analysis.profile
    assert graph_fingerprint(warm.analysis.graph) == graph_fingerprint(cold.analysis.graph)
    assert warm.plan.predicted == cold.plan.predicted
    assert [s.decisions for s in warm.plan.stages] == [s.decisions for s in cold.plan.stages]


def test_the_key_follows_shapes_target_dtypes_and_graph() -> None:
    model, inputs = build_preset("gpt-tiny", seq=16, microbatch=2, device="meta")
    base = capture(model, inputs)
    key = profile_key(base, "cpu")
    assert key == profile_key(capture(model, inputs), "cpu")   # deterministic across captures
    assert key != profile_key(base, "cuda")
    _, longer = build_preset("gpt-tiny", seq=16, microbatch=4, device="meta")
    assert key != profile_key(capture(model, longer), "cpu")
    assert key != profile_key(capture(model.to(torch.bfloat16), inputs), "cpu")
    math, _ = build_preset("gpt-tiny", seq=16, microbatch=2, device="meta", attention="math")
    sdpa, _ = build_preset("gpt-tiny", seq=16, microbatch=2, device="meta", attention="sdpa")
    assert profile_key(capture(math, inputs), "cpu") != profile_key(capture(sdpa, inputs), "cpu")


def test_a_damaged_or_foreign_file_is_profiled_again(cache) -> None:
    model, inputs = build_preset("gpt-tiny", seq=16, microbatch=2, device="meta")
    captured = capture(model, inputs)
    expected = profile(captured, target="cpu")
    path = cache / f"{profile_key(captured, 'cpu')}.json"
    cache.mkdir(parents=True)
    for damage in ("{not json", json.dumps({"format": 999}), json.dumps({"format": 1, "nodes": {"x": {"bad": 1}}})):
        path.write_text(damage)
        assert cached_profile(captured, "cpu") == expected
        assert json.loads(path.read_text())["format"] == profile_cache.FORMAT   # replaced


def test_ranks_on_a_cold_cache_profile_once(cache, monkeypatch) -> None:
    """While one rank profiles a key (holding its lock file), another waits, then reads that
    rank's file instead of profiling too. (flock: a second open of the file conflicts even in
    this process, so a thread stands in for the second rank.)"""
    import fcntl
    import threading

    model, inputs = build_preset("gpt-tiny", seq=16, microbatch=2, device="meta")
    captured = capture(model, inputs)
    expected = profile(captured, target="cpu")
    key = profile_key(captured, "cpu")
    cache.mkdir(parents=True)
    monkeypatch.setattr(profile_cache, "profile", _never)
    got: list = []
    with open(cache / f".{key}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # the first rank, profiling
        waiting = threading.Thread(target=lambda: got.append(cached_profile(captured, "cpu")))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not got   # waits for the lock
        profile_cache._write(cache, cache / f"{key}.json", expected)   # the first rank's result
    waiting.join(30)
    assert got == [expected]


class _Opaque(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


def test_symbolic_trace_captures_and_the_switch_skip_the_cache(cache, monkeypatch) -> None:
    model, inputs = build_preset("gpt-tiny", seq=16, microbatch=2, device="meta")
    captured = capture(model, inputs)
    traced = capture(_Opaque(), (torch.randn(2, 4),))
    traced.method = "symbolic_trace"
    assert profile_key(traced, "cpu") is None
    monkeypatch.setenv("LYNX_PROFILE_CACHE", "0")
    cached_profile(captured, "cpu")
    assert not cache.exists()
