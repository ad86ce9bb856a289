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
    # A kind trained under several schedules is built and captured once per process (~2 CPU-s a
    # capture) and each case planned from that analysis; its parameters, which training changes
    # in place, are put back before each case (:class:`_Models`)
    trained = [case for case in cases if case != "dropout:resume"]
    models = _Models()
    own = {}
    for i, case in enumerate(trained):
        if i % world == rank:
            kind, schedule = case.split(":")
            model, example, analysis = models.get(kind)
            own[case] = um.compile_recomputing(model, example, pp=pp, dp=world // pp, schedule=schedule,
                                               analysis=analysis)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {case: compiled.plan for case, compiled in own.items()})
    plans = {case: plan for by_rank in gathered for case, plan in by_rank.items()}
    for case in cases:
        kind, schedule = case.split(":")
        if case == "dropout:resume":   # issue 22, finding 8: in this world, not a torchrun of its own
            import dropout_resume_worker

            dropout_resume_worker.run(out_dir)
            continue
        model, example, analysis = models.fresh(kind)
        compiled = own.pop(case) if case in own else um.compile_with(model, example, plans[case], analysis)
        recomputed = sum(d.action == "recompute" for s in compiled.plan.stages for d in s.decisions)
        offloaded = sum(d.action == "offload" for s in compiled.plan.stages for d in s.decisions)
        pipe = lynx.runtime.Pipeline(compiled, timeout_s=60, trace=True, **pipe_options)
        built = [len(chunk._lowered) for chunk in pipe.chunks.values()]   # lowered as the pipe was built
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
                # the signatures each chunk lowered for, when built and after the steps (lynx.runtime.prelower)
                "lowered": (built, [len(chunk._lowered) for chunk in pipe.chunks.values()]),
            },
            os.path.join(out_dir, f"{kind}.{schedule}.rank{pipe.rank}.pt"),
        )
        pipe.close()


class _Models:
    """Each kind's model, example inputs and analysis (``user_models.analyze``), made once, and
    its captured graph's parameters and buffers as built, restored by :meth:`fresh` (the
    pipeline's chunks share them, and a case trains them)."""

    def __init__(self) -> None:
        self._made: dict[str, tuple] = {}

    def get(self, kind: str) -> tuple:
        """(model, example, analysis) of ``kind``, made on first use."""
        if kind not in self._made:
            model, example = um.build(kind)
            analysis = um.analyze(model, example)
            built = {n: t.detach().clone() for n, t in analysis.captured.gm.state_dict(keep_vars=True).items()}
            self._made[kind] = (model, example, analysis, built)
        return self._made[kind][:3]

    def fresh(self, kind: str) -> tuple:
        """:meth:`get`, with the parameters and buffers as built and no gradients."""
        model, example, analysis = self.get(kind)
        built = self._made[kind][3]
        with torch.no_grad():
            for name, tensor in analysis.captured.gm.state_dict(keep_vars=True).items():
                tensor.copy_(built[name])
                tensor.grad = None
        return model, example, analysis


if __name__ == "__main__":
    main()
