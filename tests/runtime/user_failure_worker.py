"""torchrun worker of the failure-path test: rank FAIL_RANK raises in the user's loop at step 2.

    torchrun --nproc_per_node 2 user_failure_worker.py OUT_DIR FAIL_RANK [kill]

Just before raising, the failing rank writes the time to OUT_DIR/raised (the test measures how
long every process takes to exit after it). With ``kill`` it sends itself SIGKILL instead: it
dies without a word, as under the out-of-memory killer, and the others must name it.
"""

import os
import signal
import sys
import time

import torch

import lynx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import user_models as um  # noqa: E402


def main() -> None:
    out_dir, fail_rank, kill = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["kill"]
    torch.set_num_threads(1)
    model, example = um.build("tuple")
    compiled = lynx.compile(model, example, pp=2, microbatches=um.MICROBATCHES, solver="full",
                            hardware="cpu-local", memory_budget="1GiB")
    pipe = lynx.runtime.Pipeline(compiled, timeout_s=60)
    opt = um.optimizer(pipe.parameters())
    for step in range(5):
        window = torch.randint(0, um.VOCAB, (um.MICROBATCHES * um.MICRO, um.SEQ + 1))
        if step == 2 and pipe.rank == fail_rank:
            with open(os.path.join(out_dir, "raised"), "w") as f:
                f.write(repr(time.time()))
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"boom at step {step}")
        pipe.step(window[:, :-1], window[:, 1:])
        opt.step()
        opt.zero_grad()
    pipe.close()


if __name__ == "__main__":
    main()
