"""Check 3 of ``gpu_check.py``: rewritten stages' gradients vs the original model's, bitwise.

The GPT (dropout 0.1) runs ``sizes.microbatches`` microbatches twice from the same seed:
eagerly as the user's module (forward, backward, one microbatch after the other), and as
``compiled.stage(i)`` of a 2-stage plan that recomputes — ``full`` (every layer recomputed,
its dropouts included, so their masks must come back from the replayed RNG state) and
``heu`` where it can plan — run by ``lynx.testing.run_local`` in the same order, each plan's
window recomputation issued before the backward it serves. Losses and every parameter's
gradient must be bitwise equal. A control runs the eager reference twice: if the device is
not deterministic for this model, bitwise equality cannot be asked, and the check says so.

Example::

    >>> import torch
    >>> from gpu_check_common import SIZES, Env
    >>> env = Env(torch.device("cpu"), SIZES["tiny"], "cpu-local")
    >>> check_gradients(env, solvers=("full",)).parts["full"].verdict
    'pass'
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_check_common import CheckResult, Env, Part, compiled_for, free_memory, judged, shared_gpt, shared_plan

__all__ = ["check_gradients"]

SEED = 1234
PP = 2


def _eager(model: torch.nn.Module, inputs: tuple, m: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    losses = []
    for _ in range(m):
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.detach().clone())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rewritten(model: torch.nn.Module, compiled: Any, batch: dict, m: int) -> tuple[list, dict]:
    from lynx.testing import run_local

    model.zero_grad(set_to_none=True)
    plan = compiled.plan
    stages = [compiled.stage(s) for s in range(len(plan.stages))]
    schedules = [plan.stage_schedule(s) for s in range(len(plan.stages))]
    torch.manual_seed(SEED)
    losses = run_local(stages, [batch] * m, schedule="sequential",
                       prefetch=lambda s, j: [nodes for _w, nodes in schedules[s].prefetch.get(j, [])])
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(ref: tuple, got: tuple) -> dict[str, Any]:
    (ref_losses, ref_grads), (losses, grads) = ref, got
    differ = [n for n in ref_grads if n not in grads or not torch.equal(ref_grads[n], grads[n])]
    worst = max((float((ref_grads[n].float() - grads[n].float()).abs().max()) for n in differ if n in grads),
                default=0.0)
    return {
        "losses_equal": all(torch.equal(a, b) for a, b in zip(ref_losses, losses)) and len(losses) == len(ref_losses),
        "params": len(ref_grads),
        "params_differing": len(differ),
        "first_differing": differ[:4],
        "max_abs_diff": worst,
        "missing": sorted(set(ref_grads) - set(grads))[:4],
    }


def _dropped_random(compiled: Any) -> int:
    graph = compiled.analysis.graph
    dropped = set().union(*(compiled.plan.stage_schedule(s).dropped for s in range(len(compiled.plan.stages))))
    return sum(1 for n in dropped if "dropout" in str(graph.nodes[n].get("op", "")))


def build_llama(env: Env, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, tuple]:
    """lynx's Llama (RMSNorm, rotary, SwiGLU, sdpa) at the run's layer sizes, with one microbatch."""
    from lynx.models.llama import Llama, LlamaConfig

    sizes = env.sizes
    cfg = LlamaConfig(vocab_size=sizes.vocab, seq_len=sizes.seq, hidden=sizes.hidden, heads=sizes.heads,
                      kv_heads=sizes.heads, layers=sizes.layers, ffn_hidden=sizes.hidden * 11 // 4)
    torch.manual_seed(0)
    with torch.device(env.device):
        model = Llama(cfg).to(dtype).train()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, sizes.vocab, (sizes.microbatch, sizes.seq), generator=gen).to(env.device)  # (B, T)
    return model, (idx, idx.roll(-1, dims=1))


def _op_counts(run: Any) -> dict[str, int]:
    """How often ``run()`` calls each aten op (the compiled stage traced beforehand)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops: Counter = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        run()
    return dict(counter.ops)


def _llama_parts(env: Env) -> dict[str, Part]:
    """A model with RMSNorm: its compiled stage (keep-all, 1 stage) vs eager, bitwise, and — for
    the record — the same with every composite that has a device kernel kept whole, as before
    the fix (on a CUDA build that cut a Llama's gradients off at the final RMSNorm)."""
    import contextlib

    import lynx.frontend.joint as joint

    model, inputs = build_llama(env)
    reference = _eager(model, inputs, 2)
    kept = sorted(str(op) for op in joint._kernel_and_composite_ops())

    @contextlib.contextmanager
    def keep_all_whole():
        from torch._export.utils import _special_op_to_preserve_cia
        from torch.export.exported_program import _override_composite_implicit_decomp

        has = torch._C._dispatch_has_kernel_for_dispatch_key
        names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::") and has(
            n, "CompositeImplicitAutograd") and (has(n, "CPU") or has(n, "CUDA"))]
        packets = [getattr(torch.ops.aten, n.split("::", 1)[1].split(".")[0], None) for n in names]
        ops = [p.default for p in packets if getattr(p, "default", None) is not None]
        with _override_composite_implicit_decomp({op: _special_op_to_preserve_cia for op in ops}):
            yield

    parts = {}
    for label, kernels in (("llama", None), ("llama_before_fix", keep_all_whole)):
        original = joint._eager_kernels
        if kernels is not None:
            joint._eager_kernels = kernels
        try:
            compiled = compiled_for(model, inputs, env, pp=1, microbatches=1, solver="none")
            batch = dict(zip(compiled.analysis.captured.input_names, inputs))
            figure = _compare(reference, _rewritten(model, compiled, batch, 2))
            if label == "llama" and figure["params_differing"]:  # which ops differ: the cause, next time
                eager_ops = _op_counts(lambda: _eager(model, inputs, 1))
                compiled_ops = _op_counts(lambda: _rewritten(model, compiled, batch, 1))
                figure["ops_only_eager"] = sorted(set(eager_ops) - set(compiled_ops))
                figure["ops_only_compiled"] = sorted(set(compiled_ops) - set(eager_ops))
                figure["ops_counted_differently"] = sorted(
                    f"{op}: eager {eager_ops[op]}, compiled {compiled_ops[op]}"
                    for op in set(eager_ops) & set(compiled_ops) if eager_ops[op] != compiled_ops[op])
        except Exception as err:  # noqa: BLE001 - the record of a broken variant, not a crash
            figure = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        finally:
            joint._eager_kernels = original
        figure["kept_whole_on_this_build"] = kept
        ok = "error" not in figure and figure["losses_equal"] and not figure["params_differing"] \
            and not figure["missing"]
        text = figure.get("error") or (
            f"{figure['params_differing']}/{figure['params']} gradients differ (max |diff| "
            f"{figure['max_abs_diff']:.3g}), {len(figure['missing'])} missing, losses "
            f"{'equal' if figure['losses_equal'] else 'differ'}")
        parts[label] = Part(figure, judged(ok) if label == "llama" else ("pass" if ok else "skipped"),
                            text if label == "llama" else f"record only: {text}")
        free_memory(env.device)
    model.zero_grad(set_to_none=True)
    return parts


def check_gradients(env: Env, solvers: tuple[str, ...] = ("full", "heu")) -> CheckResult:
    model, inputs, keep = shared_gpt(env)
    m, dtype = env.sizes.microbatches, env.sizes.dtypes[0]
    parts: dict[str, Part] = {}
    reference = _eager(model, inputs, m)
    control = _compare(reference, _eager(model, inputs, m))
    deterministic = control["losses_equal"] and control["params_differing"] == 0
    parts["eager_repeatable"] = Part(
        control,
        judged(deterministic),
        "the eager reference run twice is bitwise equal"
        if deterministic
        else "the eager model itself is not bitwise repeatable on this device",
    )
    batch = dict(zip(keep.analysis.captured.input_names, inputs))
    for solver in solvers:
        try:
            compiled = shared_plan(env, solver)
        except ImportError as err:  # heu needs OR-tools
            parts[solver] = Part({}, "skipped", f"cannot plan with {solver}: {err}")
            continue
        figure = _compare(reference, _rewritten(model, compiled, batch, m))
        figure["dropped_dropout_nodes"] = _dropped_random(compiled)
        figure["recompute_fraction"] = compiled.plan.recompute_fraction()
        ok = figure["losses_equal"] and figure["params_differing"] == 0 and not figure["missing"]
        parts[solver] = Part(
            figure,
            judged(ok),
            f"{figure['params_differing']}/{figure['params']} gradients differ "
            f"(max |diff| {figure['max_abs_diff']:.3g}), losses "
            f"{'equal' if figure['losses_equal'] else 'differ'}; "
            f"{figure['dropped_dropout_nodes']} dropout nodes recomputed",
        )
        free_memory(env.device)
    model.zero_grad(set_to_none=True)
    del model, inputs, keep
    parts.update(_llama_parts(env))
    headline = {
        s: {"params_differing": p.figure.get("params_differing"), "max_abs_diff": p.figure.get("max_abs_diff")}
        for s, p in parts.items()
        if s != "eager_repeatable"
    }
    reason = "; ".join(f"{n}: {p.reason}" for n, p in parts.items())
    return CheckResult({"dtype": dtype, "microbatches": m, **headline}, reason, parts)
