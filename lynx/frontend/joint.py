"""Trace one stage's joint forward/backward graph with AOTAutograd, each node tagged with its origin.

:func:`trace_joint` runs the stage's captured graph through ``torch._functorch``'s
``_aot_export_function`` (the machinery behind ``aot_export_joint_simple``) with
``trace_joint=True``: parameters, buffers and the stage's inputs become the joint graph's
``primals``, the gradients of its outputs its ``tangents``; it returns the forward outputs
followed by one gradient per primal. The stage graph runs inside
``torch.fx.traceback.preserve_node_meta()`` with every node carrying
``meta["custom"]["lynx_node"]``, so each joint node — backward nodes included — names the
captured node it comes from; the plan's decisions are made on those names.

:func:`classify` partitions it as ``torch._functorch.partitioners.default_partition`` does
(forward nodes, and the *saved* values: forward values a backward node reads) and names the
captured node owning each value's storage; :func:`saved_by_node` is what the profile counts
for a CPU target, and what ``lynx.rewrite.lower`` keeps or drops.

The joint graph depends only on the stage graph and the signature of its inputs (shapes,
dtypes, devices, which need a gradient), not on the plan, so it is cached on the stage graph.

The interpreter that runs the stage graph inside the trace (:class:`GraphRunner`, re-exported
here): :mod:`lynx.frontend.graph_runner`.

Example::

    >>> import torch
    >>> gm = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()),
    ...                          (torch.randn(2, 4),), strict=False).module()
    >>> joint = trace_joint(gm, [torch.randn(2, 4)])
    >>> joint.n_outputs, joint.out_requires_grad, sorted(joint.origin.values())[:2]
    (1, [True], ['gelu', 'gelu'])
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from lynx.errors import LynxError, LynxRuntimeError
from lynx.frontend.graph_runner import GraphRunner, on_profile_device
from lynx.torch_private import (aot_export_joint, all_op_names, has_kernel, is_forward_node, is_op_overload, kept_whole,
                                op_schema, output_aliases_input, tree_flatten)

__all__ = ["JointGraph", "JointParts", "GraphRunner", "trace_joint", "signature_of", "is_view_op", "fetch_attr",
           "classify", "owners_of", "storage_root", "storage_nbytes", "saved_by_node", "generated_ops", "profile_saved",
           "input_saver", "on_profile_device", "keep_whole", "passed_through"]


@dataclass
class JointGraph:
    """A stage's joint forward/backward graph and how its inputs and outputs line up."""

    gm: fx.GraphModule
    attr_names: list[str]          # get_attr targets, in the order of the first primals
    n_inputs: int                  # stage inputs (model inputs + received) after the attributes
    n_outputs: int                 # forward outputs (flattened stage outputs)
    out_requires_grad: list[bool]  # which forward outputs take a tangent
    cloned_outputs: list[int]      # outputs aliasing an input or another output: cloned in the trace
    origin: dict[str, str]         # joint node name -> captured node it comes from


def signature_of(args: Any) -> tuple:
    """What a joint graph depends on: per input its shape, dtype, device and whether it needs a grad."""
    return tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else ("obj", a)
                 for a in args)


def is_view_op(target: Any) -> bool:
    """Whether ``target`` returns a view of its first input (the result shares its storage)."""
    if not is_op_overload(target):
        return False
    returns = op_schema(target).returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def trace_joint(stage_gm: fx.GraphModule, args: list[Any], attrs: dict[str, torch.Tensor] | None = None, *,
                tp: Any = None, reuse: Callable[[fx.GraphModule, list[Any]], JointGraph | None] | None = None
                ) -> JointGraph:
    """The joint graph of ``stage_gm`` on inputs like ``args`` (cached per input signature).

    ``attrs`` replaces the graph's parameters and buffers by name (e.g. fake tensors while
    profiling a model that lives on the meta device, or a tensor-parallel rank's local shards);
    traces with ``attrs`` are cached only with ``tp``. ``reuse`` may give an earlier trace to take
    instead of tracing (a one-stage pipeline's stage takes the profile's where it is provably the
    same: :func:`lynx.frontend.joint_reuse.reusable`, passed by the stage). ``tp`` (a
    :class:`lynx.frontend.joint_tp.TPContext`) runs the graph tensor-parallel: the primals are
    this rank's shards and the joint graph holds the TP collectives.
    """
    if attrs is not None and tp is None:
        return _trace(stage_gm, args, attrs)
    key = (signature_of(args), None if tp is None else tp.key)
    cache = stage_gm.meta.setdefault("lynx_joint", {})
    if key not in cache:
        reused = reuse(stage_gm, args) if reuse is not None and tp is None and attrs is None else None
        cache[key] = reused if reused is not None else _trace(stage_gm, args, attrs, tp)
    return cache[key]


def _trace(stage_gm: fx.GraphModule, args: list[Any], override: dict[str, torch.Tensor] | None = None,
           tp: Any = None) -> JointGraph:
    for node in stage_gm.graph.nodes:
        node.meta.setdefault("custom", {})["lynx_node"] = node.meta.get("lynx_name", node.name)
    attr_names = list(dict.fromkeys(n.target for n in stage_gm.graph.nodes if n.op == "get_attr"
                                    and isinstance(fetch_attr(stage_gm, n.target), torch.Tensor)))
    attrs = [override[name] if override is not None else fetch_attr(stage_gm, name) for name in attr_names]
    flat = [*attrs, *args]

    def export(clone: frozenset[int]) -> tuple[fx.GraphModule, Any]:
        def stage_fn(*primals: Any) -> tuple:
            env = dict(zip(attr_names, primals[:len(attr_names)]))
            with fx.traceback.preserve_node_meta():
                if tp is not None:
                    return tp.runner(stage_gm, env, clone).run(*primals[len(attr_names):])
                return GraphRunner(stage_gm, env, clone, override is not None).run(*primals[len(attr_names):])

        with _quiet(), _eager_kernels():
            return aot_export_joint(stage_fn, tuple(flat), num_params_buffers=len(attr_names))

    try:
        # a value sent as well as viewed, or an input passed through: send a copy. An input or
        # attribute returned as it is aliases it whatever the graph does (passed_through): those
        # are cloned in the first trace; any other aliasing output found costs a second one
        passed = passed_through(stage_gm, args) if tp is None else frozenset()
        gm, meta = export(passed)
        aliased = passed | frozenset(i for i, o in enumerate(meta.output_info) if output_aliases_input(o))
        if aliased != passed:
            gm, meta = export(aliased)
    except LynxError:
        raise
    except Exception as err:  # noqa: BLE001 - torch raises many kinds here; say what failed
        raise LynxRuntimeError(
            f"could not trace the joint forward/backward graph of this stage with AOTAutograd: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. The stage graph must be "
            "functional (no in-place updates of parameters, buffers or inputs, e.g. BatchNorm running "
            "statistics) and have static shapes.") from err
    mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata]
    if mutated:
        names = [attr_names[i] if i < len(attr_names) else f"input {i - len(attr_names)}" for i in mutated]
        raise LynxRuntimeError(f"the stage updates {names} in place; Lynx lowers functional stages only "
                               "(put the model in a mode without buffer updates, or keep those layers out)")
    origin = {n.name: n.meta["custom"]["lynx_node"] for n in gm.graph.nodes
              if isinstance(n.meta.get("custom"), dict) and "lynx_node" in n.meta["custom"]}
    return JointGraph(gm=gm, attr_names=attr_names, n_inputs=len(args), n_outputs=len(meta.output_info),
                      out_requires_grad=[bool(o.requires_grad) for o in meta.output_info],
                      cloned_outputs=sorted(aliased), origin=origin)


def passed_through(stage_gm: fx.GraphModule, args: list[Any]) -> frozenset[int]:
    """The flat outputs of ``stage_gm`` that are one of its tensor inputs or attributes itself:
    AOTAutograd reports each as aliasing an input (``is_input``), so they are cloned in any case.

    Only these are known before tracing; a view of an input, or of another output, is found by
    the trace (:func:`trace_joint` traces again then)."""
    placeholders = [n for n in stage_gm.graph.nodes if n.op == "placeholder"]
    tensors = {n for n, a in zip(placeholders, args) if isinstance(a, torch.Tensor)}
    tensors |= {n for n in stage_gm.graph.nodes if n.op == "get_attr"
                and isinstance(fetch_attr(stage_gm, n.target), torch.Tensor)}
    out = next(n for n in reversed(stage_gm.graph.nodes) if n.op == "output")
    flat, _ = tree_flatten(out.args[0])
    return frozenset(i for i, v in enumerate(flat) if isinstance(v, fx.Node) and v in tensors)


@dataclass(frozen=True)
class JointParts:
    """A joint graph's nodes by role, as ``default_partition`` sees them (see :func:`classify`)."""

    nodes: list[fx.Node]               # every node, in graph order
    primals: list[fx.Node]             # parameters and buffers, then the stage's inputs
    tangents: list[fx.Node]            # incoming gradients of the forward outputs
    fw_outs: list[fx.Node]             # forward outputs (the stage's flattened outputs)
    grads: list[fx.Node | None]        # one gradient per primal (None: it needs none)
    forward: set[fx.Node]              # the forward nodes
    owner: dict[fx.Node, str | None]   # captured node owning each forward value's storage
    saved: list[fx.Node]               # forward values a backward node reads


def classify(joint: JointGraph) -> JointParts:
    """The joint graph's nodes, primals, tangents, forward outputs, gradients, forward nodes,
    the owner of each forward value and the saved values (``default_partition``'s choice)."""
    nodes = list(joint.gm.graph.nodes)
    primals = [n for n in nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    tangents = [n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    outs = list(nodes[-1].args[0])
    fw_outs, grads = outs[:joint.n_outputs], outs[joint.n_outputs:]
    last_forward = max(i for i, n in enumerate(nodes) if is_forward_node(n) or n in primals or n in fw_outs)
    forward = {n for n in nodes[:last_forward + 1] if n.op != "output" and n not in tangents}
    owner = owners_of(nodes, forward, joint, primals)

    def is_multi(n: fx.Node) -> bool:
        return bool(n.users) and all(u.target is operator.getitem for u in n.users)

    saved = [n for n in nodes if n in forward and not is_multi(n)
             and any(u not in forward and u.op != "output" for u in n.users)]
    return JointParts(nodes=nodes, primals=primals, tangents=tangents, fw_outs=fw_outs, grads=grads, forward=forward,
                      owner=owner, saved=saved)


def input_saver(joint: JointGraph, root: fx.Node, forward: set[fx.Node]) -> str | None:
    """The captured node a saved model input is attributed to: of the nodes whose backward reads
    it, the first in forward order (the profile's rule: the node that first saved it)."""
    readers = {joint.origin[u.name] for v in _aliases(root) for u in v.users
               if u not in forward and u.name in joint.origin}
    if not readers:
        return None
    first: dict[str, int] = {}
    for i, n in enumerate(joint.gm.graph.nodes):
        name = joint.origin.get(n.name)
        if n in forward and name is not None:
            first.setdefault(name, i)
    return min(readers, key=lambda r: first.get(r, 1 << 30))


def _aliases(root: fx.Node) -> list[fx.Node]:
    """``root`` and every value viewing its storage."""
    out, stack = [], [root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(u for u in n.users if storage_root(u) is root and u not in out)
    return out


def saved_by_node(joint: JointGraph, order: dict[str, int]) -> dict[str, tuple[int, bool, list[str], int]]:
    """What the lowered stage keeps per captured node when nothing is dropped.

    Per owner: the bytes of the distinct storages its saved values live in (parameters and
    buffers never count; a saved model input counts on :func:`input_saver`), whether one of
    them is the node's output (a consumer saved it), the captured nodes whose backward reads
    that output, in ``order`` (captured node name -> position), and the bytes of the output's
    storages among the first figure. This is the profile's record for the compiled executor:
    what :func:`lynx.rewrite.lower.lower` keeps and drops is exactly what it counted.
    """
    parts = classify(joint)
    nodes, primals, fw_outs, forward, owner, saved = (parts.nodes, parts.primals, parts.fw_outs, parts.forward,
                                                      parts.owner, parts.saved)
    origin = joint.origin
    attrs = set(primals[:len(joint.attr_names)])
    # storages each captured node hands on: values read by another node's forward, or returned
    out_roots: dict[str, set[fx.Node]] = {}
    for m in nodes:
        name = origin.get(m.name)
        if m in forward and name and (m in fw_outs or any(
                u in forward and origin.get(u.name) not in (None, name) for u in m.users)):
            out_roots.setdefault(name, set()).add(storage_root(m))
    readers: dict[fx.Node, set[str]] = {}
    for n in saved:
        readers.setdefault(storage_root(n), set()).update(
            origin[u.name] for u in n.users if u not in forward and u.name in origin)
    result: dict[str, tuple[int, bool, list[str], int]] = {}
    for root, who in readers.items():
        if root.op == "placeholder":
            name = None if root in attrs else input_saver(joint, root, forward)
        else:
            name = owner.get(root)
        if name is None:
            continue
        nbytes, out_saved, savers, out_bytes = result.get(name, (0, False, [], 0))
        nbytes += storage_nbytes(root)
        if root in out_roots.get(name, ()):
            out_saved = True
            out_bytes += storage_nbytes(root)
            savers = sorted(set(savers) | who, key=lambda r: order.get(r, 0))
        result[name] = (nbytes, out_saved, savers, out_bytes)
    return result


def generated_ops(joint: JointGraph) -> dict[str, tuple[int, int]]:
    """Per captured node, the ops its forward and its backward run in the generated graphs.

    Every ``call_function`` of the joint graph the node owns counts once, views included (each
    is a dispatched call in the generated code); ``getitem`` unpacking does not. A captured node
    absent from the result runs nothing (e.g. a ``detach`` AOTAutograd folded away)."""
    forward = classify(joint).forward
    counts: dict[str, tuple[int, int]] = {}
    for n in joint.gm.graph.nodes:
        name = joint.origin.get(n.name)
        if n.op != "call_function" or n.target is operator.getitem or name is None:
            continue
        fwd, bwd = counts.get(name, (0, 0))
        counts[name] = (fwd + 1, bwd) if n in forward else (fwd, bwd + 1)
    return counts


def profile_saved(gm: fx.GraphModule, attrs: dict[str, torch.Tensor],
                  inputs: list[Any]) -> tuple[dict, dict[str, tuple[int, int]]]:
    """:func:`saved_by_node` and :func:`generated_ops` for a whole captured graph on the given
    (possibly fake) tensors.

    A stage of the pipeline keeps the same per node (a stage's graph is a slice of this one;
    what it sends is counted on the producer, as here) and runs the same ops."""
    joint = trace_joint(gm, list(inputs), attrs=attrs)
    return saved_by_node(joint, {n.name: i for i, n in enumerate(gm.graph.nodes)}), generated_ops(joint)


def owners_of(nodes: list[fx.Node], forward: set[fx.Node], joint: JointGraph,
            primals: list[fx.Node]) -> dict[fx.Node, str | None]:
    """Captured node owning each forward value's storage (``None``: a primal or unknown)."""
    owner: dict[fx.Node, str | None] = {}
    for n in nodes:
        if n not in forward:
            continue
        if n.op == "placeholder":
            owner[n] = None
        elif n.target is operator.getitem or is_view_op(n.target):
            base = n.args[0]
            owner[n] = owner.get(base) if isinstance(base, fx.Node) else None
            if n.target is operator.getitem and owner[n] is None:
                owner[n] = joint.origin.get(n.name)
        else:
            owner[n] = joint.origin.get(n.name)
            if owner[n] is None:  # glue the tracer added: it belongs with what it reads
                owner[n] = next((owner[a] for a in n.all_input_nodes if owner.get(a)), None)
    return owner


def storage_root(n: fx.Node) -> fx.Node:
    """The node whose result owns ``n``'s storage (through views, and pieces of split-like views)."""
    while n.op == "call_function":
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and is_view_op(n.args[0].target):
            n = n.args[0]
        if n.op == "call_function" and is_view_op(n.target) and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        else:
            break
    return n


def storage_nbytes(n: fx.Node) -> int:
    """Bytes of the storage ``n``'s value lives in; for a primal (a parameter, buffer or input),
    at most those of the value itself: a microbatch handed to a stage may be a slice of the
    caller's batch, whose storage is the caller's (and the same for every microbatch)."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    own = val.numel() * val.element_size()
    try:
        nbytes = int(val.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - fake storages of some tensor subclasses cannot say
        return own
    return min(nbytes, own) if n.op == "placeholder" else nbytes


def keep_whole(name: str, has: Any = None) -> bool:
    """Whether the joint trace keeps op ``name`` (``"aten::silu_backward"``) whole: a backward
    formula with a device kernel beside its composite (see :func:`_kernel_and_composite_ops`).
    ``has(name, key)`` says whether the op has a kernel for a dispatch key (torch's, by default)."""
    has = has or has_kernel
    return (name.startswith("aten::") and "_backward" in name and has(name, "CompositeImplicitAutograd")
            and (has(name, "CPU") or has(name, "CUDA")))


@functools.lru_cache(maxsize=1)
def _kernel_and_composite_ops() -> tuple:
    """Ops with a backend kernel *and* a CompositeImplicitAutograd one (e.g. ``silu_backward``).

    Eager autograd calls such an op below the autograd key and gets the backend kernel;
    tracing decomposes it into the composite's ops, whose float results differ. Keeping them
    whole in the joint graph keeps gradients bitwise equal to eager's.

    Backward formulas only (``*_backward*``): a forward op kept whole carries no derivative
    (torch.export puts ``autograd_not_implemented`` on it), so the gradient stops there without
    a word, and eager decomposes a forward composite anyway (its autograd key is the
    composite). A CUDA build has such ops (``rms_norm``): kept whole, a Llama's layers got no
    gradient on the H200.
    """
    ops = []
    for name in all_op_names():
        if keep_whole(name):
            packet = getattr(torch.ops.aten, name.split("::", 1)[1].split(".")[0], None)
            overload = getattr(packet, "default", None)
            if overload is not None:
                ops.append(overload)
    return tuple(ops)


@contextlib.contextmanager
def _eager_kernels():
    with kept_whole(_kernel_and_composite_ops()):
        yield


@contextlib.contextmanager
def _quiet():
    from lynx.frontend.capture import quiet_torch

    with quiet_torch():
        yield
