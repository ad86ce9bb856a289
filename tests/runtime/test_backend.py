"""Backend and device choice of a rank: NCCL + cuda:<local rank> with CUDA, gloo + CPU without."""

import pytest
import torch

from lynx.errors import LynxConfigError
from lynx.runtime import topology
from lynx.runtime.topology import rank_device, select_backend


def test_without_cuda_gloo_on_cpu():
    assert select_backend(0, cuda=False) == ("gloo", torch.device("cpu"))
    assert select_backend(3, cuda=False) == ("gloo", torch.device("cpu"))


def test_with_cuda_nccl_on_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert select_backend(0, cuda=True) == ("nccl", torch.device("cuda", 0))
    assert select_backend(3, cuda=True) == ("nccl", torch.device("cuda", 3))
    assert select_backend(5, cuda=True) == ("nccl", torch.device("cuda", 1))  # wraps around


def test_detection_follows_cuda_and_nccl_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(topology.dist, "is_nccl_available", lambda: True)
    assert select_backend(1) == ("nccl", torch.device("cuda", 1))
    monkeypatch.setattr(topology.dist, "is_nccl_available", lambda: False)
    assert select_backend(1) == ("gloo", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_backend(1) == ("gloo", torch.device("cpu"))


def test_this_machine_and_rank_device():
    backend, device = select_backend(0)
    assert (backend, device.type) == (("nccl", "cuda") if torch.cuda.is_available() and
                                      torch.distributed.is_nccl_available() else ("gloo", "cpu"))
    assert rank_device() == torch.device("cpu")  # no process group here


def test_negative_local_rank_is_refused():
    with pytest.raises(LynxConfigError, match="local rank"):
        select_backend(-1, cuda=False)
