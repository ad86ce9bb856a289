"""Check 5 of ``gpu_check.py``: DeMo and Distributed Lion steps on the device vs on the CPU.

Both optimizers of ``lynx.optim`` take ``sizes.optim_steps`` steps from the same parameters
and gradients (fixed random tensors, some gradient rows zero as an unused embedding row's
are) once with the tensors on the device and once on the CPU, in one process (world size 1:
NCCL refuses two ranks on one GPU — check 6 — so the collectives themselves are not run here;
their payload kernels are). TF32 is off, so both sides compute in IEEE fp32.

"To fp32 rounding" is judged per tensor: the two sides' kernels may round differently (fused
multiply-adds, matmul blocking), and a discrete decision taken on a value within rounding of
its threshold (a sign, a top-k pick, a bf16 rounding) may then go the other way. So:

* parameters: elements that differ by about ``2·lr`` (a sign taken the other way) at most
  0.01% of all, every other element within ``1e-5`` of the tensor's largest magnitude;
* optimizer state (momenta, DCT-domain momenta): at most 0.1% of elements further than
  ``1e-4`` of the tensor's largest magnitude from the CPU's; integer state equal.

``host_syncs`` (CUDA): ``torch.cuda.set_sync_debug_mode("warn")`` around every step after the
first (which builds per-device tables once); each synchronising call is listed by the line
of Python that made it. Bar: none.

Example::

    >>> import torch
    >>> from gpu_check_common import SIZES, Env
    >>> result = check_optimizers(Env(torch.device("cpu"), SIZES["tiny"], "cpu-local"))
    >>> result.parts["demo"].verdict, result.parts["lion"].verdict
    ('pass', 'pass')
"""

from __future__ import annotations

import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from gpu_check_common import CheckResult, Env, Part, free_memory, judged

__all__ = ["check_optimizers", "compare_runs", "within_rounding", "LR"]

LR = {"demo": 1e-3, "lion": 1e-4}
FLIP_FRACTION = 1e-4
PARAM_ROUNDING = 1e-5
STATE_TOLERANCE, STATE_FRACTION = 1e-4, 1e-3


def _make(kind: str, params: list) -> Any:
    from lynx.optim import DeMo, DistributedLion

    if kind == "demo":
        return DeMo(params, lr=LR[kind], compression_topk=16, compression_chunk=32, weight_decay=0.01)
    return DistributedLion(params, lr=LR[kind], weight_decay=0.01, mode="mavo")


def _inputs(shapes: tuple, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(shape, generator=gen) for shape in shapes]
    grads = []
    for _ in range(steps):
        step = [torch.randn(shape, generator=gen) * 1e-2 for shape in shapes]
        for g in step:
            if g.dim() == 2 and g.shape[0] > 4:
                g[: g.shape[0] // 4].zero_()  # rows without gradient (unused embedding rows)
        grads.append(step)
    return params, grads


def _state_tensors(opt: Any) -> dict[str, torch.Tensor]:
    out = {}
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{index}.{key}"] = value.detach().cpu()
    return out


def _sync_site(message: Any) -> str:
    """Where a synchronising call came from: the innermost frame of Lynx's own code (the torch
    frame a warning names is only the Python line that was running), and that torch frame."""
    if "synchroniz" not in str(message):
        return ""
    frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in Path(f.filename).name]
    ours = [f for f in frames if f"{os.sep}lynx{os.sep}" in f.filename]
    torch_frame = frames[-1] if frames else None
    site = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].line}" if ours else "?"
    stack = " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:8])
    if torch_frame is None:
        return site
    return f"{site} (in {Path(torch_frame.filename).name}:{torch_frame.lineno}; stack {stack})"


def _run(kind: str, device: torch.device, params0: list, grads: list, count_syncs: bool) -> tuple:
    params = [torch.nn.Parameter(p.clone().to(device)) for p in params0]
    opt = _make(kind, params)
    syncs: list[str] = []
    if count_syncs:  # switch the mode once outside the count: what that call flushes is not a step's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("warn")
            torch.cuda.set_sync_debug_mode("default")
    for t, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = g.to(device)
        if count_syncs and t > 0:
            torch.cuda.synchronize(device)
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda message, *_a, **_k: syncs.append(_sync_site(message))
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs[:] = [s for s in syncs if s]
        else:
            opt.step()
    return [p.detach().cpu() for p in params], _state_tensors(opt), syncs


def compare_runs(kind: str, ref: tuple, got: tuple) -> dict[str, Any]:
    """How far run ``got`` is from ``ref`` (each ``(params, state tensors, syncs)``)."""
    (ref_params, ref_state, _), (params, state, _) = ref, got
    lr = LR[kind]
    flips = elements = 0
    rounding = 0.0
    for a, b in zip(ref_params, params):
        d = (a - b).abs()
        flipped = d > 0.5 * lr
        flips += int(flipped.sum())
        elements += a.numel()
        rest = d[~flipped]
        if rest.numel():
            rounding = max(rounding, float(rest.max()) / max(float(a.abs().max()), 1e-30))
    state_far = state_elements = int_unequal = 0
    state_worst = 0.0
    for key, a in ref_state.items():
        b = state[key]
        if not a.is_floating_point():
            int_unequal += int((a != b).sum())
            continue
        scale = max(float(a.abs().max()), 1e-30)
        d = (a.double() - b.double()).abs() / scale
        state_worst = max(state_worst, float(d.max()) if d.numel() else 0.0)
        state_far += int((d > STATE_TOLERANCE).sum())
        state_elements += a.numel()
    return {"elements": elements, "sign_flips": flips, "flip_fraction": flips / max(elements, 1),
            "param_rounding_rel": rounding, "state_elements": state_elements, "state_far": state_far,
            "state_far_fraction": state_far / max(state_elements, 1), "state_worst_rel": state_worst,
            "int_state_unequal": int_unequal,
            "bitwise_params": all(torch.equal(a, b) for a, b in zip(ref_params, params))}


def within_rounding(figure: dict[str, Any]) -> bool:
    """Whether :func:`compare_runs`' figure is what fp32 rounding explains (module docstring)."""
    return (
        figure["flip_fraction"] <= FLIP_FRACTION
        and figure["param_rounding_rel"] <= PARAM_ROUNDING
        and figure["state_far_fraction"] <= STATE_FRACTION
        and figure["int_state_unequal"] == 0
    )


def check_optimizers(env: Env) -> CheckResult:
    sizes = env.sizes
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    parts: dict[str, Part] = {}
    syncs: dict[str, list[str]] = {}
    try:
        params0, grads = _inputs(sizes.optim_shapes, sizes.optim_steps)
        for kind in ("demo", "lion"):
            ref = _run(kind, torch.device("cpu"), params0, grads, count_syncs=False)
            got = _run(kind, env.device, params0, grads, count_syncs=env.cuda)
            figure = compare_runs(kind, ref, got)
            syncs[kind] = got[2]
            ok = within_rounding(figure)
            where = "" if env.cuda else " (device is the CPU: the harness compared with itself)"
            parts[kind] = Part(
                figure,
                judged(ok),
                f"{figure['sign_flips']} sign flips in {figure['elements']} elements, params within "
                f"{figure['param_rounding_rel']:.1e}, state {figure['state_far']} elements beyond "
                f"{STATE_TOLERANCE:g} (worst {figure['state_worst_rel']:.1e}){where}",
            )
            free_memory(env.device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if env.cuda:
        found = {k: sorted(set(v)) for k, v in syncs.items()}
        total = sum(len(v) for v in syncs.values())
        parts["host_syncs"] = Part(
            {"per_optimizer": {k: len(v) for k, v in syncs.items()}, "where": found},
            judged(total == 0),
            f"{total} synchronising calls in {sizes.optim_steps - 1} steps of each" + (f": {found}" if total else ""),
        )
    else:
        parts["host_syncs"] = Part({}, "skipped", "host synchronisation is a CUDA notion")
    figure = {
        k: {"flip_fraction": p.figure["flip_fraction"], "state_worst_rel": p.figure["state_worst_rel"]}
        for k, p in parts.items()
        if k in ("demo", "lion")
    }
    figure["params"] = sum(torch.Size(s).numel() for s in sizes.optim_shapes)
    reason = "; ".join(f"{n}: {p.reason}" for n, p in parts.items()) + "; world size 1 (collectives not run)"
    return CheckResult(figure, reason, parts)
