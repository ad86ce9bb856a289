"""Every private torch API Lynx uses, in one module: a torch that moves one fails here, by name.

Lynx needs a few of torch's internals that have no public form: AOTAutograd's joint
forward/backward trace (``_aot_export_function``, its ``OutputType``) and the partitioner's
forward tag, export's switch that keeps an op whole in a trace
(``_override_composite_implicit_decomp`` with ``_special_op_to_preserve_cia``) and the
dispatcher's kernel table (``torch._C._dispatch_*``), fake tensors (``FakeTensorMode``),
pytrees (``torch.utils._pytree``), fx's boxed calling convention (``_BoxedCodeGen``), the
output tree of an exported graph (``GraphModule._out_spec``), the operator class, schema and
function (``torch._ops.OpOverload``, ``._schema``, ``._op``), the ``_foreach`` kernels and the
default group's store. Nothing else in ``lynx/`` touches a private torch name: ``tests/test_torch_private.py``
fails on one.

Each name is looked up on first use (:func:`private`); a torch that lacks one raises a
:class:`~lynx.errors.LynxRuntimeError` naming it, what Lynx needs it for, the torch installed
and the torch Lynx is verified with (:data:`VERIFIED_TORCH`). :func:`check` looks every name
up at once: after a torch upgrade it lists, in one message, everything to port.

Example::

    >>> from lynx.torch_private import check, private, tree_flatten
    >>> tree_flatten({"a": 1, "b": (2, 3)})[0]
    [1, 2, 3]
    >>> check()
    []
    >>> private("torch.fx.graph", "_NoSuchCodeGen", "an example")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lynx.errors.LynxRuntimeError: torch ... has no torch.fx.graph._NoSuchCodeGen, which Lynx uses for an example ...
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import fx

from lynx.errors import LynxRuntimeError

if TYPE_CHECKING:  # for the type checker only; at run time the class is looked up by _api
    from torch._ops import OpOverload

__all__ = ["VERIFIED_TORCH", "private", "check", "is_op_overload", "op_schema", "op_function", "tree_flatten",
           "tree_unflatten", "tree_map", "tree_leaves", "boxed_codegen", "out_spec_of", "fake_tensor_mode",
           "aot_export_joint", "output_aliases_input", "is_forward_node", "has_kernel", "all_op_names", "kept_whole",
           "foreach_add_", "foreach_copy_", "default_store", "import_tracer"]

# the torch release every name below was checked against (scripts/install.sh installs it)
VERIFIED_TORCH = "2.13"

# name -> (module, attribute path, what Lynx uses it for)
_API: dict[str, tuple[str, str, str]] = {
    "OpOverload": ("torch._ops", "OpOverload", "recognising aten operators in captured and joint graphs"),
    "tree_flatten": ("torch.utils._pytree", "tree_flatten", "flattening nested inputs and outputs"),
    "tree_unflatten": ("torch.utils._pytree", "tree_unflatten", "rebuilding a model's nested outputs"),
    "tree_map": ("torch.utils._pytree", "tree_map", "mapping over nested arguments"),
    "tree_leaves": ("torch.utils._pytree", "tree_leaves", "listing the tensors of a nested output"),
    "BoxedCodeGen": ("torch.fx.graph", "_BoxedCodeGen", "backward graphs that free each input after its last use"),
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode", "profiling a model on fake tensors"),
    "aot_export_function": ("torch._functorch.aot_autograd", "_aot_export_function",
                            "tracing a stage's joint forward/backward graph"),
    "non_alias": ("torch._functorch._aot_autograd.schemas", "OutputType.non_alias",
                  "finding joint-graph outputs that alias an input or another output"),
    "override_cia": ("torch.export.exported_program", "_override_composite_implicit_decomp",
                     "keeping backward formulas that have a device kernel whole in the joint trace"),
    "preserve_cia": ("torch._export.utils", "_special_op_to_preserve_cia",
                     "keeping backward formulas that have a device kernel whole in the joint trace"),
    "has_kernel": ("torch._C", "_dispatch_has_kernel_for_dispatch_key", "asking which ops have a device kernel"),
    "all_op_names": ("torch._C", "_dispatch_get_all_op_names", "listing the registered operators"),
    "foreach_add_": ("torch", "_foreach_add_", "DeMo's parameter update in one kernel per group"),
    "foreach_copy_": ("torch", "_foreach_copy_", "DeMo's batched copies into its flat buffers"),
    "tracer": ("torch._dynamo", "", "importing torch.export's tracer ahead of capture (timed on its own)"),
    "default_store": ("torch.distributed.distributed_c10d", "_get_default_store",
                      "the process group's key-value store (fingerprint and failure exchange)"),
}

# the partitioner's tag on joint-graph forward nodes (``node.meta["partitioner_tag"]``)
_FORWARD_TAG = ("partitioner_tag", "is_forward")


@functools.cache
def private(module: str, name: str, use: str) -> Any:
    """``module.name`` (``name`` may be dotted; empty: the module itself), or a clear error saying
    what moved and what to do."""
    try:
        value: Any = importlib.import_module(module)
        for part in filter(None, name.split(".")):
            value = getattr(value, part)
    except (ImportError, AttributeError) as err:
        raise LynxRuntimeError(
            f"torch {torch.__version__} has no {module}.{name}, which Lynx uses for {use} (a private torch "
            f"API; Lynx is verified with torch {VERIFIED_TORCH}): install torch=={VERIFIED_TORCH}.*, or port "
            f"lynx/torch_private.py to this torch ({type(err).__name__}: {err})") from err
    return value


def _api(key: str) -> Any:
    return private(*_API[key])


def check() -> list[str]:
    """Look every private name up now; the problems found, one line each (empty: all present)."""
    problems = []
    for key in _API:
        try:
            _api(key)
        except LynxRuntimeError as err:
            problems.append(str(err))
    return problems


def is_op_overload(target: Any) -> TypeGuard[OpOverload]:
    """Whether a graph node's target is an aten (or other registered) operator overload."""
    return isinstance(target, _api("OpOverload"))


def op_schema(target: OpOverload) -> Any:
    """The ``torch._C.FunctionSchema`` of an operator overload (its arguments, returns, aliasing)."""
    return target._schema


def op_function(target: OpOverload) -> Any:
    """The function an operator overload's ``__call__`` forwards to (``OpOverload._op``), to be
    called without that Python frame; the overload itself where a torch has no ``_op``."""
    return getattr(target, "_op", target)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of a nested structure and the spec that rebuilds it (torch's pytree)."""
    return _api("tree_flatten")(tree)


def tree_unflatten(leaves: Iterable[Any], spec: Any) -> Any:
    return _api("tree_unflatten")(leaves, spec)


def tree_map(fn: Any, tree: Any) -> Any:
    return _api("tree_map")(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    return _api("tree_leaves")(tree)


def boxed_codegen() -> fx.graph.CodeGen:
    """fx's boxed calling convention: ``gm(args)`` takes one list and empties it, so each input
    can be freed after its last use inside the graph."""
    return _api("BoxedCodeGen")()


def out_spec_of(gm: Any) -> Any:
    """The pytree spec of an exported module's outputs (``None`` for a graph without one)."""
    return getattr(gm, "_out_spec", None)


def fake_tensor_mode() -> contextlib.AbstractContextManager:
    """A fresh fake-tensor mode that refuses real tensors: tensors made inside it allocate nothing."""
    return _api("FakeTensorMode")(allow_non_fake_inputs=False)


def aot_export_joint(fn: Any, args: tuple, num_params_buffers: int) -> tuple[fx.GraphModule, Any]:
    """AOTAutograd's joint forward/backward graph of ``fn`` on ``args`` (the first
    ``num_params_buffers`` are parameters and buffers), and its view/mutation metadata."""
    gm, meta, _in, _out = _api("aot_export_function")(fn, args, trace_joint=True,
                                                       num_params_buffers=num_params_buffers)
    return gm, meta


def output_aliases_input(info: Any) -> bool:
    """Whether a joint-graph output (an entry of ``meta.output_info``) aliases an input or another output."""
    return info.output_type != _api("non_alias")


def is_forward_node(node: fx.Node) -> bool:
    """Whether AOTAutograd's partitioner tagged a joint-graph node as part of the forward."""
    key, value = _FORWARD_TAG
    return node.meta.get(key) == value


def has_kernel(name: str, dispatch_key: str) -> bool:
    """Whether operator ``name`` (``"aten::silu_backward"``) has a kernel for ``dispatch_key``."""
    return bool(_api("has_kernel")(name, dispatch_key))


def all_op_names() -> list[str]:
    """Every operator registered with the dispatcher (``"aten::add.Tensor"``, ...)."""
    return list(_api("all_op_names")())


@contextlib.contextmanager
def kept_whole(ops: Iterable[Any]) -> Iterator[None]:
    """Inside: tracing keeps each operator overload in ``ops`` as one node instead of
    decomposing its CompositeImplicitAutograd kernel."""
    preserve = _api("preserve_cia")
    with _api("override_cia")({op: preserve for op in ops}):
        yield


def foreach_add_(tensors: list[torch.Tensor], others: list[torch.Tensor], *, alpha: float = 1.0) -> None:
    _api("foreach_add_")(tensors, others, alpha=alpha)


def foreach_copy_(tensors: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    _api("foreach_copy_")(tensors, sources)


def import_tracer() -> None:
    """Import ``torch._dynamo`` (``torch.export``'s tracer, ~1 s) now rather than inside the first capture."""
    _api("tracer")


def default_store() -> Any:
    """The key-value store of the default process group."""
    return _api("default_store")()
