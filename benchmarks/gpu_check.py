"""GPU validation: Lynx's CUDA paths, memory and time measured on a real accelerator (issue 16).

Seven checks, each printing one verdict line and written to ``<out>/gpu_check.{json,md}``
(``gpu_check_cpu.{json,md}`` for a ``--device cpu`` run, which is not a GPU report):

1. ``saved_bytes``   the CUDA-target profile vs ``saved_tensors_hooks`` on a real forward (1%)
2. ``peak_memory``   a compiled stage under recomputing plans: allocator peak vs plan (5%),
                     Lynx's meter vs the plan and vs the allocator
3. ``gradients``     rewritten stages vs the original model with dropout, bitwise
4. ``time``          predicted (``h200`` preset; a ``lynx calibrate`` file where that exists)
                     vs measured forward+backward; the stage's host overhead vs eager
5. ``offload``       a plan that offloads to host memory: gradients bitwise vs keep-all, the meter
                     vs the plan (5%), copy overlap measured and the step time it adds vs the plan
                     (CUDA; written without a device: not yet run on one)
6. ``optimizers``    DeMo and Distributed Lion on the device vs on the CPU (fp32 rounding),
                     host synchronisations inside a step
7. ``process_group`` a 2-process run on the one GPU, or why NCCL refuses it and what ran instead

The JSON is ``{"device": NAME, ..., "checks": {CHECK: {"figure", "verdict", "reason", "parts",
"seconds"}}}``; a check's verdict is ``fail`` if any of its parts failed, ``pass`` if one passed,
``skipped`` if none ran (each skipped part says why). The files are rewritten after every check,
so a run stopped by a time limit keeps what it measured. ``--device cpu`` runs every code path
that does not need CUDA (a CPU-target profile, the meter, bitwise gradients, the optimizers on
the CPU, a 2-process gloo run) and skips the rest with its reason.

Usage::

    python benchmarks/gpu_check.py                          # CUDA if present: h200 sizes, ~3-4 min
    python benchmarks/gpu_check.py --device cpu             # tiny sizes, ~1 min on 2 cores
    python benchmarks/gpu_check.py --checks saved_bytes,gradients --out /tmp/gc

On the lent H200 see ``docs/gpu.md`` (the wheels to carry, the command, the time budget).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the checkout's lynx, without installing it

import torch  # noqa: E402

import lynx.runtime  # noqa: E402,F401  (before any process group: lynx.process_group_guard)
from gpu_check_common import SIZES, CheckResult, Env, free_memory, verdict_of  # noqa: E402

__all__ = ["CHECKS", "main", "run_checks", "render_markdown"]


def _checks() -> dict[str, Callable[[Env], CheckResult]]:
    from gpu_check_grads import check_gradients
    from gpu_check_offload import check_offload
    from gpu_check_optim import check_optimizers
    from gpu_check_peak import check_peak_memory
    from gpu_check_pg import check_process_group
    from gpu_check_saved import check_saved_bytes
    from gpu_check_time import check_time

    return {"saved_bytes": check_saved_bytes, "peak_memory": check_peak_memory, "gradients": check_gradients,
            "time": check_time, "offload": check_offload, "optimizers": check_optimizers,
            "process_group": check_process_group}


CHECKS = ("saved_bytes", "peak_memory", "gradients", "time", "offload", "optimizers", "process_group")
SHARED_UNTIL = "offload"  # the last check that uses the shared GPT (gpu_check_common.shared_gpt)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown page: a verdict table, then every check's parts."""
    gpu = report["device_type"] == "cuda"
    lines = [f"# GPU check: {report['device']}", "",
             ("Measured on a GPU." if gpu else
              "**A `--device cpu` run, not a GPU report**: the CUDA parts are skipped; what ran checks the "
              "code paths the GPU run takes."), "",
             f"`{report['command']}` · torch {report['torch']} (CUDA {report['cuda']}) · sizes `{report['size']}` "
             f"· {report['started']} · {report['seconds']:.0f} s", "",
             "| check | verdict | reason |", "| --- | --- | --- |"]
    for name, check in report["checks"].items():
        lines.append(f"| {name} | **{check['verdict']}** | {_cell(check['reason'])} |")
    for name, check in report["checks"].items():
        lines += ["", f"## {name} ({check['seconds']:.1f} s)", "", "| part | verdict | figure | reason |",
                  "| --- | --- | --- | --- |"]
        for part_name, part in check.get("parts", {}).items():
            figure = json.dumps({k: v for k, v in part["figure"].items() if k != "per_action"})
            lines.append(f"| {part_name} | {part['verdict']} | `{_cell(figure)}` | {_cell(part['reason'])} |")
        if check.get("error"):
            lines += ["", "```", check["error"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _write(report: dict[str, Any], out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    (out / f"{stem}.md").write_text(render_markdown(report))


def run_checks(env: Env, names: list[str], out: Path, *, budget_s: float, command: str) -> dict[str, Any]:
    """Run ``names`` in order, writing the report after each; returns the report."""
    stem = "gpu_check" if env.cuda else "gpu_check_cpu"
    report: dict[str, Any] = {
        "device": device_name(env.device), "device_type": env.device.type, "torch": torch.__version__,
        "cuda": torch.version.cuda, "size": env.sizes.name, "sizes": env.sizes.__dict__, "command": command,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "seconds": 0.0,
        "checks": {}}
    start = time.perf_counter()
    functions = _checks()
    for name in names:
        t0 = time.perf_counter()
        if t0 - start > budget_s:
            entry = {"figure": {}, "verdict": "skipped", "parts": {},
                     "reason": f"not started: the run's time budget ({budget_s:.0f} s) was spent"}
        else:
            try:
                result = functions[name](env)
                entry = {"figure": result.figure, "verdict": verdict_of(result.parts), "reason": result.reason,
                         "parts": {k: p.as_dict() for k, p in result.parts.items()}}
            except Exception as err:  # noqa: BLE001 - one broken check must not lose the others
                entry = {"figure": {}, "verdict": "fail", "parts": {},
                         "reason": f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                         "error": traceback.format_exc(limit=8)}
        if name == SHARED_UNTIL or name == names[-1]:
            env.memo.clear()
        free_memory(env.device)
        entry["seconds"] = time.perf_counter() - t0
        report["checks"][name] = entry
        report["seconds"] = time.perf_counter() - start
        _write(report, out, stem)
        print(f"[{entry['verdict'].upper():>7}] {name}: {entry['reason']}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where available")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: h200 on cuda, tiny on the cpu")
    ap.add_argument("--layers", type=int, default=None, help="GPT layers (default: the size's, 2)")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="folder for the .json and .md report")
    ap.add_argument("--calibrate", choices=("auto", "never"), default="auto",
                    help="auto: time predictions also from a `lynx calibrate` file where that command exists")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="start no check after this many seconds (the last one, 6, takes ~1.5 min)")
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    sizes = SIZES[args.size or ("h200" if device.type == "cuda" else "tiny")]
    if args.layers is not None:
        if args.layers < 1:
            ap.error(f"--layers must be >= 1, got {args.layers}")
        sizes = type(sizes)(**{**sizes.__dict__, "layers": args.layers})
    threads = torch.get_num_threads()
    if device.type == "cpu":  # one thread, as a rank runs: on a loaded machine OpenMP threads spin
        torch.set_num_threads(1)  # on busy cores (a tiny step took 0.84 s with 2 threads, 24 ms with 1)
    try:
        with tempfile.TemporaryDirectory(prefix="lynx_gpu_check_") as workdir:
            env = Env(device, sizes, "h200" if device.type == "cuda" else "cpu-local", calibrate=args.calibrate,
                      workdir=workdir)
            print(f"gpu_check on {device_name(device)}: sizes {sizes.name}, checks {', '.join(names)}", flush=True)
            report = run_checks(env, names, args.out, budget_s=args.budget_s, command="python benchmarks/gpu_check.py "
                                + " ".join(argv if argv is not None else sys.argv[1:]))
    finally:
        torch.set_num_threads(threads)
    verdicts = [c["verdict"] for c in report["checks"].values()]
    print(f"{verdicts.count('pass')} pass, {verdicts.count('fail')} fail, {verdicts.count('skipped')} skipped "
          f"in {report['seconds']:.0f} s -> {args.out}", flush=True)
    return 1 if "fail" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
