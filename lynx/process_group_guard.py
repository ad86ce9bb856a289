"""Keep ``torch.distributed.destroy_process_group`` able to free the default process group.

``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as a default argument of ten
functions when it is imported. Imported *after* ``init_process_group`` — ``torch._dynamo``
imports it, so the first ``torch.optim`` optimizer, ``torch.export`` or ``torch.compile`` of a
run does — those defaults hold the default group for good: ``destroy_process_group`` drops
torch's own references but the group lives on, and with it gloo's worker threads. At
interpreter shutdown a worker thread that releases a finished work must take the GIL to drop
the work's tensors; Python ends such a thread inside a ``noexcept`` destructor and the process
dies with SIGABRT ("terminate called without an active exception") after all its work is
done — about one exit in six for three gloo ranks running DistributedLion (torch 2.13).

Importing the module while no group exists binds ``None`` instead, so the packages that work
with process groups run :func:`bind_before_init` when they are imported (:mod:`lynx.runtime`,
which makes the groups of its launchers and pipelines, and :mod:`lynx.optim`): a script that
imports either at the top, then creates its group, is safe. ``import lynx`` and the planning
core do not run it: planning needs no process group.

Example::

    >>> import torch.distributed as dist
    >>> from lynx.process_group_guard import bind_before_init
    >>> bind_before_init()
    >>> import torch.distributed.nn.functional as F
    >>> dist.is_initialized() or F.broadcast.__defaults__[-1] is None
    True
"""

from __future__ import annotations

import sys

__all__ = ["bind_before_init"]

_MODULE = "torch.distributed.nn.functional"


def bind_before_init() -> None:
    """Import ``torch.distributed.nn.functional`` now if no process group exists yet.

    Once a group exists, importing it would capture that group: then nothing is done (the
    capture, if it happens later, is torch's own).
    """
    if _MODULE in sys.modules:
        return
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    __import__(_MODULE)
