"""Communication-compressed data-parallel optimizers: DeMo and Distributed Lion.

Both are ``torch.optim.Optimizer``s over a ``torch.distributed`` process group (a single
process works without one), with bucketed, bit-packed payloads, asynchronous per-bucket
collectives (``launch(bucket)`` / ``finish()``; ``step()`` does both) and per-step wire-byte
counters (``last_step_bytes``). See ``docs/optimizers.md``.

Example::

    >>> import torch
    >>> from lynx.optim import DeMo, DistributedLion
    >>> model = torch.nn.Linear(8, 8)
    >>> opt = DistributedLion(model.parameters(), lr=1e-4)
    >>> model(torch.randn(2, 8)).sum().backward()
    >>> opt.step()
"""

from lynx.optim.demo import DeMo
from lynx.optim.demo_payload import demo_wire_bytes
from lynx.optim.lion import DistributedLion, lion_wire_bytes
from lynx.process_group_guard import bind_before_init

bind_before_init()  # before the script's process group exists: see lynx.process_group_guard

__all__ = ["DeMo", "DistributedLion", "demo_wire_bytes", "lion_wire_bytes"]
