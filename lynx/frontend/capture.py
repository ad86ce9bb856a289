"""Capture a model as an fx graph: ``torch.export`` (non-strict) first, ``symbolic_trace`` second.

The captured :class:`Captured` holds a ``GraphModule`` whose parameters and buffers are the
original module's tensors (``get_attr`` nodes, nothing copied), so plans and rewritten stages
train the user's model itself. When neither method works, :class:`LynxCaptureError` names
the construct that failed — with the file and line in the user's code where torch gives
them — and what to do about it.

Example::

    >>> import torch
    >>> from lynx.frontend.capture import capture
    >>> from lynx.models import build_preset
    >>> model, inputs = build_preset("gpt-tiny", device="meta")
    >>> captured = capture(model, inputs)
    >>> captured.method
    'export'
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping

import torch
from torch import fx, nn

from lynx.errors import LynxCaptureError

__all__ = ["Captured", "FoldInfo", "capture", "is_op_node", "quiet_torch", "user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__)


#: Deep meta models are captured with two of their repeated layers (see :func:`capture`).
FOLD_MIN_LAYERS = 8
FOLD_KEEP = 2


@dataclass(frozen=True)
class FoldInfo:
    """A folded capture: ``path`` held ``total`` identical layers; ``FOLD_KEEP`` were captured."""

    path: str
    total: int


@dataclass
class Captured:
    """A captured model: the graph module and the inputs it was captured with."""

    gm: fx.GraphModule
    example_inputs: tuple[torch.Tensor, ...]
    method: str  # "export" | "symbolic_trace"
    input_names: list[str] = field(default_factory=list)
    export_error: str | None = None  # why export failed when the fallback was used
    folded: FoldInfo | None = None  # planning-only capture of a deep meta model

    def op_nodes(self) -> list[fx.Node]:
        """The ``call_function`` / ``call_module`` / ``call_method`` nodes, in execution order."""
        return [n for n in self.gm.graph.nodes if is_op_node(n)]


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence torch's tracing warnings and log dumps; failures surface as Lynx errors instead."""
    names = ("torch.fx.experimental.symbolic_shapes", "torch._subclasses.fake_tensor", "torch._export",
             "torch.export", "torch._dynamo")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def is_op_node(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") or (
        node.op == "call_module" and node.target != "_guards_fn"
    )


def user_frame(err: BaseException) -> str | None:
    """``file:line`` of the innermost traceback frame outside torch and Lynx, if any."""
    frames = traceback.extract_tb(err.__traceback__)
    lynx_dir = os.path.dirname(__file__)
    for frame in reversed(frames):
        if not frame.filename.startswith((_TORCH_DIR, lynx_dir)) and "<" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    text = str(err)
    for line in text.splitlines():  # dynamo/export put the user frame in the message
        stripped = line.strip()
        if stripped.startswith("File ") or ".py:" in stripped:
            return stripped
    return None


def _describe(err: BaseException) -> str:
    first = str(err).strip().splitlines()
    return f"{type(err).__name__}: {first[0] if first else ''}"[:400]


def _advice(export_err: BaseException, trace_err: BaseException) -> str:
    text = f"{export_err}\n{trace_err}".lower()
    if "in output, which is not a known type" in text:
        found = re.search(r"Found <class '([^']+)'>", f"{export_err}\n{trace_err}")
        what = f" ({found.group(1)})" if found else ""
        cache = ("; a `transformers` model returning its key/value cache: set `model.config.use_cache = False` "
                 "before compiling (training needs no cache)" if "cache" in what.lower() else "")
        return (f"The model returns an object{what} that torch.export cannot flatten. Return tensors, tuples, "
                f"lists, dicts or a registered pytree type (a `transformers` ModelOutput is one){cache}.")
    if "data-dependent" in text or "control flow" in text or "guard" in text or "bool" in text:
        return ("The model branches on tensor values (data-dependent control flow). Make the "
                "branch depend on shapes or Python config only, or express it with "
                "torch.where / torch.cond.")
    if "shape" in text or "size" in text or "dimension" in text:
        return "Check that example_inputs have the shapes the model's forward expects (one microbatch)."
    return "Make the forward traceable by torch.export (see docs/architecture.md, 'Capture')."


def _input_summary(inputs: tuple) -> str:
    return ", ".join(
        f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) else type(t).__name__
        for t in inputs
    )


def _repeated_module_list(model: nn.Module) -> tuple[nn.Module, str, str, nn.ModuleList] | None:
    """The largest ModuleList of structurally identical modules (same type, same parameters)."""
    best = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < FOLD_MIN_LAYERS:
            continue
        signatures = {
            (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())) for m in module
        }
        if len(signatures) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            parent_path, _, attr = path.rpartition(".")
            best = (size, model.get_submodule(parent_path) if parent_path else model, path, attr, module)
    return None if best is None else best[1:]


def capture(
    model: nn.Module, example_inputs: tuple | list | Mapping | torch.Tensor, *, fold_repeats: bool | None = None
) -> Captured:
    """Capture ``model`` called on ``example_inputs`` (one microbatch) as an fx graph.

    A mapping of example inputs is passed by keyword (``model(**example_inputs)``, e.g.
    ``{"input_ids": ids, "labels": ids}`` for a ``transformers`` model); the graph's inputs are
    then named and ordered as its keys.

    ``fold_repeats`` (default: when every parameter is on the meta device) captures a deep
    model with only two of its repeated layers; :func:`lynx.frontend.graph.build_graph` replicates them
    to the full depth. Such a capture plans; it does not run.
    """
    if fold_repeats is None:
        fold_repeats = isinstance(model, nn.Module) and all(p.is_meta for p in model.parameters())
    repeated = _repeated_module_list(model) if fold_repeats and isinstance(model, nn.Module) else None
    if repeated is not None:
        parent, path, attr, full = repeated
        setattr(parent, attr, nn.ModuleList(list(full)[:FOLD_KEEP]))
        try:
            captured = _capture(model, example_inputs)
        finally:
            setattr(parent, attr, full)
        captured.folded = FoldInfo(path, len(full))
        return captured
    return _capture(model, example_inputs)


def _capture(model: nn.Module, example_inputs: tuple | list | Mapping | torch.Tensor) -> Captured:
    if not isinstance(model, nn.Module):
        raise LynxCaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    # a mapping is passed by keyword (model(**example_inputs)); the graph's inputs follow its order
    keywords = dict(example_inputs) if isinstance(example_inputs, Mapping) else None
    if keywords is not None:
        inputs = tuple(keywords.values())
    else:
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise LynxCaptureError(f"example_inputs must be tensors, got ({_input_summary(inputs)})")
    # the same tensor passed twice (compile(model, (idx, idx))) would become one graph input,
    # and the model would read the first input for both at run time
    inputs = tuple(t.clone() if any(t is u for u in inputs[:i]) else t for i, t in enumerate(inputs))
    if keywords is not None:
        keywords = dict(zip(keywords, inputs))
    was_training = model.training
    model.train()
    try:
        # export prints the partial graph when it fails; the LynxCaptureError says what matters
        with quiet_torch(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exported = (torch.export.export(model, (), kwargs=keywords, strict=False) if keywords is not None
                        else torch.export.export(model, inputs, strict=False))
        gm = exported.module()
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        _share_original_tensors(gm, model)  # training-mode behaviour (dropout) is baked in
        return Captured(gm, inputs, "export", names)
    except Exception as export_err:  # noqa: BLE001 - every export failure falls back
        try:
            if keywords is not None:
                raise LynxCaptureError("symbolic_trace takes positional example inputs only") from export_err
            with quiet_torch():
                gm = fx.symbolic_trace(model)
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            gm.train()
            return Captured(gm, inputs, "symbolic_trace", names, export_error=_describe(export_err))
        except Exception as trace_err:  # noqa: BLE001
            where = user_frame(export_err) or user_frame(trace_err) or "unknown location"
            raise LynxCaptureError(
                f"cannot capture {type(model).__name__} with inputs ({_input_summary(inputs)}).\n"
                f"  torch.export failed at {where}: {_describe(export_err)}\n"
                f"  torch.fx.symbolic_trace failed: {_describe(trace_err)}\n"
                f"  What to do: {_advice(export_err, trace_err)}"
            ) from export_err
    finally:
        model.train(was_training)


def _share_original_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """Point the unlifted module's parameters and buffers at the original module's tensors."""
    originals: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    originals.update(dict(model.named_buffers(remove_duplicate=False)))
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in originals:
            continue
        *path, leaf = node.target.split(".")
        owner = gm
        for part in path:
            owner = getattr(owner, part)
        # nn.Module.__setattr__ puts a Parameter among the parameters, a tensor under a
        # buffer's name among the buffers (persistence kept), anything else as an attribute
        setattr(owner, leaf, originals[node.target])
