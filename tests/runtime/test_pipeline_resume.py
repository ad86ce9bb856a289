"""Issue 22, finding 8: a run with dropout, stopped and resumed through ``pipe.state_dict``, is bitwise the same.

``Pipeline`` owns each rank's random stream (``lynx.runtime.rank_rng``) and its ``state_dict``
carries it: nanoGPT-style training with dropout 0.1 under pp 2 (a plan that recomputes the
dropouts), stopped after 3 of 6 steps and resumed in a fresh pipe from the checkpoint, gives
the uninterrupted run's losses exactly (same ops in the same order; one thread per process).
"""

from __future__ import annotations

import json

from test_user_pipeline import torchrun


def test_dropout_run_resumes_bitwise_through_pipe_state_dict(tmp_path):
    run = torchrun(2, "dropout_resume_worker.py", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(got["full"]) == 6 and got["resumed"] == got["full"], got
        assert len(set(got["full"])) == 6   # the loss moves: the steps really trained
