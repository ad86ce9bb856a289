"""The stage-planning problem: what every solver reads and what every solver returns.

A :class:`StageProblem` describes one pipeline stage: its nodes (what each saves for backward,
how long it takes to re-run, what it reads), the communication windows in which the stage
would otherwise sit idle, how many microbatches are in flight at the memory peak, and the
activation budget. A solver returns an :class:`Assignment` (which nodes to drop and recompute,
and for each recomputed node and microbatch the window it is recomputed in — absent means on
demand, on the critical path) inside a :class:`SolveResult`.

The accounting functions (:func:`~lynx.solvers.memory.peak_activation_bytes`,
:func:`exposed_recompute_s` here, :func:`~lynx.solvers.validate.validate`)
are the single definition of memory, exposed time and validity that the solvers optimise and
the simulator reuses.

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

    >>> from lynx.solvers.problem import Assignment
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.memory import peak_activation_bytes
    >>> p = make_uniform_problem(layers=2, microbatches=4, in_flight=2)
    >>> keep_all = Assignment(recompute=frozenset(), window_of={})
    >>> peak_activation_bytes(p, keep_all) == 2 * sum(n.saved_bytes for n in p.nodes)
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lynx.errors import LynxPlanError
from lynx.planner.schedule import Op
from lynx.planner.windows import WindowId, as_window_id
from lynx.solvers.copies import StageCopies

__all__ = [
    "ProblemNode",
    "ProblemWindow",
    "StageProblem",
    "Assignment",
    "SolveResult",
    "exposed_recompute_s",
    "defers_weights",
    "group_key",
    "group_ranks",
    "MicrobatchClass",
    "microbatch_classes",
    "is_sent",
    "savers_of",
    "consumers_of",
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
    # in-stage nodes whose backward reads this node's output (the profile's output_saved_by);
    # None: unknown, every in-stage consumer is assumed to (the memory model's safe side)
    saved_by: tuple[str, ...] | None = None
    # of saved_bytes, the output's storage (read by ``saved_by``); the rest is read by the
    # node's own backward. None: unknown, all of it is held as long as any of it is needed
    output_bytes: int | None = None
    # its output (or a view of it) goes to a later stage: the stage holds it until the
    # microbatch's backward ends, so a saved output stays whatever the plan says
    sent: bool = False
    # its backward issues a tensor-parallel all-reduce (a column-parallel linear's input
    # gradient): a TP window's recomputation runs right after it (lynx.rewrite.tp_windows)
    tp_collective: bool = False
    # the model chunk (pipeline position) the node runs in: a device runs several under
    # interleaved schedules, each holding its own microbatches (lynx.solvers.memory_replay)
    chunk: int = 0
    # zero bubble: whether the input-gradient part ``I`` and the weight-gradient part ``W`` of the
    # chunk's split backward read the saved output, and the rest (lynx.frontend.joint_weights);
    # None: unknown, both may
    output_reads: tuple[bool, bool] | None = None
    rest_reads: tuple[bool, bool] | None = None
    # a view (no storage of its own): the in-chunk node whose output storage it is. The runtime
    # counts a value on its storage's producer (lynx.rewrite.lower), so a part that re-runs a
    # consumer of the view reads that node's output, whatever the plan says of the view
    view_of: str | None = None


@dataclass(frozen=True)
class ProblemWindow:
    id: WindowId  # e.g. s0.recv_grad.mb3, s1.tp.l5.b.mb0, s0.dp.b2 (a plan's string is parsed)
    kind: str  # recv_grad | recv_act | tp_allreduce | dp_collective
    microbatch: int  # recompute placed here serves this microbatch's backward
    capacity_s: float  # idle seconds available
    # None: any node of the stage; else only nodes of these layers (tp/dp windows inside a
    # backward can only serve layers not yet backpropagated)
    eligible_layers: tuple[int, ...] | None

    def __post_init__(self) -> None:
        if not isinstance(self.id, WindowId):
            object.__setattr__(self, "id", as_window_id(self.id))


@dataclass(frozen=True)
class StageProblem:
    stage: int
    nodes: tuple[ProblemNode, ...]  # forward topological order
    windows: tuple[ProblemWindow, ...]  # time order
    microbatches: int  # m
    # microbatches whose kept activations are live at peak (1F1B: min(p-s, m); GPipe: m)
    in_flight: int
    # per-device budget minus static memory (weights, grads, optimizer state) and minus
    # ``in_flight · sent_bytes``: what the plan's saved activations may use
    activation_budget_bytes: int
    # per microbatch, bytes the stage sends that no stage saves (an attention mask, say): held
    # until the microbatch's backward ends whatever the plan; the simulator adds
    # ``in_flight · sent_bytes`` to the plan's activation peak
    sent_bytes: int = 0
    # offload to host memory allowed (``offload=True``): the stage's copy lanes, prefetch slots
    # and host budget (lynx.solvers.copies); None: keep and recompute only
    copies: StageCopies | None = None
    # the stage runs its backwards in microbatch order, one model chunk per device (1F1B,
    # GPipe): at B(j) at most m − 1 − j other microbatches are in flight (the cool-down)
    backward_in_order: bool = False
    # the device's action list (lynx.planner.schedule.rank_actions): what the memory model
    # replays, per chunk and microbatch (lynx.solvers.memory_replay); empty: the closed form
    # ``others(j) · held + own(j)`` with ``in_flight``
    actions: tuple = ()


@dataclass(frozen=True)
class Assignment:
    recompute: frozenset[str]  # nodes whose saved tensors are dropped in forward
    # (node, microbatch) -> window id; absent = on demand
    window_of: Mapping[tuple[str, int], WindowId] = field(default_factory=dict)
    # nodes whose saved tensors are copied to host memory after their forward and back before
    # their backward (never also recomputed); see lynx.solvers.copies
    offload: frozenset[str] = frozenset()
    # (offloaded node, microbatch) -> the window its prefetch is issued in; absent = streamed
    # during the backward, one group ahead of its first reader
    prefetch_of: Mapping[tuple[str, int], WindowId] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Own copies, so a caller mutating its dict cannot change a scored assignment.
        object.__setattr__(self, "recompute", frozenset(self.recompute))
        object.__setattr__(self, "offload", frozenset(self.offload))
        for name in ("window_of", "prefetch_of"):
            placed = dict(getattr(self, name))
            if any(not isinstance(w, WindowId) for w in placed.values()):   # a plan's strings
                placed = {k: as_window_id(w) for k, w in placed.items()}
            object.__setattr__(self, name, placed)

    @property
    def dropped(self) -> frozenset[str]:
        """Nodes whose saved tensors leave the device after the forward: recomputed or offloaded."""
        return self.recompute | self.offload if self.offload else self.recompute

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Assignment):
            return NotImplemented
        return (self.recompute == other.recompute and dict(self.window_of) == dict(other.window_of)
                and self.offload == other.offload and dict(self.prefetch_of) == dict(other.prefetch_of))

    def __hash__(self) -> int:
        return hash((self.recompute, frozenset(self.window_of.items()), self.offload,
                     frozenset(self.prefetch_of.items())))


@dataclass(frozen=True)
class SolveResult:
    assignment: Assignment
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC | INFEASIBLE
    # the solver's own estimate of exposed recompute (never trusted; the simulator re-scores)
    objective_s: float
    gap: float | None  # relative optimality gap when known
    search_time_s: float
    # with offload: the plan without offload the solver also found (the planner scores it on the
    # whole pipeline as well: a stage's objective cannot see that a backward that copies or
    # recomputes on demand runs whole, its input gradients sent only after its weight part)
    without_offload: SolveResult | None = None


# --------------------------------------------------------------------------- groups and classes


def group_key(node: ProblemNode) -> str:
    """The unit regenerated at once in backward: a repeated layer, or an edge block."""
    return f"layer{node.layer}" if node.layer is not None else f"edge:{node.layer_class}"


_RANKS: dict[int, tuple[tuple, dict[str, int]]] = {}


def group_ranks(problem: StageProblem) -> dict[str, int]:
    """Forward rank of each group; on-demand regeneration runs in decreasing rank. Cached per
    node tuple (the solvers ask for it many times per stage): callers must not change it."""
    key = id(problem.nodes)
    found = _RANKS.get(key)
    if found is not None and found[0] is problem.nodes:
        return found[1]
    ranks: dict[str, int] = {}
    for n in problem.nodes:
        ranks.setdefault(group_key(n), len(ranks))
    if len(_RANKS) > 256:
        _RANKS.clear()
    _RANKS[key] = (problem.nodes, ranks)
    return ranks


@dataclass(frozen=True)
class MicrobatchClass:
    """Microbatches whose windows are identical (kinds, capacities, eligibility, order).

    They have the same optimal placement, so solvers decide once per class. ``window_ids[k]``
    holds, for window position k, the id of that window for each member (aligned with
    ``members``).
    """

    members: tuple[int, ...]
    window_ids: tuple[tuple[WindowId, ...], ...]
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
    # Capacities equal up to rounding noise (replayed timelines differ in the last bits) are
    # one class, with the smallest capacity of its members: otherwise identical microbatches
    # would be decided apart, multiplying the solver's variables and symmetric solutions.
    groups: list[tuple[tuple, list[float], list[int]]] = []  # (kinds+eligibility, capacities, members)
    for mb, ws in per_mb.items():
        shape = tuple((w.kind, w.eligible_layers) for w in ws)
        caps = [w.capacity_s for w in ws]
        for g_shape, g_caps, g_members in groups:
            if g_shape == shape and all(_same_capacity(a, b) for a, b in zip(g_caps, caps)):
                g_members.append(mb)
                g_caps[:] = [min(a, b) for a, b in zip(g_caps, caps)]
                break
        else:
            groups.append((shape, caps, [mb]))
    classes = []
    for shape, caps, members in groups:
        ids = tuple(tuple(per_mb[mb][k].id for mb in members) for k in range(len(shape)))
        classes.append(
            MicrobatchClass(
                members=tuple(members),
                window_ids=ids,
                capacities=tuple(caps),
                eligible_layers=tuple(sig[1] for sig in shape),
            )
        )
    return classes


def _same_capacity(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-15


def defers_weights(problem: StageProblem) -> bool:
    """Whether the device's backwards are split (zero bubble): an input-gradient part ``I`` and
    a deferred weight-gradient part ``W``, each regenerating what it reads on demand."""
    return any(a.op is Op.BACKWARD_WEIGHT for a in problem.actions)


def exposed_recompute_s(problem: StageProblem, assignment: Assignment, *, on_demand: bool = True) -> float:
    """Σ on-demand recompute over microbatches + Σ window overflow beyond capacity; each
    on-demand node once (a split backward's parts, each re-running what it needs:
    :func:`lynx.solvers.exposed.exposed_recompute_s`). ``on_demand=False``: the overflow alone."""
    cost = {n.name: n.recompute_s for n in problem.nodes}
    exposed = 0.0
    load = {w.id: 0.0 for w in problem.windows}
    placed = assignment.window_of.get
    microbatches = range(problem.microbatches)
    for name in assignment.recompute:
        seconds = cost.get(name, 0.0)
        for mb in microbatches:
            window = placed((name, mb))
            if window is None:
                exposed += seconds if on_demand else 0.0
            else:
                load[window] = load.get(window, 0.0) + seconds
    capacity = {w.id: w.capacity_s for w in problem.windows}
    for window, used in load.items():
        exposed += max(0.0, used - capacity.get(window, 0.0))
    return exposed


# --------------------------------------------------------------------------- who reads what


def is_sent(node: ProblemNode) -> bool:
    """Its saved output goes to a later stage: dropping it frees nothing on this stage.

    The stage holds its outputs until the microbatch's backward is done (they are the roots
    of that backward), so these bytes stay. Known from ``node.sent``, or, where the problem
    does not say, from a saved output no in-stage node saves (a later stage does).
    """
    return node.output_saved and (node.sent or node.saved_by is not None and not node.saved_by)


def savers_of(problem: StageProblem) -> dict[str, tuple[str, ...]]:
    """In-stage nodes whose backward reads each node's output (every consumer when unknown)."""
    names = {n.name for n in problem.nodes}
    consumers = consumers_of(problem)
    out = {}
    for n in problem.nodes:
        known = n.saved_by
        out[n.name] = tuple(consumers[n.name]) if known is None else tuple(s for s in known if s in names)
    return out


def consumers_of(problem: StageProblem) -> dict[str, list[str]]:
    """In-stage nodes reading each node's output."""
    out: dict[str, list[str]] = {n.name: [] for n in problem.nodes}
    for n in problem.nodes:
        for src in n.inputs:
            if src in out:
                out[src].append(n.name)
    return out
