"""lynx.runtime.Pipeline's failure path under torchrun: a rank raising in its loop at step 2 ends
every process non-zero within 10 s, naming that rank, with torchrun's root cause on it; a rank
killed without a word is named by the survivor (tests/runtime/user_failure_worker.py).
"""

from __future__ import annotations

import os
import re
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
    torchrun, whose agent would stop the survivor before it speaks: its ranks with torchrun's
    environment, forked from the suite's fork server (tests/prestarted.py)."""
    from prestarted import run_world, start_world

    (survivor, out, err), (killed, _, _) = run_world(start_world(
        HERE / "user_failure_worker.py", [str(tmp_path), "1", "kill"], 2, dict(os.environ, OMP_NUM_THREADS="1")),
        timeout=120)
    assert killed == -9
    assert survivor == 1, err[-3000:]
    assert "with rank 1 failed" in err and "rank 1 ended without reporting an error" in err, err[-3000:]
