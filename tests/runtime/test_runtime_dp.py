"""Data-parallel buckets launch during the last backward, for AllReduceSync and Lynx's optimizers."""

from __future__ import annotations

import pytest
import torch

from lynx.runtime.data_parallel import AllReduceSync, BucketLauncher


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])


class _Recording:
    """Wraps a sync object and records, per launch, whether backward was still running."""

    def __init__(self, sync, running: list[bool]) -> None:
        self.sync, self.running, self.during_backward = sync, running, []
        self.buckets = sync.buckets

    def bucket_of(self, p):
        return self.sync.bucket_of(p)

    def launch(self, b):
        self.during_backward.append(self.running[0])
        return self.sync.launch(b)


def _params_backward_order(model):
    return list(reversed([p for p in model.parameters()]))


@pytest.mark.parametrize("kind", ["allreduce", "lion", "demo"])
def test_buckets_launch_while_backward_runs(kind: str) -> None:
    model = _model()
    params = _params_backward_order(model)
    if kind == "allreduce":
        sync = AllReduceSync(params, group=None, bucket_bytes=2048)
    else:
        from lynx.optim import DeMo, DistributedLion

        cls = DistributedLion if kind == "lion" else DeMo
        sync = cls(params, lr=1e-3, bucket_bytes=2048)
    running = [False]
    recording = _Recording(sync, running)
    launcher = BucketLauncher(recording, params)
    assert len(sync.buckets) >= 3
    x = torch.randn(4, 16)
    model(x).sum().backward()          # an earlier microbatch: nothing launches
    assert recording.during_backward == []
    launcher.arm()
    running[0] = True
    out = model(x).sum()
    out.backward()
    running[0] = False
    launcher.disarm()
    # every bucket was launched from inside backward, the first ones long before it ended
    assert len(recording.during_backward) == len(sync.buckets)
    assert all(recording.during_backward)
    before = [p.detach().clone() for p in params]
    if kind == "allreduce":
        grads = [p.grad.clone() for p in params]
        sync.finish()
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, params))  # world of one: mean = gradient
    else:
        sync.step()  # finishes the launched collectives and updates
        assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params))
    launcher.remove()
