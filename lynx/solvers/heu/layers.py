"""HEU's layer classes: find the repeated layers of a stage and reduce them to one.

:func:`families` finds the family of structurally identical layers (same contracted items,
bytes, costs and internal wiring) in a :class:`~lynx.solvers.stage_model.StageModel`;
:func:`reduced` builds the model HEU's greedy policies solve: one item stands for the same
node in every family layer (``mult`` = family size, so its bytes and window time count once
per layer, its on-demand transient once), edge blocks and odd layers are items of their own,
and each microbatch class has its windows merged into two (any-layer windows,
layer-restricted windows) — each layer's share of the capacity.

Example::

    >>> from lynx.solvers.stage_model import model_from_problem
    >>> from lynx.solvers.synthetic import make_uniform_problem
    >>> from lynx.solvers.heu.layers import families, reduced
    >>> p = make_uniform_problem(layers=4, pre=True, post=True)
    >>> model = model_from_problem(p)
    >>> fam = families(p, model)
    >>> len(fam.layers), len(reduced(model, fam)[0].items) < len(model.items)
    (4, True)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from lynx.solvers.stage_model import ModelClass, ModelItem, StageModel
from lynx.solvers.problem import StageProblem

__all__ = ["Family", "families", "reduced", "reduced_classes"]


@dataclass
class Family:
    layers: list[list[int]]  # item indices per family layer, aligned by position
    rep_of: dict[int, int]  # family item -> position in its layer


def families(problem: StageProblem, model: StageModel) -> Family:
    """Layers whose contracted items match the most common layer structure.

    Membership compares items and their wiring inside the layer; the representative (first
    of ``layers``) is a member whose wiring to the previous layer is the most common one,
    so the first layer of a stage (whose inputs come from outside) still joins the family.
    """
    by_name = {n.name: n for n in problem.nodes}
    layer_of = [by_name[it.nodes[-1]].layer for it in model.items]
    per_layer: dict[int, list[int]] = {}
    for i, layer in enumerate(layer_of):
        if layer is not None:
            per_layer.setdefault(layer, []).append(i)
    pos = {i: p for items in per_layer.values() for p, i in enumerate(items)}
    inner, full = {}, {}
    for layer, idx in per_layer.items():
        sig_in, sig_full = [], []
        for i in idx:
            it = model.items[i]
            ins, outs = [], []
            for u, _ in it.inputs:
                if layer_of[u] == layer:
                    ins.append(pos[u])
                elif layer_of[u] is not None and layer_of[u] == layer - 1:
                    outs.append(("prev", pos[u]))
                else:
                    outs.append(("ext", by_name[model.items[u].nodes[-1]].layer_class))
            head = (it.saved_bytes, round(it.recompute_s, 15), it.output_saved, tuple(sorted(ins)),
                    None if it.on_demand_s is None else round(it.on_demand_s, 15))
            sig_in.append(head)
            sig_full.append((head, tuple(sorted(outs))))
        inner[layer], full[layer] = tuple(sig_in), tuple(sig_full)
    if not inner:
        return Family([], {})
    common, _ = Counter(inner.values()).most_common(1)[0]
    members = [layer for layer in sorted(per_layer) if inner[layer] == common]
    rep_sig, _ = Counter(full[layer] for layer in members).most_common(1)[0]
    rep = next(layer for layer in members if full[layer] == rep_sig)
    layers = [per_layer[rep]] + [per_layer[layer] for layer in members if layer != rep]
    return Family(layers, {i: p for items in layers for p, i in enumerate(items)})


def reduced(model: StageModel, fam: Family) -> tuple[StageModel, list[int]]:
    """Model with one item per family position; returns it and full-item -> reduced index."""
    n_rep = len(fam.layers[0]) if len(fam.layers) > 1 else 0
    rep_layer = fam.layers[0] if n_rep else []
    others = [i for i in range(len(model.items)) if not (n_rep and i in fam.rep_of)]
    to_red = {i: n_rep + k for k, i in enumerate(others)}
    if n_rep:
        to_red.update(fam.rep_of)
    rep_group = model.items[rep_layer[0]].group if n_rep else -1
    items = []
    for i in (rep_layer + others):
        it = model.items[i]
        ins = {}
        for u, cross in it.inputs:
            ru = to_red[u]
            cross_red = cross or (ru == to_red[i])
            if ru == to_red[i] and not cross:
                continue
            ins[ru] = ins.get(ru, False) or cross_red
        mult = len(fam.layers) if (n_rep and i in fam.rep_of) else 1
        items.append(ModelItem(it.nodes, mult, it.saved_bytes, it.recompute_s, tuple(sorted(ins.items())),
                               it.output_saved, rep_group if mult > 1 else it.group, on_demand_s=it.on_demand_s))
    to_red_list = [to_red[i] for i in range(len(model.items))]
    classes = reduced_classes(model, to_red_list)
    return StageModel(tuple(items), classes, model.in_flight, model.budget_bytes), to_red_list


def reduced_classes(model: StageModel, to_red: list[int]) -> tuple[ModelClass, ...]:
    """Each class's windows merged into two: any-layer windows and layer-restricted ones."""
    classes = []
    for cls in model.classes:
        any_cap = sum(c for c, e in zip(cls.capacities, cls.eligible) if e is None)
        lay_cap = sum(c for c, e in zip(cls.capacities, cls.eligible) if e is not None)
        lay_items: set[int] = set()
        for e in cls.eligible:
            if e is not None:
                lay_items |= {to_red[i] for i in e}
        caps, elig = [], []
        if any(e is None for e in cls.eligible):
            caps.append(any_cap)
            elig.append(None)
        if lay_items:
            caps.append(lay_cap)
            elig.append(frozenset(lay_items))
        classes.append(ModelClass(cls.count, tuple(caps), tuple(elig)))
    return tuple(classes)
