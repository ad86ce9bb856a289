"""lynx.runtime.Pipeline's failure path under torchrun: a rank raising in its loop at step 2 ends
every process non-zero within 10 s, naming that rank, with torchrun's root cause on it; a rank
killed without a word is named by the survivor (tests/runtime/user_failure_worker.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_user_pipeline import torchrun

HERE = Path(__file__).parent


@pytest.mark.parametrize("fail_rank", [1, 0], ids=["rank1", "rank0-hosts-store"])
def test_a_rank_raising_ends_every_rank_naming_it(tmp_path, fail_rank):
    run = torchrun(2, "user_failure_worker.py", str(tmp_path), str(fail_rank), timeout=120)
    ended = time.time()
    out = run.stdout + run.stderr
    assert run.returncode != 0
    raised = float((tmp_path / "raised").read_text())
    assert ended - raised < 10, f"processes took {ended - raised:.1f} s to exit after the raise"
    other = 1 - fail_rank
    assert f"lynx: rank {fail_rank} failed: RuntimeError: boom at step 2" in out
    assert f"lynx: rank {other} stops: rank {fail_rank} failed: RuntimeError: boom at step 2" in out
    root = out[out.index("Root Cause"):]
    assert f"rank      : {fail_rank} " in root, root
    # each process exited with status 1, or was stopped by torchrun (SIGTERM) once the other had
    # exited after printing its message; never SIGABRT
    codes = re.findall(r"exitcode  : (-?\d+)", out[out.index("ChildFailedError"):])
    assert len(codes) == 2 and set(codes) <= {"1", "-15"}, out[-3000:]
    assert "terminate called" not in out and "SIGABRT" not in out


def test_a_rank_killed_without_a_word_is_named(tmp_path):
    """Issue 22, finding 6: a peer killed with SIGKILL was reported as "gradient receive of
    microbatch 0 failed … Connection reset by peer", the dead rank not named. Started without
    torchrun, whose agent would stop the survivor before it speaks."""
    from lynx.runtime.topology import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "user_failure_worker.py"), str(tmp_path), "1", "kill"],
                              env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = [p.communicate(timeout=120) for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, out[0][1][-3000:]
    assert "with rank 1 failed" in out[0][1] and "rank 1 ended without reporting an error" in out[0][1], \
        out[0][1][-3000:]
