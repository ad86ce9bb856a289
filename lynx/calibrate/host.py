"""``lynx calibrate``: measure this host into a :class:`~lynx.planner.hardware.HardwareSpec`.

On CPU it measures what ``cpu-local`` holds (one thread per rank, as ``examples/train_gpt.py``
runs): matmul and elementwise rates, the host cost of an op of generated code, random numbers,
optimizer steps (:mod:`lynx.calibrate.cpu`), the runtime's own work per pipeline action
(:mod:`lynx.calibrate.runtime`) and the gloo link between two processes of this host
(:mod:`lynx.calibrate.links`), which pp, tp and dp all use here. With CUDA it measures the
first GPU instead (:mod:`lynx.calibrate.gpu`) and the NCCL link between the first two GPUs; with
one GPU no link can be seen, so the links are a datasheet preset's (named in the notes). Every
quantity is measured ``repeats`` times, each the fastest of several runs; the spec holds the
medians of the rates, and the best repeat of the host costs (op overhead, optimizer steps, the
runtime's work: other jobs' bursts on the shared caches only add to them) and the link's
latency and bandwidth (timed across processes); its ``calibration``
block, per figure, the spread and the share of a core it was measured with, the figures that
may be off by more than 10% and why, the time taken and the load average before and after.
The ranks that measure the runtime and a TP stage fork early and trace their
stages while this process captures the references (the captures use one core), as does the
process that times the 64 × 8 reference's generated graphs for the check; all wait to measure
until nothing else runs (:class:`lynx.calibrate.forked.Staged`). The links are timed by those
ranks too, after their own measurement: the runtime's two (a core each) time the pp/dp link's
round trips, the TP stage's two the tp link's all-reduce ladder, so no pair of processes is
forked, joined into a group and torn down for them (that took ~2.5 s, with this process idle,
before the captures began). The figures no capture feeds
(an eager op, the dtype matmuls, the host copies) are timed by a process forked as the
captures begin, on the core the first capture leaves idle (:mod:`lynx.calibrate.standalone`).
The GPU's figures: :mod:`lynx.calibrate.gpu_figures`; the progress shown:
:mod:`lynx.calibrate.progress`.

Example (about 20 s on 2 cores; ``lynx calibrate`` runs it)::

    >>> from lynx.calibrate import calibrate_host
    >>> spec = calibrate_host(progress=False, repeats=1)              # doctest: +SKIP
    >>> spec.device, spec.calibration.repeats                          # doctest: +SKIP
    ('cpu', 1)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import statistics
import time
from typing import Any

import torch

from lynx.calibrate.gpu_figures import measure_gpu
from lynx.calibrate.host_copies import HOST_LINK_FIGURES, physical_memory
from lynx.calibrate.progress import CalibrationProgress
from lynx.calibrate.repeats import Repeated
from lynx.planner.cost import allreduce_time
from lynx.units import format_size
from lynx.errors import LynxRuntimeError
from lynx.planner.hardware import RELIABLE_SPREAD, Calibration, HardwareSpec, LinkSpec

__all__ = ["calibrate_host", "unreliable_figures", "STARVED_SHARE", "LINK_REPEATS_PER_REPEAT", "OTHERS_CPUS"]


def calibrate_host(progress: bool = True, repeats: int = 5, device: str | None = None) -> HardwareSpec:
    """Measure this host (``device``: ``"cpu"``, ``"cuda"``, default CUDA where present)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise LynxRuntimeError("calibrate measures one rank alone, so it needs a process without a process group: "
                               "run `lynx calibrate` or `python -m lynx.calibrate --output FILE` instead")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LynxRuntimeError("--device cuda: torch sees no CUDA device here (a CPU-only torch build, or no GPU "
                               "visible); measure the CPU with --device cpu")
    say = CalibrationProgress(progress)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    threads = torch.get_num_threads()
    try:
        fields, measured, notes, used_threads = (_measure_cpu if device == "cpu" else measure_gpu)(repeats, say)
    finally:
        torch.set_num_threads(threads)
        say.close()
    load_after, cpus = os.getloadavg()[0], os.cpu_count() or 1
    calibration = Calibration(
        host=socket.gethostname(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - start, 2), repeats=repeats, threads=used_threads, cpus=cpus,
        load_before=round(load_before, 2), load_after=round(load_after, 2), torch=torch.__version__,
        spread={m.name: round(m.spread, 4) for m in measured},
        cpu_share={m.name: round(m.cpu_share, 3) for m in measured if m.cpu_share is not None},
        unreliable=unreliable_figures(measured, max(load_before, load_after), cpus), notes=notes)
    return HardwareSpec(**fields, calibration=calibration)


# The pp link's round trips are timed in this many repeats per calibration repeat, each of
# lynx.calibrate.links.CALIBRATION_SMALL_TRIPS 1-element trips and 50 of 1 MiB (~0.3 s of
# trips in all): β is their best, and 10 repeats see the shared-cache state more often than 5
LINK_REPEATS_PER_REPEAT = 2


# Below this share of a core in every repeat, CPU time itself is inflated: at load 12-18 on 2
# cpus, with 2-4% of a core, op overhead read 4.88 µs and the runtime 530 µs per action against
# 3.1-3.3 and 195-230 at half a core or more, steady across repeats and so not caught by spread.
STARVED_SHARE = 0.25


# Above this many cpus taken by other processes while the TP stage's runs went on, its figure is
# that moment's: the stage idles between hand-offs and the others' work there delays them (~4.5
# ms a run per 10 ms of theirs; ten calibrations a minute apart read 447-704 µs for the tp link's
# α as other sessions' jobs took 0.6-0.9 cpus), however steady its blocks
OTHERS_CPUS = 0.25


def unreliable_figures(measured: list[Repeated], load: float, cpus: int) -> dict[str, str]:
    """Each figure with a repeat more than ``RELIABLE_SPREAD`` from the repeats' median, or
    whose every repeat got less than ``STARVED_SHARE`` of a core, or measured while other
    processes took more than ``OTHERS_CPUS`` cpus, with why."""
    out = {}
    busy = f"load {load:.1f} on {cpus} cpus"
    for m in measured:
        if m.others_cpus is not None and m.others_cpus > OTHERS_CPUS:
            out[m.name] = (f"other processes took {m.others_cpus:.2f} cpus while it was measured (more than "
                           f"{OTHERS_CPUS:.2f} of a core; {busy}): "
                           "between its hand-offs the stage leaves the cores idle, and other jobs' work there "
                           "delays them, so the figure is that moment's load's, not the host's (it moved by "
                           "1.5× as their share did). Measure again on a quieter machine: lynx calibrate")
            continue
        if m.cpu_shares and max(m.cpu_shares) < STARVED_SHARE:
            out[m.name] = (f"no repeat's runs got more than {max(m.cpu_shares):.0%} of a core ({busy}): starved that "
                           "long, even CPU time is inflated (other jobs keep the caches and memory busy), however "
                           "steady the repeats. Measure again on a quieter machine: lynx calibrate")
            continue
        if len(m.values) < 2 or m.deviation <= RELIABLE_SPREAD:
            continue
        if m.best is None:
            why = (f"one of its {len(m.values)} repeats is {m.deviation:.0%} from their median (a repeatable figure "
                   f"keeps every repeat within ±{RELIABLE_SPREAD:.0%})")
        else:
            why = (f"its two best of {len(m.values)} repeats differ by {m.deviation:.0%} (a repeatable figure: "
                   f"within {RELIABLE_SPREAD:.0%})")
        if m.name == "links.beta_bytes_per_s":
            why += (f"; a 1 MiB trip between two cores runs twice as fast while the host runs them where they "
                    f"share a cache, which it changes from moment to moment and a busy VM rarely sees ({busy})")
        elif m.name.startswith("links."):
            why += f"; a round trip needs both processes on a core at once, and at {busy} other jobs hold them"
        elif m.name == "runtime_action_s":
            why += f"; two ranks and their threads shared the cores with other jobs ({busy})"
        elif m.cpu_share is not None and m.cpu_share < 0.7:
            why += (f"; its runs got as little as {m.cpu_share:.0%} of a core ({busy}): other jobs share the "
                    "caches and memory bandwidth too")
        else:
            why += f" ({busy})"
        out[m.name] = why + ". Measure again on a quieter machine: lynx calibrate"
    return out


# ------------------------------------------------------------------------------- CPU
def _measure_cpu(repeats: int, say: "CalibrationProgress") -> tuple[dict[str, Any], list[Repeated], list[str], int]:
    from lynx.calibrate.cpu import ReferenceModel, start_generated_graphs_s
    from lynx.calibrate.runtime import start_runtime_action_s
    from lynx.calibrate.standalone import start_standalone
    from lynx.calibrate.tp_stage import block_runs, start_tp_stage_s

    say.total(3 + repeats)
    torch.set_num_threads(1)
    say.step("capturing the references: gpt-tiny at seq 4 × 1 in 2 stages and tp 2, then at seq 64 × 8, while "
             "a process times an eager op, matmul dtypes and host copies and the runtime's and the TP stage's "
             "ranks trace their stages")
    with contextlib.ExitStack() as ranks:
        # the figures no capture feeds: timed on the core the first capture leaves idle
        standalone = ranks.enter_context(start_standalone(repeats))
        small = ReferenceModel(seq=4, microbatch=1, pp=2)
        sharded = small.layout(tp=2)   # the same capture and profile, planned for pp 1 × tp 2
        # the forked ranks build and trace their stages (seconds of CPU, nothing timed) on the
        # other core, then wait to measure until nothing else runs here. They time the links
        # too, once they have measured: the pp/dp link's round trips the runtime's (a core each),
        # the tp link's all-reduce ladder the TP stage's (no pair of processes forked for them)
        runtime_ranks = ranks.enter_context(start_runtime_action_s(small, repeats=repeats,
                                                                   link_repeats=LINK_REPEATS_PER_REPEAT * repeats))
        # the TP stage's runs: a block after each repeat (run_block), spread over the calibration
        tp_ranks = ranks.enter_context(start_tp_stage_s(sharded, repeats=repeats, runs=block_runs(repeats),
                                                        ladder_repeats=repeats, blocks=True))
        reference = ReferenceModel()
        # the check's timing of the reference's generated graphs: traced in a process of its own
        check = ranks.enter_context(start_generated_graphs_s(reference, runs=3))
        small.one_stage()   # its trace, before any timed run
        runtime_ranks.wait_prepared(), tp_ranks.wait_prepared(), check.wait_prepared()
        return _measure_cpu_figures(repeats, say, reference, small, (runtime_ranks, tp_ranks, check, standalone),
                                    sharded)


def _measure_cpu_figures(repeats: int, say: "CalibrationProgress", reference: Any, small: Any, started: tuple,
                         sharded: Any) -> tuple[dict[str, Any], list[Repeated], list[str], int]:
    """The CPU figures from the references and the prepared processes (:func:`_measure_cpu`)."""
    from lynx.calibrate.cpu import OPTIMIZERS, generated_graphs_results, generated_graphs_s, generated_op_overhead_s
    from lynx.calibrate.cpu import node_rates, optimizer_s_per_param
    from lynx.calibrate.allreduce import LADDER_BYTES
    from lynx.calibrate.cpu import priced_graphs_s
    from lynx.calibrate.runtime import runtime_action_results
    from lynx.calibrate.standalone import standalone_results
    from lynx.calibrate.tp_stage import block_runs, per_collective_s, priced_stage_s, tp_stage_results

    from lynx.calibrate.allreduce import allreduce_link

    runtime_ranks, tp_ranks, check, standalone = started
    ladder = ", ".join(format_size(n) for n in LADDER_BYTES)
    m = {name: Repeated(name) for name in (
        "peak_flops.float32", "peak_flops.bfloat16", "peak_flops.float16", "memory_bandwidth",
        "rng_s_per_element", *HOST_LINK_FIGURES)}
    # host costs of a few µs per op or param: other jobs on the other core (its share of the
    # caches and memory) only ever add to them, in bursts, so the least disturbed repeat is the figure
    for name in ("op_overhead_s", "runtime_action_s", *(f"optimizer_s_per_param.{o}" for o in OPTIMIZERS)):
        m[name] = Repeated(name, best="min")
    small_s = Repeated("small")
    beside = standalone_results(standalone)   # timed while the first capture ran (lynx.calibrate.standalone)
    for r in range(repeats):
        say.step(f"repeat {r + 1} of {repeats}: gpt-tiny's nodes and generated graphs, optimizer steps; a "
                 f"block of {block_runs(repeats)} runs of the tensor-parallel stage on 2 processes")
        eager, ratios = beside[r].eager, beside[r].ratios
        rates = node_rates(reference, eager.seconds)
        steps = optimizer_s_per_param(reference)
        timing = generated_graphs_s(small, min_total_s=0.1)   # ~10 runs of ~10 ms: one undisturbed
        small_s.add(timing.seconds, timing.cpu_share)
        m["peak_flops.float32"].add(rates["matmul_flops"], rates["cpu_share"])
        m["memory_bandwidth"].add(rates["memory_bandwidth"], rates["cpu_share"])
        m["rng_s_per_element"].add(rates["rng_s_per_element"], rates["cpu_share"])
        for dtype in ("bfloat16", "float16"):
            m[f"peak_flops.{dtype}"].add(rates["matmul_flops"] * ratios[dtype], rates["cpu_share"])
        for name in OPTIMIZERS:
            m[f"optimizer_s_per_param.{name}"].add(steps[name].seconds, steps[name].cpu_share)
        for name, value in beside[r].host_link.items():
            m[f"host_link.{name}"].add(value)
        # this repeat's block of the TP stage's runs, while this process waits (nothing else runs)
        if not tp_ranks.run_block():
            raise LynxRuntimeError("the tensor-parallel stage's ranks did not finish a block of runs within "
                                   f"{tp_ranks.timeout_s:.0f} s")
    # generated code's per-op cost on the median rates: its spread is the timing's alone
    rates = {"matmul_flops": m["peak_flops.float32"].median, "memory_bandwidth": m["memory_bandwidth"].median,
             "rng_s_per_element": m["rng_s_per_element"].median}
    for t, share in zip(small_s.values, small_s.cpu_shares):
        m["op_overhead_s"].add(generated_op_overhead_s(small, rates, t), share)
    say.step("lynx.runtime.Pipeline on 2 processes: the runtime's own work per action, then the pp/dp link "
             "between them (1-element and 1 MiB round trips); a check")
    reference_s = generated_graphs_results(check)
    main, threads, pp_link = runtime_action_results(small, runtime_ranks)
    for a, b in zip(main, threads):
        m["runtime_action_s"].add(a + b)
    assert pp_link is not None   # asked for (start_runtime_action_s's link_repeats)
    alphas, betas = pp_link
    # β: the best repeat, as α. What moves it is where the host runs this VM's two vCPUs: a
    # cache line bounced between two pinned threads takes ~100 ns when they share a cache and
    # ~450 ns when not, a 1 MiB hand-off from one core to the other 25 GB/s or 11, and gloo's
    # 1 MiB trip then reads ~6.5-8 GB/s or ~3.3 (α ~36 µs or ~43), and so does every size from
    # 64 KiB to 4 MiB, the slope between sizes and 8 × 1 MiB streamed: no message size, fit over
    # sizes or other statistic of the same trips removes it (benchmarks/link_modes.py).
    # The host moves them from one second to the next; quiet, the repeats of one calibration
    # mix the two (all three of a quiet series flagged β), and the median of 10 read 5.96,
    # 4.82 and 6.57 GB/s as the mix went. The best repeat is the shared-cache state whenever
    # a repeat saw it, the state α's fastest trip describes too; the best repeat of either
    # state sat within ±7% pair to pair. Where no repeat saw it (a busy VM keeps its vCPUs
    # apart) β reads the other state, ~3.5 GB/s, and a lone fast repeat is flagged (its two
    # best differ by more than 10%).
    alpha = Repeated("links.alpha_s", alphas, best="min")
    beta = Repeated("links.beta_bytes_per_s", betas, best="max")
    link = LinkSpec(alpha_s=alpha.value, beta_bytes_per_s=beta.value)
    fields: dict[str, Any] = {   # HardwareSpec's fields (it validates them)
        "name": f"{socket.gethostname()}-cpu", "device": "cpu",
        "peak_flops": {d: m[f"peak_flops.{d}"].median for d in ("float32", "bfloat16", "float16")},
        "achievable_fraction": 1.0, "memory_bandwidth": m["memory_bandwidth"].median,
        "memory_bytes": physical_memory(), "links": {"pp": link, "dp": link},   # tp: after its stage
        "op_overhead_s": m["op_overhead_s"].value, "rng_s_per_element": m["rng_s_per_element"].median,
        "optimizer_s_per_param": {o: m[f"optimizer_s_per_param.{o}"].value for o in OPTIMIZERS},
        "host_link": {**{k.split(".", 1)[1]: m[k].median for k in HOST_LINK_FIGURES}, "synchronous": True},
        "host_memory_bytes": physical_memory() // 2,
        "runtime_action_s": m["runtime_action_s"].value,
    }
    say.step("the tensor-parallel stage's 2 processes: the tp link between them (all-reduces of "
             f"{ladder}); what the stage's collectives cost beyond the all-reduces alone")
    stage_walls, tp_ladder, tp_others = tp_stage_results(sharded, tp_ranks)
    assert tp_ladder is not None   # asked for (start_tp_stage_s's ladder_repeats)
    tp_link, tp_fits = allreduce_link(tp_ladder)
    fields["links"] = {"pp": link, "tp": tp_link, "dp": link}
    priced, collectives = priced_stage_s(sharded, HardwareSpec(**fields))
    extra = [per_collective_s(w, priced, collectives) for w in stage_walls]
    # a ring all-reduce over 2 ranks pays 2 α (lynx.planner.cost.allreduce_time): the per-collective
    # term rides on α, so every TP collective the timeline prices carries it
    tp_alpha = Repeated("links.tp.alpha_s", [f.alpha_s + e / 2 for f, e in zip(tp_fits, extra)])
    fields["links"] = {**fields["links"], "tp": LinkSpec(alpha_s=tp_link.alpha_s + statistics.median(extra) / 2,
                                                         beta_bytes_per_s=tp_link.beta_bytes_per_s)}
    tp_alpha.others_cpus = max(tp_others) if tp_others else None   # unreliable_figures: OTHERS_CPUS
    measured = [*m.values(), alpha, beta, tp_alpha,
                Repeated("links.tp.beta_bytes_per_s", [f.beta_bytes_per_s for f in tp_fits])]
    modelled = priced_graphs_s(reference, rates, fields["op_overhead_s"])
    notes = ["one thread per process, as a training rank runs; every figure timed on it is the fastest of several "
             "runs in the thread's CPU time, which other load inflates far less than wall time (only through the "
             "caches and memory it shares); host costs (op overhead, optimizer steps, the runtime) are the best "
             "repeat, rates the median",
             "rates fitted to gpt-tiny's own nodes (seq 64 × 8); op overhead: per op of generated code, "
             f"gpt-tiny at seq 4 × 1 as one stage ({statistics.median(small_s.values) * 1e3:.2f} ms for "
             f"{_ops(small)} ops per microbatch)",
             f"check: gpt-tiny's generated forward and backward at seq 64 × 8 take {reference_s * 1e3:.2f} ms "
             f"per microbatch, the figures above price them at {modelled * 1e3:.2f} ms "
             f"({modelled / reference_s:.2f}×)",
             f"runtime: lynx.runtime.Pipeline, pp 2 × 4 microbatches on 2 forked processes: "
             f"{min(main) * 1e6:.0f}-{max(main) * 1e6:.0f} µs per action of a rank's list (forward, backward, "
             f"send, receive) on the main thread outside the graph calls of the step, {min(threads) * 1e6:.0f}-"
             f"{max(threads) * 1e6:.0f} µs in its other threads (p2p waiters, gloo), each rank on a core of its "
             "own; the least sum is the figure",
             "links: gloo between two processes of this host; pp and dp: point-to-point round trips between "
             f"the runtime's two processes on cores of their own once it is timed, {len(alphas)} repeats of "
             f"the fastest of 100 1-element and 50 1 MiB trips, α and β the fastest repeat (β's median "
             f"{beta.median / 1e9:.2f} GB/s: where far below, some repeats ran with the two vCPUs apart); tp: the "
             "functional all-reduce and its wait as a TP stage's generated code runs them, by its two processes "
             "(a core each where they fill the cores, as a training job's: lynx.runtime.core_pin) once the stage "
             "is timed, per size "
             f"({ladder}) the fastest of 40 per repeat, α + n/β fitted to the repeats' medians (α "
             f"{tp_link.alpha_s * 1e6:.1f} µs, a 32 KiB all-reduce {allreduce_time(32768, 2, tp_link) * 1e6:.0f} µs), "
             f"and α raised by half of what each collective costs inside a TP stage beyond that: gpt-tiny at seq "
             f"4 × 1 in pp 1 × tp 2 on 2 processes ran its generated graphs in {min(stage_walls) * 1e3:.1f}-"
             f"{max(stage_walls) * 1e3:.1f} ms (the median of {block_runs(repeats)} runs in each of "
             f"{len(stage_walls)} blocks, one after each repeat: every step pays the typical run's hand-offs, "
             "and what they cost moves with the moment; other processes took "
             + (f"{min(tp_others):.2f}-{max(tp_others):.2f} cpus meanwhile" if tp_others else "an unknown share")
             + f"), priced at {priced * 1e3:.1f} ms without it: "
             f"{statistics.median(extra) * 1e6:.0f} µs more per collective "
             f"({collectives} per run), a 32 KiB all-reduce "
             f"{allreduce_time(32768, 2, fields['links']['tp']) * 1e6:.0f} µs in all",
             "bfloat16/float16 matmul: float32's fitted rate × their speed on a (512, 128) @ (128, 512) matmul",
             "host link (offload): one thread copying 64 MiB between two buffers; host memory: half the RAM"]
    return fields, measured, notes, 1


def _ops(reference: Any) -> int:
    from lynx.calibrate.cpu import generated_ops

    return generated_ops(reference)
