"""Importing lynx.runtime or lynx.optim keeps destroy_process_group able to free the default group.

(See lynx/process_group_guard.py.) ``import lynx`` alone does not: planning needs no group.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from lynx.runtime.topology import free_port

SCRIPT = textwrap.dedent("""
    import sys

    import {package}  # noqa: F401 — before the group: what the test is about
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.group.WORLD
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo
    import torch.distributed.nn.functional  # what torch._dynamo imports, whichever torch
    dist.destroy_process_group()
    print(sys.getrefcount(group) - 1)  # references besides this script's own
""")


@pytest.mark.parametrize("package", ["lynx.runtime", "lynx.optim"])
def test_default_group_is_freed_by_destroy_after_importing(package: str) -> None:
    # (with `import lynx` alone the script prints 11 on torch 2.13: the group outlives destroy)
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(port=free_port(), package=package)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == 1
