"""torchrun worker of tests/runtime/test_user_pipeline.py: a user's own loop over lynx.runtime.Pipeline.

    torchrun --nproc_per_node N user_pipeline_worker.py OUT_DIR PP CASE [CASE ...]

A CASE is ``KIND:SCHEDULE`` (a ``user_models`` kind; ``1f1b``, ``interleaved1f1b`` with 2
chunks per rank, ``zbh1``, or ``1f1b+offload``: 1F1B with a plan that offloads), or
``dropout:resume`` (``dropout_resume_worker.run``: a run with dropout stopped and resumed). For each:
compile with an HEU plan that recomputes (or the offloading one), train STEPS
steps with AdamW from the user's loop, and write this rank's per-step losses, first-step
gradients, final parameters, the plan's recompute count and what the runtime measured to
OUT_DIR/KIND.SCHEDULE.rank{r}.pt.
"""

import os
import sys

import torch
import torch.distributed as dist

import lynx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import user_models as um  # noqa: E402


def main() -> None:
    out_dir, pp, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    # several pipelines in one process: the script owns the process group (a Pipeline that
    # creates it destroys it on close, and torchrun's store cannot host a second one)
    dist.init_process_group("gloo")
    run_cases(out_dir, pp, cases)
    dist.barrier()
    dist.destroy_process_group()


def run_cases(out_dir: str, pp: int, cases: list[str], **pipe_options) -> None:
    """Every case in turn in the world already made (this script's under torchrun, or a spawned
    one: tests/runtime/pipeline_ranks.py runs the pp 2 x dp 2 cases in its world);
    ``pipe_options`` go to each ``Pipeline``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    # case i is planned by rank i % world, which trains that compilation; every other rank
    # compiles with its plan (users do the same with one planning rank: examples/train_gpt.py).
    # The ranks plan their cases side by side first (planning is most of a case's cost; one
    # planning rank left the others waiting), then exchange the plans
    trained = [case for case in cases if case != "dropout:resume"]
    own = {}
    for i, case in enumerate(trained):
        if i % world == rank:
            kind, schedule = case.split(":")
            model, example = um.build(kind)
            own[case] = (model, example, um.compile_recomputing(model, example, pp=pp, dp=world // pp,
                                                                schedule=schedule))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {case: compiled.plan for case, (_, _, compiled) in own.items()})
    plans = {case: plan for by_rank in gathered for case, plan in by_rank.items()}
    for case in cases:
        kind, schedule = case.split(":")
        if case == "dropout:resume":   # issue 22, finding 8: in this world, not a torchrun of its own
            import dropout_resume_worker

            dropout_resume_worker.run(out_dir)
            continue
        if case in own:
            _, _, compiled = own.pop(case)
        else:
            model, example = um.build(kind)
            compiled = um.compile_with(model, example, plans[case])
        recomputed = sum(d.action == "recompute" for s in compiled.plan.stages for d in s.decisions)
        offloaded = sum(d.action == "offload" for s in compiled.plan.stages for d in s.decisions)
        pipe = lynx.runtime.Pipeline(compiled, timeout_s=60, trace=True, **pipe_options)
        opt = um.optimizer(pipe.parameters())
        losses, grads, stats = [], {}, []
        read = {n for chunk in pipe.chunks.values() for n in chunk.spec.inputs}
        for window in um.batches(pipe.topology.dp):
            args, kwargs = um.step_inputs(kind, window)
            # an input this rank's stages do not read may be None
            kwargs = {k: (v if k in read else None) for k, v in kwargs.items()}
            loss = pipe.step(*args, **kwargs)
            if not grads:   # the first step's gradients, before the optimizer uses them
                grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            stats.append(pipe.last_stats)
        torch.save(
            {
                "losses": losses,
                "recomputed": recomputed,
                "offloaded": offloaded,
                "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
                "grads": grads,
                "stage": pipe.stage_index,
                "chunks": sorted(pipe.chunks),
                "form": compiled.loss.form,
                "stats": stats,
                "predicted_activation_bytes": compiled.plan.stage(pipe.stage_index).activation_bytes,
            },
            os.path.join(out_dir, f"{kind}.{schedule}.rank{pipe.rank}.pt"),
        )
        pipe.close()


if __name__ == "__main__":
    main()
