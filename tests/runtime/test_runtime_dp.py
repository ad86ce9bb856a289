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


def test_compiled_stage_launches_buckets_from_inside_its_backward_graph() -> None:
    """A compiled stage hands each parameter gradient over as soon as the backward graph computes
    it: the first bucket launches while later-needed gradients do not exist yet, and the
    gradients equal those of the stage returning them all at the end."""
    from lynx.frontend.capture import capture
    from lynx.models import build_preset
    from lynx.rewrite import build_stages
    from lynx.rewrite.split import op_nodes

    torch.manual_seed(0)
    model, inputs = build_preset("gpt-tiny", device="cpu", seq=16, dropout=0.1)
    captured = capture(model, inputs)
    names = [n.name for n in op_nodes(captured.gm)]
    stage, = build_stages(captured.gm, [names], [set(names[::3])])
    args = [dict(zip(captured.input_names, inputs))[n] for n in stage.spec.inputs]
    params = list(reversed([p for p in stage.parameters() if p.requires_grad]))

    def run(sink: bool) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        torch.manual_seed(3)
        stage(*args, microbatch=0).backward()
        stage.release(0)
        return [p.grad.clone() for p in params]

    reference = run(sink=False)
    sync = AllReduceSync(params, group=None, bucket_bytes=4096)
    assert len(sync.buckets) >= 3
    missing_at_launch: list[int] = []

    class Counting(_Recording):
        def launch(self, b):
            missing_at_launch.append(sum(p.grad is None for p in params))
            return self.sync.launch(b)

    launcher = BucketLauncher(Counting(sync, [True]), params)
    stage.on_param_grad = launcher.param_ready
    launcher.arm()
    grads = run(sink=True)
    launcher.disarm()
    stage.on_param_grad = None
    launcher.remove()
    assert len(missing_at_launch) == len(sync.buckets)
    assert missing_at_launch[0] > 0, "the first bucket launched only after the whole backward"
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))
