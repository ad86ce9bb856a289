"""Profile a captured graph: per node FLOPs, output bytes and the bytes autograd saves.

Activation memory is what autograd *saves* for backward, not every intermediate. The captured
forward runs node by node on fake tensors (nothing is allocated, so a 20B model profiles on a
laptop) inside ``torch.autograd.graph.saved_tensors_hooks``; every saved tensor is attributed
to the node that produced its storage — or, for tensors created inside an op (LayerNorm's
mean and rstd, a dropout mask, a contiguous copy made by matmul), to the node that was running
— and counted once per storage. Parameters and buffers are left out.

A profile describes a **target** device. What autograd saves differs by device: CUDA's fused
dropout saves a 1-byte mask where the CPU (and meta) path saves a tensor of the input's dtype,
and CUDA's flash attention saves no s×s matrix. Fake CUDA tensors cannot run on a CPU-only
torch build, so for a ``cuda`` target the ops in :data:`CUDA_EMULATED_OPS` run as small
autograd functions that save exactly what the CUDA kernels save (:mod:`lynx.frontend.cuda_saves`).

:class:`SaveTracker` is the attribution rule itself; the runtime's pack hook uses the same
class, so what a plan drops is exactly what the profile counted.

Example::

    >>> from lynx.frontend.capture import capture
    >>> from lynx.models import build_preset
    >>> from lynx.frontend.profile import profile
    >>> model, inputs = build_preset("gpt-tiny", device="meta")
    >>> prof = profile(capture(model, inputs), target="cpu")
    >>> prof.target, prof.total_saved_bytes > 0
    ('cpu', True)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from lynx.frontend.capture import Captured, is_op_node, quiet_torch
from lynx.frontend.cuda_saves import CUDA_EMULATED_OPS
from lynx.frontend.joint import on_profile_device
from lynx.errors import LynxConfigError, LynxProfileError
from lynx.torch_private import fake_tensor_mode, tree_flatten, tree_map

__all__ = [
    "NodeProfile",
    "Profile",
    "SaveTracker",
    "CUDA_EMULATED_OPS",
    "storage_key",
    "profile",
]

TARGETS = ("cuda", "cpu")


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (views of one storage share it)."""
    return StorageWeakRef(t.untyped_storage()).cdata


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class SaveTracker:
    """Attributes tensors autograd saves to graph nodes.

    Call :meth:`begin` before a node runs and :meth:`produced` with its outputs after; inside a
    pack hook :meth:`owner` names the node a saved tensor belongs to: the producer of its
    storage, else the node that first saved it (an internal tensor of that op), or ``None`` for
    excluded tensors (parameters and buffers).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = [t for t in exclude]  # held, so their storage keys stay unique
        self._excluded_keys = {storage_key(t) for t in self._excluded}
        # storage key → (weak ref, node); storages die and their addresses are reused, so an
        # entry whose storage expired no longer names anything.
        self._producer: dict[int, tuple[StorageWeakRef, str]] = {}
        self.current: str | None = None

    def begin(self, node_name: str) -> None:
        self.current = node_name

    def _lookup(self, key: int) -> str | None:
        entry = self._producer.get(key)
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def produced(self, node_name: str, outputs: Any) -> None:
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if self._lookup(key) is None:
                    self._producer[key] = (StorageWeakRef(t.untyped_storage()), node_name)

    def owner(self, t: torch.Tensor) -> str | None:
        key = storage_key(t)
        if key in self._excluded_keys:
            return None
        owner = self._lookup(key)
        if owner is None:
            if self.current is None:
                raise RuntimeError("SaveTracker.owner called outside a node; call begin() first")
            self._producer[key] = (StorageWeakRef(t.untyped_storage()), self.current)
            owner = self.current
        return owner


# --- the profile ---------------------------------------------------------------------------


@dataclass
class NodeProfile:
    name: str
    op: str
    module_path: str
    module_stack: list[str]  # module paths outermost → innermost
    inputs: list[str]  # op nodes this node reads
    flops: int
    input_bytes: int  # bytes of tensor arguments (0 for views: nothing is moved)
    output_bytes: int
    is_view: bool
    output_shapes: list[tuple[int, ...]]
    saved_bytes: int = 0  # attributed to this node, de-duplicated by storage
    output_saved: bool = False
    output_saved_bytes: int = 0  # of saved_bytes, the output's storage (what its savers read)
    output_saved_by: list[str] = field(default_factory=list)
    # zero bubble: per part of what it saves ("output", "rest"), the earliest and latest captured
    # node its readers' gradients flow into (lynx.frontend.joint_weights); None: not traced
    backward_reach: dict[str, list] | None = None
    emulated: bool = False
    # ops the generated forward / backward graphs run for it (CPU target; None: not traced)
    forward_ops: int | None = None
    backward_ops: int | None = None


@dataclass
class Profile:
    target: str
    nodes: dict[str, NodeProfile]  # execution order
    input_shapes: list[tuple[int, ...]]
    dtype: str | None
    emulated_ops: list[str]

    @property
    def total_saved_bytes(self) -> int:
        return sum(n.saved_bytes for n in self.nodes.values())

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes.values())


_METADATA_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}


def _module_stack(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(v[0]) for v in stack.values()]
    if node.op == "call_module":
        paths.append(str(node.target))
    return [p for p in paths if p]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class _ProfilingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, target: str, attrs: dict[str, torch.Tensor]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.target_device = target
        self.attrs = attrs
        self.tracker = SaveTracker(attrs.values())
        self.records: dict[str, NodeProfile] = {}
        self.saved: dict[int, tuple[str, int, list[str]]] = {}  # storage → (owner, nbytes, savers)
        self.output_keys: dict[str, set[int]] = {}

    def fetch_attr(self, target: str) -> Any:
        return self.attrs[target] if target in self.attrs else super().fetch_attr(target)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        owner = self.tracker.owner(t)
        if owner is not None:
            current = self.tracker.current
            assert current is not None   # an owner was found or recorded: a node is running (SaveTracker.owner)
            _, _, savers = self.saved.setdefault(storage_key(t), (owner, _storage_nbytes(t), []))
            if current not in savers:
                savers.append(current)
        return t

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_module" and n.target == "_guards_fn":
            return None
        if not is_op_node(n):
            return super().run_node(n)
        if n.target in _METADATA_ASSERTS:  # baked-in device checks of the capture device
            return None
        self.tracker.begin(n.name)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        # Captured on meta or a GPU, profiled on fake CPU tensors: factory ops must follow.
        args, kwargs = tree_map(on_profile_device, (args, kwargs))
        emulate = CUDA_EMULATED_OPS.get(n.target) if self.target_device == "cuda" else None
        with FlopCounterMode(display=False) as counter:
            out = emulate(*args, **kwargs) if emulate else getattr(self, n.op)(n.target, args, kwargs)
        self.tracker.produced(n.name, out)
        in_tensors = _tensors((args, kwargs))
        out_tensors = _tensors(out)
        in_storages = {storage_key(t) for t in in_tensors}
        self.output_keys[n.name] = {storage_key(t) for t in out_tensors}
        is_view = bool(out_tensors) and all(storage_key(t) in in_storages for t in out_tensors)
        stack = _module_stack(n)
        self.records[n.name] = NodeProfile(
            name=n.name,
            op=str(n.target) if n.op != "call_module" else f"module:{n.target}",
            module_path=stack[-1] if stack else "",
            module_stack=stack,
            inputs=[a.name for a in n.all_input_nodes if is_op_node(a)],
            flops=int(counter.get_total_flops()),
            input_bytes=0 if is_view else sum(t.numel() * t.element_size() for t in in_tensors),
            output_bytes=0 if is_view else sum(t.numel() * t.element_size() for t in out_tensors),
            is_view=is_view,
            output_shapes=[tuple(t.shape) for t in out_tensors],
            emulated=emulate is not None,
        )
        return out


def _fake_like(mode: contextlib.AbstractContextManager, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    if isinstance(t, torch.nn.Parameter) or t.requires_grad:
        fake.requires_grad_(t.requires_grad)
    return fake


def _named_attrs(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    attrs: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                attrs[str(node.target)] = value
    for name, p in gm.named_parameters():
        attrs.setdefault(name, p)
    for name, b in gm.named_buffers():
        attrs.setdefault(name, b)
    return attrs


def _count_compiled_saves(gm: fx.GraphModule, attrs: dict, inputs: list, interp: Any,
                          mode: contextlib.AbstractContextManager, saves: bool = True) -> None:
    """Which part of a zero-bubble split backward reads what each node saves
    (:func:`lynx.frontend.joint_weights.backward_reach`: every target's stages lower the same
    joint graph) and, with ``saves`` (a CPU target), what the compiled stages keep
    (:func:`lynx.frontend.joint.saved_by_node`) and the ops they run per node
    (:func:`lynx.frontend.joint.generated_ops`).

    Stages run graphs lowered from AOTAutograd's joint graph, whose CPU dropout keeps a 1-byte
    mask (eager's CPU dropout keeps a tensor of the input's dtype) and whose views are counted
    by the storage they share: the plan must count what that executor holds. Falls back to
    eager autograd's saves when the joint graph cannot be traced (the stage reports why then).
    """
    from lynx.frontend.joint import generated_ops, saved_by_node, trace_joint
    from lynx.frontend.joint_reuse import remember
    from lynx.frontend.joint_weights import backward_reach

    try:
        with quiet_torch(), mode:
            joint = trace_joint(gm, list(inputs), attrs=attrs)
            remember(gm, list(inputs), attrs, joint)   # a one-stage pipeline runs this graph (joint_reuse)
            order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
            saved, ops, reach = saved_by_node(joint, order), generated_ops(joint), backward_reach(joint, order)
    except Exception:  # noqa: BLE001 - eager's attribution below stays in force
        return
    for name, record in interp.records.items():
        record.backward_reach = {part: list(r) for part, r in reach.get(name, {}).items()}
        if saves:
            record.forward_ops, record.backward_ops = ops.get(name, (0, 0))
    if not saves:
        return
    # two entries per owner: its output's storages (when saved) and the rest
    interp.saved, interp.output_keys = {}, {}
    for owner, (nbytes, out, savers, out_bytes) in saved.items():
        key = len(interp.saved)
        interp.saved[key] = (owner, nbytes - out_bytes, [])
        if out:
            interp.saved[key + 1] = (owner, out_bytes, list(savers))
            interp.output_keys[owner] = {key + 1}


def profile(captured: Captured, target: str = "cuda") -> Profile:
    """Measure every op node of ``captured`` for the ``target`` device (``"cuda"`` or ``"cpu"``)."""
    if target not in TARGETS:
        raise LynxConfigError(f"unknown profile target {target!r}; use one of {TARGETS}")
    gm = captured.gm
    mode = fake_tensor_mode()
    cpu = torch.device("cpu")
    attrs = {name: _fake_like(mode, t, cpu) for name, t in _named_attrs(gm).items()}
    inputs = [_fake_like(mode, t, cpu) for t in captured.example_inputs]
    interp = _ProfilingInterpreter(gm, target, attrs)
    try:
        with quiet_torch(), mode, torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(interp.pack, lambda t: t):
                out = interp.run(*inputs)
    except Exception as err:  # noqa: BLE001 - re-raised with the failing node named
        from lynx.frontend.capture import user_frame

        node = interp.tracker.current
        shapes = ", ".join(str(tuple(t.shape)) for t in captured.example_inputs)
        where = user_frame(err)
        raise LynxProfileError(
            f"running the captured forward failed at node {node!r}"
            + (f" ({where})" if where else "")
            + f": {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}\n"
            f"  example inputs had shapes ({shapes}); check they are one microbatch of what the "
            "model's forward expects."
        ) from err
    del out
    _count_compiled_saves(gm, attrs, inputs, interp, mode, saves=target == "cpu")
    for key, (owner, nbytes, savers) in interp.saved.items():
        record = interp.records[owner]
        record.saved_bytes += nbytes
        if key in interp.output_keys.get(owner, ()):
            record.output_saved = True
            record.output_saved_bytes += nbytes
            record.output_saved_by.extend(s for s in savers if s not in record.output_saved_by)
    dtypes = [str(t.dtype).removeprefix("torch.") for t in attrs.values() if t.is_floating_point()]
    return Profile(
        target=target,
        nodes=interp.records,
        input_shapes=[tuple(t.shape) for t in captured.example_inputs],
        dtype=max(set(dtypes), key=dtypes.count) if dtypes else None,
        emulated_ops=sorted({r.op for r in interp.records.values() if r.emulated}),
    )
