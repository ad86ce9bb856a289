"""The stage-planning problem: what every solver reads and what every solver returns.

A :class:`StageProblem` describes one pipeline stage: its nodes (what each saves for backward,
how long it takes to re-run, what it reads), the communication windows in which the stage
would otherwise sit idle, how many microbatches are in flight at the memory peak, and the
activation budget. A solver returns an :class:`Assignment` (which nodes to drop and recompute,
and for each recomputed node and microbatch the window it is recomputed in — absent means on
demand, on the critical path) inside a :class:`SolveResult`.

The accounting functions here (:func:`peak_activation_bytes`, :func:`exposed_recompute_s`,
:func:`validate`) are the single definition of memory, exposed time and validity that the
solvers optimise and the simulator reuses.

Conventions the solvers rely on:

* ``problem.nodes`` is in forward topological order; ``problem.windows`` is in time order
  (a window listed earlier runs earlier). Recomputing "on demand" for microbatch j happens
  during the backward of j, after every window of j, one group (layer or edge block) at a
  time in backward order: the last group of the forward is regenerated first. So an
  on-demand node may read an on-demand input of its own group, but not one of an earlier
  group (that one is regenerated only later): such an input must be kept or prefetched.
* The solvers also keep an output that is not a saved tensor (``output_saved=False``) from
  living across windows, since no byte count covers it: such a node is recomputed in the
  same window as (or on demand with) its recomputed consumers. Zero-cost views are exempt.
* A window with ``eligible_layers`` set serves only nodes of those layers; edge-block nodes
  (``layer is None``) are eligible only for windows with ``eligible_layers=None``.

Example::

    >>> from lynx.solvers.problem import Assignment, make_uniform_problem, peak_activation_bytes
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2)
    >>> keep_all = Assignment(recompute=frozenset(), window_of={})
    >>> peak_activation_bytes(p, keep_all) == 2 * sum(n.saved_bytes for n in p.nodes)
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lynx.errors import LynxPlanError

__all__ = [
    "ProblemNode",
    "ProblemWindow",
    "StageProblem",
    "Assignment",
    "SolveResult",
    "peak_activation_bytes",
    "kept_bytes",
    "prefetched_bytes",
    "on_demand_transient_bytes",
    "exposed_recompute_s",
    "validate",
    "required_recompute_closure",
    "group_key",
    "group_ranks",
    "MicrobatchClass",
    "microbatch_classes",
    "make_uniform_problem",
]

STATUSES = ("OPTIMAL", "FEASIBLE", "HEURISTIC", "INFEASIBLE")


@dataclass(frozen=True)
class ProblemNode:
    name: str  # fx node name (graph node id)
    saved_bytes: int  # bytes autograd saves attributed to this node, per microbatch
    output_saved: bool  # keeping the node keeps its output available for recomputation
    recompute_s: float  # time to re-run its forward (graph attr forward_s)
    inputs: tuple[str, ...]  # in-stage producer nodes; anything else is always available
    layer: int | None  # repeated-layer index, None for edge blocks
    layer_class: str  # e.g. "GPTBlock" or "pre"/"post"
    core_attention: bool  # for the `selective` baseline


@dataclass(frozen=True)
class ProblemWindow:
    id: str  # e.g. "s0.recv_grad.mb3", "s1.tp.l5.b.mb0", "s0.dp.b2"
    kind: str  # recv_grad | recv_act | tp_allreduce | dp_collective
    microbatch: int  # recompute placed here serves this microbatch's backward
    capacity_s: float  # idle seconds available
    # None: any node of the stage; else only nodes of these layers (tp/dp windows inside a
    # backward can only serve layers not yet backpropagated)
    eligible_layers: tuple[int, ...] | None


@dataclass(frozen=True)
class StageProblem:
    stage: int
    nodes: tuple[ProblemNode, ...]  # forward topological order
    windows: tuple[ProblemWindow, ...]  # time order
    microbatches: int  # m
    # microbatches whose kept activations are live at peak (1F1B: min(p-s, m); GPipe: m)
    in_flight: int
    # per-device budget minus static memory (weights, grads, optimizer state)
    activation_budget_bytes: int


@dataclass(frozen=True)
class Assignment:
    recompute: frozenset[str]  # nodes whose saved tensors are dropped in forward
    # (node, microbatch) -> window id; absent = on demand
    window_of: Mapping[tuple[str, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Own copies, so a caller mutating its dict cannot change a scored assignment.
        object.__setattr__(self, "recompute", frozenset(self.recompute))
        object.__setattr__(self, "window_of", dict(self.window_of))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Assignment):
            return NotImplemented
        return self.recompute == other.recompute and dict(self.window_of) == dict(other.window_of)

    def __hash__(self) -> int:
        return hash((self.recompute, frozenset(self.window_of.items())))


@dataclass(frozen=True)
class SolveResult:
    assignment: Assignment
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC | INFEASIBLE
    # the solver's own estimate of exposed recompute (never trusted; the simulator re-scores)
    objective_s: float
    gap: float | None  # relative optimality gap when known
    search_time_s: float


# --------------------------------------------------------------------------- accounting


def group_key(node: ProblemNode) -> str:
    """The unit regenerated at once in backward: a repeated layer, or an edge block."""
    return f"layer{node.layer}" if node.layer is not None else f"edge:{node.layer_class}"


def group_ranks(problem: StageProblem) -> dict[str, int]:
    """Forward rank of each group; on-demand regeneration runs in decreasing rank."""
    ranks: dict[str, int] = {}
    for n in problem.nodes:
        ranks.setdefault(group_key(n), len(ranks))
    return ranks


@dataclass(frozen=True)
class MicrobatchClass:
    """Microbatches whose windows are identical (kinds, capacities, eligibility, order).

    They have the same optimal placement, so solvers decide once per class. ``window_ids[k]``
    holds, for window position k, the id of that window for each member (aligned with
    ``members``).
    """

    members: tuple[int, ...]
    window_ids: tuple[tuple[str, ...], ...]
    capacities: tuple[float, ...]
    eligible_layers: tuple[tuple[int, ...] | None, ...]


def microbatch_classes(problem: StageProblem) -> list[MicrobatchClass]:
    """Group microbatches by their window signature, in order of first member."""
    per_mb: dict[int, list[ProblemWindow]] = {mb: [] for mb in range(problem.microbatches)}
    for w in problem.windows:
        if w.microbatch not in per_mb:
            raise LynxPlanError(
                f"stage {problem.stage}: window {w.id!r} serves microbatch {w.microbatch}, "
                f"but the stage has {problem.microbatches} microbatches"
            )
        per_mb[w.microbatch].append(w)
    groups: dict[tuple, list[int]] = {}
    for mb, ws in per_mb.items():
        signature = tuple((w.kind, w.capacity_s, w.eligible_layers) for w in ws)
        groups.setdefault(signature, []).append(mb)
    classes = []
    for signature, members in groups.items():
        ids = tuple(tuple(per_mb[mb][k].id for mb in members) for k in range(len(signature)))
        classes.append(
            MicrobatchClass(
                members=tuple(members),
                window_ids=ids,
                capacities=tuple(sig[1] for sig in signature),
                eligible_layers=tuple(sig[2] for sig in signature),
            )
        )
    return classes


def kept_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """Bytes one microbatch keeps from forward to backward."""
    return sum(n.saved_bytes for n in problem.nodes if n.name not in assignment.recompute)


def prefetched_bytes(problem: StageProblem, assignment: Assignment) -> dict[int, int]:
    """Per microbatch j: bytes recomputed in windows for j (alive from the window to B(j))."""
    size = {n.name: n.saved_bytes for n in problem.nodes}
    out: dict[int, int] = {}
    for (name, mb), _window in assignment.window_of.items():
        out[mb] = out.get(mb, 0) + size.get(name, 0)
    return out


def on_demand_transient_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """Largest per-layer (or edge block) set of on-demand regenerated bytes, any microbatch."""
    best = 0
    for mb in range(problem.microbatches):
        per_group: dict[str, int] = {}
        for n in problem.nodes:
            if n.name in assignment.recompute and (n.name, mb) not in assignment.window_of:
                key = group_key(n)
                per_group[key] = per_group.get(key, 0) + n.saved_bytes
        if per_group:
            best = max(best, max(per_group.values()))
    return best


def peak_activation_bytes(problem: StageProblem, assignment: Assignment) -> int:
    """in_flight · kept + max_j prefetched(j) + on-demand transient (see module docstring)."""
    prefetched = prefetched_bytes(problem, assignment)
    return (
        problem.in_flight * kept_bytes(problem, assignment)
        + max(prefetched.values(), default=0)
        + on_demand_transient_bytes(problem, assignment)
    )


def exposed_recompute_s(problem: StageProblem, assignment: Assignment) -> float:
    """Σ on-demand recompute over microbatches + Σ window overflow beyond capacity."""
    cost = {n.name: n.recompute_s for n in problem.nodes}
    exposed = 0.0
    load = {w.id: 0.0 for w in problem.windows}
    for name in assignment.recompute:
        for mb in range(problem.microbatches):
            window = assignment.window_of.get((name, mb))
            if window is None:
                exposed += cost.get(name, 0.0)
            else:
                load[window] = load.get(window, 0.0) + cost.get(name, 0.0)
    capacity = {w.id: w.capacity_s for w in problem.windows}
    for window, used in load.items():
        exposed += max(0.0, used - capacity.get(window, 0.0))
    return exposed


# --------------------------------------------------------------------------- validity


def required_recompute_closure(problem: StageProblem, recompute: frozenset[str] | set[str]) -> frozenset[str]:
    """Smallest superset of ``recompute`` in which every recomputed node's inputs are available.

    An in-stage input that is kept but does not keep its output (``output_saved=False``)
    cannot feed a recomputation, so it is recomputed too, transitively.
    """
    by_name = {n.name: n for n in problem.nodes}
    closed = set(recompute)
    stack = list(closed)
    while stack:
        node = by_name.get(stack.pop())
        if node is None:
            continue
        for src in node.inputs:
            producer = by_name.get(src)
            if producer is not None and not producer.output_saved and src not in closed:
                closed.add(src)
                stack.append(src)
    return frozenset(closed)


def validate(problem: StageProblem, assignment: Assignment) -> None:
    """Raise LynxPlanError naming the first rule the assignment breaks (see PROBLEM_SPEC)."""
    by_name = {n.name: n for n in problem.nodes}
    windows = {w.id: (i, w) for i, w in enumerate(problem.windows)}
    where = f"stage {problem.stage}"
    unknown = sorted(assignment.recompute - by_name.keys())
    if unknown:
        raise LynxPlanError(f"{where}: recompute names nodes not in the stage: {unknown[:5]}")
    for (name, mb), wid in assignment.window_of.items():
        if name not in assignment.recompute:
            raise LynxPlanError(f"{where}: node {name!r} is placed in window {wid!r} but is not recomputed")
        if not 0 <= mb < problem.microbatches:
            raise LynxPlanError(f"{where}: node {name!r} placed for microbatch {mb}, stage has {problem.microbatches}")
        if wid not in windows:
            raise LynxPlanError(f"{where}: node {name!r} (microbatch {mb}) placed in unknown window {wid!r}")
        _, window = windows[wid]
        if window.microbatch != mb:
            raise LynxPlanError(
                f"{where}: node {name!r} recomputed for microbatch {mb} in window {wid!r}, "
                f"which serves microbatch {window.microbatch}"
            )
        if not _eligible(by_name[name], window):
            raise LynxPlanError(
                f"{where}: node {name!r} (layer {by_name[name].layer}) is not eligible for window {wid!r} "
                f"(eligible layers {window.eligible_layers})"
            )
    ranks = group_ranks(problem)

    def when(node: ProblemNode, mb: int) -> tuple[int, int]:
        # windows (0, index) precede on-demand (1, -rank): later groups regenerate first
        w = assignment.window_of.get((node.name, mb))
        return (0, windows[w][0]) if w is not None else (1, -ranks[group_key(node)])

    for name in assignment.recompute:
        node = by_name[name]
        for src in node.inputs:
            producer = by_name.get(src)
            if producer is None:
                continue  # outside the stage: always available
            if src not in assignment.recompute:
                if not producer.output_saved:
                    raise LynxPlanError(
                        f"{where}: recomputing {name!r} needs the output of {src!r}, which is kept but does "
                        f"not keep its output (output_saved=False); recompute {src!r} too"
                    )
                continue
            for mb in range(problem.microbatches):
                if when(producer, mb) > when(node, mb):
                    w_src = assignment.window_of.get((src, mb))
                    w_dst = assignment.window_of.get((name, mb))
                    raise LynxPlanError(
                        f"{where}: for microbatch {mb}, {name!r} is recomputed "
                        f"({'on demand, ' + group_key(node) if w_dst is None else 'in ' + w_dst}) before its "
                        f"input {src!r} is ({'on demand, ' + group_key(producer) if w_src is None else w_src}); "
                        f"keep {src!r} or prefetch it earlier"
                    )


def _eligible(node: ProblemNode, window: ProblemWindow) -> bool:
    if window.eligible_layers is None:
        return True
    return node.layer is not None and node.layer in window.eligible_layers


# --------------------------------------------------------------------------- synthetic problems


def make_uniform_problem(
    *,
    layers: int = 4,
    hidden: int = 2048,
    heads: int = 16,
    seq: int = 2048,
    micro_batch: int = 1,
    dtype_bytes: int = 2,
    flops_per_s: float = 200e12,
    bytes_per_s: float = 2e12,
    microbatches: int = 8,
    in_flight: int = 4,
    budget_fraction: float | None = 0.5,
    budget_bytes: int | None = None,
    recv_grad_capacity_s: float | Sequence[float] = 0.0,
    tp_capacity_s: float = 0.0,
    dp_capacity_s: Sequence[float] = (),
    pre: bool = False,
    post: bool = False,
    stage: int = 0,
    layer_class: str = "GPTBlock",
    views: bool = False,
) -> StageProblem:
    """A synthetic stage of ``layers`` identical Megatron-style GPT layers.

    Each layer is the 14-node chain ln1 → qkv → scores → softmax → attn_dropout → attn_v →
    proj → drop1 → add1 → ln2 → fc1 → gelu → fc2 → drop2 → add2, with saved bytes that add
    up to Korthikanti et al.'s ``s·b·h·(34 + 5·a·s/h)`` per layer and recompute times from
    FLOPs (matmuls) or bytes moved (elementwise). Budget: ``budget_bytes`` if given, else
    ``budget_fraction`` of the keep-all peak (``in_flight`` × everything).

    ``views=True`` adds the zero-byte reshapes, transposes and weight transposes an aten
    graph has (29 nodes per layer), as real captured graphs do.

    Windows: one ``recv_grad`` window per microbatch (capacity a scalar or one per
    microbatch; zero-capacity windows are left out), optionally one ``tp_allreduce`` window
    per (microbatch, layer ≥ 1) in the backward of that layer serving layers below it, and
    ``dp_collective`` windows for the last microbatch serving the first layers.
    """
    s, b, h, a = seq, micro_batch, hidden, heads
    # Korthikanti et al.'s coefficients count bytes for a 16-bit dtype (a 1-byte dropout mask
    # is "sbh"); scale them for other widths.
    sbh = s * b * h * dtype_bytes // 2
    as2b = a * s * s * b * dtype_bytes // 2
    mm = lambda k: 2.0 * s * b * h * k * h / flops_per_s  # noqa: E731 — (s·b, h) @ (h, k·h)
    ew = lambda nbytes: nbytes / bytes_per_s  # noqa: E731 — memory-bound elementwise
    attn = 2.0 * 2.0 * s * s * b * h / flops_per_s  # QKᵀ or ·V
    # (name, saved, output_saved, recompute_s, inputs-within-layer (or "IN" for layer input), core)
    chain = [
        ("ln1", 2 * sbh, True, ew(2 * sbh), ("IN",), False),
        ("qkv", 6 * sbh, True, mm(3), ("ln1",), False),
        ("scores", 0, False, attn, ("qkv",), True),
        ("softmax", 2 * as2b, True, ew(2 * as2b), ("scores",), True),
        ("attn_dropout", 3 * as2b, True, ew(3 * as2b), ("softmax",), True),
        ("attn_v", 2 * sbh, True, attn, ("attn_dropout", "qkv"), True),
        ("proj", 0, False, mm(1), ("attn_v",), False),
        ("drop1", 1 * sbh, False, ew(2 * sbh), ("proj",), False),
        ("add1", 2 * sbh, True, ew(3 * sbh), ("drop1", "IN"), False),
        ("ln2", 2 * sbh, True, ew(2 * sbh), ("add1",), False),
        ("fc1", 8 * sbh, True, mm(4), ("ln2",), False),
        ("gelu", 8 * sbh, True, ew(8 * sbh), ("fc1",), False),
        ("fc2", 0, False, mm(4), ("gelu",), False),
        ("drop2", 1 * sbh, False, ew(2 * sbh), ("fc2",), False),
        ("add2", 2 * sbh, True, ew(3 * sbh), ("drop2", "add1"), False),
    ]
    if views:
        chain = _with_views(chain, ew(0), mm(0))
    nodes: list[ProblemNode] = []
    layer_input: str | None = None
    if pre:
        nodes.append(ProblemNode("pre.embed", 2 * sbh, True, ew(2 * sbh), (), None, "pre", False))
        layer_input = "pre.embed"
    for layer in range(layers):
        prefix = f"l{layer}."
        for name, saved, out_saved, cost, ins, core in chain:
            resolved = tuple(
                (layer_input if src == "IN" else prefix + src) for src in ins if not (src == "IN" and layer_input is None)
            )
            nodes.append(ProblemNode(prefix + name, saved, out_saved, cost, resolved, layer, layer_class, core))
        layer_input = prefix + "add2"
    if post:
        post_in = (layer_input,) if layer_input else ()
        vocab = 8 * h
        logits = s * b * vocab * dtype_bytes
        nodes.append(ProblemNode("post.ln", 2 * sbh, True, ew(2 * sbh), post_in, None, "post", False))
        nodes.append(ProblemNode("post.head", 2 * logits, True, mm(8), ("post.ln",), None, "post", False))
    windows: list[ProblemWindow] = []
    caps = [recv_grad_capacity_s] * microbatches if isinstance(recv_grad_capacity_s, (int, float)) else list(recv_grad_capacity_s)
    if len(caps) != microbatches:
        raise ValueError(f"recv_grad_capacity_s has {len(caps)} entries for {microbatches} microbatches")
    for mb in range(microbatches):
        if caps[mb] > 0:
            windows.append(ProblemWindow(f"s{stage}.recv_grad.mb{mb}", "recv_grad", mb, float(caps[mb]), None))
        if tp_capacity_s > 0:
            for layer in reversed(range(1, layers)):  # backward runs from the last layer down
                windows.append(
                    ProblemWindow(f"s{stage}.tp.l{layer}.b.mb{mb}", "tp_allreduce", mb, tp_capacity_s, tuple(range(layer)))
                )
    for i, cap in enumerate(dp_capacity_s):
        last = microbatches - 1
        windows.append(ProblemWindow(f"s{stage}.dp.b{i}", "dp_collective", last, float(cap), tuple(range(max(1, layers - 1 - i)))))
    keep_all = in_flight * sum(n.saved_bytes for n in nodes)
    budget = budget_bytes if budget_bytes is not None else int(keep_all * (budget_fraction if budget_fraction is not None else 1.0))
    return StageProblem(
        stage=stage,
        nodes=tuple(nodes),
        windows=tuple(windows),
        microbatches=microbatches,
        in_flight=in_flight,
        activation_budget_bytes=budget,
    )


def _with_views(chain: list[tuple], view_s: float, _zero: float) -> list[tuple]:
    """Insert aten-style view/transpose nodes (no bytes of their own) into the layer chain."""
    out: list[tuple] = []
    tiny = 1e-7  # launch overhead of a view
    for name, saved, out_saved, cost, ins, core in chain:
        if name in ("qkv", "proj", "fc1", "fc2"):
            out.append((f"{name}_wt", 0, False, tiny, (), False))  # weight transpose
            ins = ins + (f"{name}_wt",)
        if name == "scores":
            ins = ("q_t", "k_t")
        if name == "attn_v":
            ins = ("attn_dropout", "v_t")
        if name == "proj":
            ins = ("ctx_view", f"{name}_wt")
        if name == "softmax":
            out.append(("scale", 0, False, cost / 4, ("scores",), True))
            out.append(("causal_mask", 0, False, cost / 4, ("scale",), True))
            ins = ("causal_mask",)
        out.append((name, saved, out_saved, cost, ins, core))
        if name == "qkv":
            out.append(("qkv_view", 0, False, tiny, ("qkv",), False))
            for t in ("q_t", "k_t", "v_t"):
                out.append((t, 0, False, tiny, ("qkv_view",), False))
        if name == "attn_v":
            out.append(("ctx_t", 0, False, tiny, ("attn_v",), False))
            out.append(("ctx_view", 0, False, tiny, ("ctx_t",), False))
    return out
