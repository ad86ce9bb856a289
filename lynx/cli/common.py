"""What `lynx plan`, `lynx show` and `lynx compare` share: their options, the config they
build, the model analysis and the error exit.

Typer needs each option spelled out in each command's signature; they are defined once here::

    >>> from lynx.cli.common import compile_config
    >>> compile_config(2, 1, 1, 8, "1f1b", 2, "40GiB", "h100-sxm", "adamw", "heu", 60.0, None, 0, 3).pp
    2
"""

from __future__ import annotations

import gc
from typing import Any, Optional

import typer

from lynx.config import CompileConfig
from lynx.errors import LynxError

__all__ = ["MODEL_HELP", "compile_config", "apply_sharding", "analyze_spec", "run_or_exit"]

MODEL_HELP = "a preset (gpt-1.3b … gpt-20b, llama-7b, gpt-tiny, llama-tiny) or module:factory"


def compile_config(pp: int, dp: int, tp: int, microbatches: int, schedule: str, virtual_stages: int,
            memory_budget: Optional[str], hardware: str, optimizer: str, solver: str, time_limit: float,
            target: Optional[str], seed: int, iterations: int, offload: bool = False,
            host_memory_budget: Optional[str] = None) -> CompileConfig:
    budget: Any = memory_budget
    if memory_budget is not None and memory_budget.isdigit():
        budget = int(memory_budget)
    host: Any = host_memory_budget
    if host_memory_budget is not None and host_memory_budget.isdigit():
        host = int(host_memory_budget)
    return CompileConfig(pp=pp, dp=dp, tp=tp, microbatches=microbatches, schedule=schedule,
                         virtual_stages=virtual_stages, memory_budget=budget, hardware=hardware,
                         optimizer=optimizer, solver=solver, time_limit_s=time_limit, target=target,
                         seed=seed, max_iterations=iterations, offload=offload, host_memory_budget=host)


def apply_sharding(analysis: Any, config: CompileConfig) -> tuple[CompileConfig, Any]:
    """:func:`lynx.frontend.tp_profile.apply_sharding`: with tp > 1 the default sharding plan,
    marked on the graph and recorded in the config (a plan then runs as it was priced)."""
    from lynx.frontend.tp_profile import apply_sharding as shard

    return shard(analysis, config)


def analyze_spec(model: str, config: CompileConfig, *, seq: Optional[int] = None, microbatch: Optional[int] = None,
                 dtype: Optional[str] = None, attention: Optional[str] = None) -> Any:
    """Resolve ``model`` (preset or module:factory) on the meta device and analyse it (the
    analysis's ``phases`` add ``import`` and ``model``: see :mod:`lynx.phases`)."""
    from lynx.frontend.analyze import analyze
    from lynx.models import resolve_model
    from lynx.phases import Phases

    phases = Phases()
    with phases.timed("import"):  # capture needs it, and building a model on meta would import it unnamed
        from lynx.torch_private import import_tracer

        import_tracer()
        gc.freeze()  # what the imports made lives to the end: later collections need not scan it
    with phases.timed("model"):
        resolved = resolve_model(model, seq=seq, microbatch=microbatch, dtype=dtype, attention=attention)
    analysis = analyze(resolved.model, resolved.example_inputs, target=config.target, hardware=config.hardware_spec())
    analysis.phases = phases.update_from(analysis.phases)
    return analysis


def run_or_exit(fn: Any) -> Any:
    try:
        return fn()
    except LynxError as err:
        typer.echo(f"error: {err}", err=True)  # plain: a message must not be re-wrapped
        raise typer.Exit(2) from None


# Options shared by plan and compare.
PP = typer.Option(1, "--pp", help="pipeline stages")
DP = typer.Option(1, "--dp", help="data-parallel replicas")
TP = typer.Option(1, "--tp", help="tensor-parallel degree")
MICROBATCHES = typer.Option(8, "--microbatches", "-m", help="microbatches per step")
SCHEDULE = typer.Option("1f1b", "--schedule", help="1f1b | gpipe | interleaved1f1b | zbh1")
VIRTUAL_STAGES = typer.Option(2, "--virtual-stages", help="model chunks per device (interleaved1f1b)")
MEMORY_BUDGET = typer.Option(None, "--memory-budget", "-b", help="per device, e.g. 60GiB (default: device memory)")
HARDWARE = typer.Option("h100-sxm", "--hardware", help="a preset (cpu-local, h100-sxm, a100-25gbe, ...), "
                   "a hardware file (.yaml/.json) or auto (this machine, measured)")
OPTIMIZER = typer.Option("adamw", "--optimizer", help="adamw | demo | lion (sets the DP windows)")
TIME_LIMIT = typer.Option(60.0, "--time-limit", help="seconds per stage solve (opt)")
TARGET = typer.Option(None, "--target", help="cuda | cpu (default from the hardware)")
SEED = typer.Option(0, "--seed",
                     help="recorded in the plan's config (the solvers are deterministic and do not read it)")
ITERATIONS = typer.Option(3, "--iterations", help="re-derive windows and re-solve at most this often")
SEQ = typer.Option(None, "--seq", help="sequence length (presets)")
MICROBATCH = typer.Option(None, "--microbatch", help="microbatch size (presets)")
DTYPE = typer.Option(None, "--dtype", help="fp16 | bf16 | fp32")
ATTENTION = typer.Option(None, "--attention", help="math | sdpa (presets)")
OFFLOAD = typer.Option(False, "--offload", help="also decide offload: saved values copied to host memory and "
                        "back over the hardware's host link (a fourth choice beside keep and recompute)")
HOST_MEMORY_BUDGET = typer.Option(None, "--host-memory-budget", help="pinned host memory offload may fill per device, "
                            "e.g. 64GiB (default: the hardware's host_memory_bytes)")
