"""torchrun worker of tests/runtime/test_user_pipeline.py: a user's own loop over lynx.runtime.Pipeline.

    torchrun --nproc_per_node N user_pipeline_worker.py OUT_DIR PP KIND [KIND ...]

For each model KIND (see user_models.py): compile with an HEU plan that recomputes, train STEPS
steps with AdamW from the user's loop, and write this rank's per-step losses, the plan's
recompute count and the stage's final parameters to OUT_DIR/KIND.rank{r}.pt.
"""

import os
import sys

import torch
import torch.distributed as dist

import lynx
import lynx.runtime  # noqa: F401  (before the script's process group: lynx.process_group_guard)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import user_models as um  # noqa: E402


def main() -> None:
    out_dir, pp, kinds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    # several pipelines in one process: the script owns the process group (a Pipeline that
    # creates it destroys it on close, and torchrun's store cannot host a second one)
    dist.init_process_group("gloo")
    for kind in kinds:
        model, example = um.build(kind)
        compiled = um.compile_recomputing(model, example, pp=pp, dp=world // pp)
        recomputed = sum(d.action == "recompute" for s in compiled.plan.stages for d in s.decisions)
        pipe = lynx.runtime.Pipeline(compiled, timeout_s=60)
        opt = um.optimizer(pipe.parameters())
        losses, grads = [], {}
        for window in um.batches(pipe.topology.dp):
            args, kwargs = um.step_inputs(kind, window)
            if kind == "qwen2":   # an input this rank's stage does not read may be None
                unread = {"input_ids", "labels"} - set(pipe.stage.spec.inputs)
                kwargs = {k: (None if k in unread else v) for k, v in kwargs.items()}
            loss = pipe.step(*args, **kwargs)
            if not grads:   # the first step's gradients, before the optimizer uses them
                grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        torch.save(
            {
                "losses": losses,
                "recomputed": recomputed,
                "params": params,
                "grads": grads,
                "stage": pipe.stage_index,
                "form": compiled.loss.form,
            },
            os.path.join(out_dir, f"{kind}.rank{pipe.rank}.pt"),
        )
        pipe.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
