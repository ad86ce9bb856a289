"""Where a `lynx calibrate` spends its time: each step's wall and CPU seconds, and each forked process's.

Runs ``lynx.calibrate.calibrate_host`` (``--runs`` times, in this process) with hooks that
record, without changing what is measured:

* per step of the progress (the captures while the ranks prepare, each repeat, the runtime,
  the pp link and the check, the TP stage and the tp link's ladder): its wall seconds and this
  process's CPU seconds;
* per forked process (the links' and the ladder's ranks where forked (a GPU), and every
  :class:`lynx.calibrate.forked.Staged` one: the standalone figures, the runtime's and the TP
  stage's ranks, the check): when it prepared and when it ended, the wall and CPU seconds
  (all its threads) from its fork to being prepared, and from being let go to its end.

So the critical path shows itself: which process the captures' step waits for last, what a
measuring step costs, how much CPU each part takes (on a loaded machine the CPU seconds are
the steadier figure). Prints the load average with every run; ``--json`` writes it all.

    flock /tmp/notes/bench.lock python benchmarks/calibrate_phases.py --runs 2 --json phases.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lynx.calibrate.allreduce as allreduce  # noqa: E402
import lynx.calibrate.forked as forked  # noqa: E402
import lynx.calibrate.host as host  # noqa: E402
import lynx.calibrate.links as links  # noqa: E402

_child: dict[str, Any] = {}   # in a forked process: who it is, when it started, where it logs


def _log(**fields: Any) -> None:
    with open(_child["log"], "a") as f:
        f.write(json.dumps(fields) + "\n")


def _mark(event: str) -> None:
    """In a forked process: ``event`` with the wall and CPU seconds since the last mark."""
    wall, cpu = time.perf_counter(), time.process_time()
    _log(who=_child.get("who") or f"pid {os.getpid()}", event=event, at=wall - _child["t0"],
         wall=wall - _child["wall"], cpu=cpu - _child["cpu"], since=_child.get("since", "its fork"))
    _child.update(wall=wall, cpu=cpu)


def _install(log: str, t0: float) -> None:
    """The hooks: at fork, at a Staged rank's start, at Gate.prepared, at the process's end."""
    def after_fork() -> None:
        _child.update(pid=os.getpid(), log=log, t0=t0, wall=time.perf_counter(), cpu=time.process_time(),
                      who=None)

    os.register_at_fork(after_in_child=after_fork)
    real_exit, real_prepared, real_rank = os._exit, forked.Gate.prepared, forked.staged_rank

    def exit_(code: int) -> None:
        if _child.get("pid") == os.getpid():
            _mark("ended")
        real_exit(code)

    def prepared(self: Any, wait_s: float) -> None:
        _mark("prepared")
        real_prepared(self, wait_s)
        _child.update(wall=time.perf_counter(), cpu=time.process_time(), since="let go")   # the wait: neither

    def staged_rank(target: Any, rank: int, *args: Any) -> None:
        if target.__name__ != "named":   # the links' and the ladder's ranks name themselves
            _child["who"] = f"{target.__module__.rsplit('.', 1)[-1]}.{target.__name__}[{rank}]"
        real_rank(target, rank, *args)

    os._exit, forked.Gate.prepared, forked.staged_rank = exit_, prepared, staged_rank
    for module in (links, allreduce):   # their ranks are forked with the module's _worker as target
        def named(rank: int, *args: Any, _real: Any = module._worker, _name: str = module.__name__) -> Any:
            _child["who"] = f"{_name.rsplit('.', 1)[-1]}._worker[{rank}]"
            return _real(rank, *args)
        module._worker = named


def one_run(log: Path, repeats: int) -> dict[str, Any]:
    """One calibration: its steps and its forked processes."""
    log.write_text("")
    t0 = time.perf_counter()
    _child.update(log=str(log), t0=t0)
    steps: list[tuple[str, float, float]] = []
    real_step = host.CalibrationProgress.step

    def step(self: Any, what: str) -> None:
        steps.append((what, time.perf_counter() - t0, time.process_time()))
        real_step(self, what)

    host.CalibrationProgress.step = step
    try:
        load = os.getloadavg()[0]
        spec = host.calibrate_host(progress=False, repeats=repeats)
    finally:
        host.CalibrationProgress.step = real_step
    steps.append(("end", time.perf_counter() - t0, time.process_time()))
    rows = [{"step": w[:70], "wall": t2 - t, "cpu": c2 - c} for (w, t, c), (_, t2, c2) in zip(steps, steps[1:])]
    procs = [json.loads(line) for line in log.read_text().splitlines()]
    return {"load_before": load, "load_after": os.getloadavg()[0], "seconds": spec.calibration.seconds,
            "steps": rows, "processes": procs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    log = Path(f"/tmp/lynx-calibrate-phases-{os.getpid()}.jsonl")
    _install(str(log), time.perf_counter())
    runs = []
    for i in range(args.runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run = one_run(log, args.repeats)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        run["children_cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        runs.append(run)
        print(f"run {i + 1}: {run['seconds']:.2f} s at load {run['load_before']:.2f} → {run['load_after']:.2f}; "
              f"this process's CPU {sum(r['cpu'] for r in run['steps']):.2f} s, its forked processes' "
              f"{run['children_cpu']:.2f} s")
        for r in run["steps"]:
            print(f"  {r['wall']:6.2f} s wall {r['cpu']:6.2f} s CPU  {r['step']}")
        for p in run["processes"]:
            print(f"  {p['who']:30s} {p['event']:8s} at {p['at']:6.2f} s: {p['wall']:6.2f} s wall {p['cpu']:6.2f} s "
                  f"CPU since {p['since']}")
    log.unlink(missing_ok=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
