"""Masks split off the top of the chain as ``keep``: ``masked_fill``, ``where``, or adding ``where(keep, 0, fill)``
with a constant fill. The kernel then skips tiles whose rows provably get zero weight from them and computes no
mask arithmetic on tiles the mask keeps whole; the scores under the masks and the fill become two functions."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from fusepass.attention.lift.egraph import EGraph
from fusepass.attention.lift.index_code import IndexCode
from fusepass.attention.lift.values import Code, Separable
from fusepass.fx_util import packet

aten = torch.ops.aten


@dataclass(frozen=True)
class Mask:
    """`node` keeps `inner` where `keep` holds and puts the constant `fill` elsewhere (`additive`: by adding
    ``where(keep, 0, fill)``)."""

    keep: str  # index code
    fill: float
    inner: torch.fx.Node
    additive: bool
    uses: frozenset[str]  # what `keep` varies with
    node: torch.fx.Node
    separable: Separable | None  # the keep's `Code.separable`


@dataclass(frozen=True)
class KeepSplit:
    """The masks split off: their conjunction `keep`, what it varies with, whether one of them is a key-side mask,
    whether it loads tensors (then its block
    map is built per call, not cached), whether it is separable, the fill's bound (`Lifted.fill_bound`), and E as
    two modules: the scores under the masks and the fill where they mask."""

    keep: str
    uses: frozenset[str]
    key_side: bool  # one of the masks varies with the key positions and not the query positions (padding)
    reads_aux: bool
    separable: Separable | None
    fill_bound: float
    score: torch.fx.GraphModule
    fill: torch.fx.GraphModule


def mask_at(node: torch.fx.Node, leaves: dict) -> Mask | None:
    """The mask ``node`` puts on the scores below it, if it is one (`leaves`: E's placeholders' bindings)."""
    if node.op != "call_function":
        return None
    kind = packet(node)
    if kind == aten.masked_fill and isinstance(node.args[2], (int, float)):
        condition = leaves.get(node.args[1])
        if isinstance(condition, Code) and isinstance(node.args[0], torch.fx.Node):
            return Mask(f"~{condition.expr}", float(node.args[2]), node.args[0], False, condition.uses, node,
                        condition.separable and condition.separable.negated())
    if kind == aten.where:
        condition = leaves.get(node.args[0])
        a, b = node.args[1], node.args[2]
        if isinstance(condition, Code):
            if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)):
                return Mask(condition.expr, float(b), a, False, condition.uses, node, condition.separable)
            if isinstance(b, torch.fx.Node) and isinstance(a, (int, float)):
                return Mask(f"~{condition.expr}", float(a), b, False, condition.uses, node,
                            condition.separable and condition.separable.negated())
    if kind == aten.add and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        for x, y in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            mask = leaves.get(y) if isinstance(y, torch.fx.Node) else None
            if isinstance(mask, Code) and mask.mask is not None and isinstance(x, torch.fx.Node):
                keep, fill = mask.mask
                return Mask(keep, float(fill), x, True, mask.uses, node, None)
    return None


def split_masks(e: EGraph, code: IndexCode) -> KeepSplit | None:
    """The outermost masks of E's chain split off, or None where none can be (no mask, fills that differ, a fill
    too close to the scores to skip tiles for)."""
    node = next(n for n in e.graph.nodes if n.op == "output").args[0]
    while node.op == "call_function" and packet(node) in (aten.to, aten._to_copy) and len(node.users) == 1:
        node = node.args[0]  # casts after the masks stay in both graphs
    masks: list[Mask] = []
    while True:
        found = mask_at(node, e.leaves)
        if found is None:
            break
        masks.append(found)
        inner = found.inner
        if len(inner.users) != 1 or inner.op != "call_function":
            break
        node = inner
    if not masks:
        return _split_added_leaf(e, code, node)
    fills = {repr(m.fill) for m in masks}
    if len(fills) != 1:
        return None
    fill = masks[0].fill
    additive = any(m.additive for m in masks)
    if isinstance(fill, float) and math.isnan(fill) or fill > -1e4:
        return None
    bound = _added_fill_bound(fill) if additive else fill
    if bound is None:
        return None
    keep = " & ".join(f"({m.keep})" for m in masks)
    # One mask separable, the others (a causal mask, a window) reading no tensors: the map is the separable
    # one's kinds joined with the others' map, cached per shape.
    separable = None
    separable_masks = [m for m in masks if m.separable is not None and not m.separable.inverted]
    if len(separable_masks) == 1:
        separable = separable_masks[0].separable
        for other in (m for m in masks if m is not separable_masks[0]):
            separable = None if code.reads_aux(other.keep) else separable.joined(other.keep, other.uses)
            if separable is None:
                break
    inner = masks[-1].inner
    top = masks[0].node
    return KeepSplit(keep=keep, uses=frozenset().union(*[m.uses for m in masks]),
                     key_side=any("k" in m.uses and "q" not in m.uses for m in masks), reads_aux=code.reads_aux(keep),
                     separable=separable, fill_bound=bound, score=e.module(replace={top: inner}),
                     fill=e.module(replace={top: ("add", inner, fill) if additive else ("constant", fill)}))


def _added_mask_leaf(node: torch.fx.Node, leaves: dict) -> tuple[torch.fx.Node, Code] | None:
    """A leaf of E holding an additive mask (`Code.mask`) that reaches `node` through additions alone, or None."""
    if node.op != "call_function" or packet(node) != aten.add or node.kwargs.get("alpha", 1) != 1:
        return None
    for arg in node.args:
        if not isinstance(arg, torch.fx.Node):
            continue
        mask = leaves.get(arg)
        if isinstance(mask, Code) and mask.mask is not None:
            return arg, mask
        if len(arg.users) == 1 and (found := _added_mask_leaf(arg, leaves)) is not None:
            return found
    return None


def _split_added_leaf(e: EGraph, code: IndexCode, top: torch.fx.Node) -> KeepSplit | None:
    """A mask added to another term before the scores (T5's position bias with the decoder's mask folded in):
    the scores are E with the mask's leaf 0, the fill E with it the fill, each computed as eager adds them."""
    found = _added_mask_leaf(top, e.leaves)
    if found is None:
        return None
    leaf, mask = found
    keep, fill = mask.mask
    bound = _added_fill_bound(fill)
    if bound is None:
        return None
    return KeepSplit(keep=keep, uses=mask.uses, key_side="k" in mask.uses and "q" not in mask.uses,
                     reads_aux=code.reads_aux(keep), separable=None, fill_bound=bound,
                     score=e.module(replace={leaf: ("constant", 0.0)}),
                     fill=e.module(replace={leaf: ("constant", fill)}))


def _added_fill_bound(fill: float) -> float | None:
    """The most a fill added to the scores can come to (`Lifted.fill_bound`): -inf stays -inf, a finite fill of at
    most -1e30 stays below half of it beside any score; None for a fill too close to the scores to skip tiles for."""
    if fill == -math.inf:
        return fill
    return fill / 2 if fill <= -1e30 else None
