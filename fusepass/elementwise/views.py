"""Views moved past the unary pointwise ops beside them, so that the ops run in a row kernel's shape.

A view that merges dimensions is not affine in a group's coordinates (``coords``): a group ends there. Read
after a unary op (``logits.float().view(-1, vocab)``, as a loss flattens its logits), it would keep the op out of
the row kernel that follows, and the op's result, an fp32 copy of the logits, would be written and read again:
the view moves before the op. The other way, a unary op reading a view that splits a row kernel's output (the
logits' gradient, cast back to bf16 in the logits' shape) would write a shape the row kernel does not: the view
moves after the op, and so does a view merging the rows of a computed value that a unary op reads (a logit
softcap's backward divides the flattened logits' gradient by the cap); a view moved after one op moves on past the
next. A merging view moves before the op it reads only where an op a group can hold reads the view (the row kernel
of a loss, not a matmul alone). Either way a view at a group's edge costs nothing. Only where the value passed
along has no other reader and takes the view as it is.

A view of a view is first taken of what the first views: an LM head's logits gradient, split to (batch, time,
vocab) by the loss's flatten and merged again by the matmul's view, would otherwise keep the cast back to bf16 out
of the loss backward's kernel, which would write an fp32 gradient for the cast to read.
"""
from __future__ import annotations

import torch
import torch.fx

from fusepass.elementwise.coords import identity, is_mapped_view, through_view
from fusepass.elementwise.partition import decline_reason
from fusepass.elementwise.pieces import is_piecewise
from fusepass.elementwise.reduction import is_column_sum, is_row_reduction, keeps_dim
from fusepass.fx_util import infer_meta, val
from fusepass.matmul.pad import VIEWS

aten = torch.ops.aten


def _unary_input(node: torch.fx.Node, device: torch.device) -> torch.fx.Node | None:
    """The one tensor a fusable unary op of the same shape reads, or None. (Not a piece placed along a dim, whose
    arguments name dims and sizes of the shape it is in.)"""
    if node.op != "call_function" or is_mapped_view(node) or is_row_reduction(node) or is_piecewise(node) or \
            decline_reason(node, device) is not None or len(node.users) != 1:
        return None
    tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if len(tensors) != 1 or len(node.all_input_nodes) != 1 or \
            tuple(val(tensors[0]).shape) != tuple(val(node).shape):
        return None
    return tensors[0]


def _read_by_fusable(view: torch.fx.Node, device: torch.device) -> bool:
    """Whether an op a group can hold reads `view`, through other views: one moved before the view joins that
    reader's group (where only matmuls read it, the op stays with the value it reads)."""
    return any(u.op == "call_function" and decline_reason(u, device) is None and
               (not is_mapped_view(u) or _read_by_fusable(u, device)) for u in view.users)


def _viewable(x: torch.fx.Node, shape: list) -> bool:
    try:
        with val(x).fake_mode:
            val(x).view(shape)
    except Exception:
        return False
    return True


def _views_of_views(graph: torch.fx.Graph) -> None:
    """Each view of a view a view of what the first views (the same elements in the same order) where that takes
    the view; one giving back its layout is that value itself, unless the graph returns it."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in VIEWS:
            continue
        inner = node.args[0]
        if not isinstance(inner, torch.fx.Node) or inner.op != "call_function" or inner.target not in VIEWS:
            continue
        x = inner.args[0]
        if not isinstance(x, torch.fx.Node) or not _viewable(x, node.args[1]):
            continue
        # (a graph's output stays a view: what AOTAutograd knows of its outputs' aliasing holds)
        if tuple(val(x).shape) == tuple(val(node).shape) and val(x).stride() == val(node).stride() and \
                all(u.op != "output" for u in node.users):
            node.replace_all_uses_with(x)
            graph.erase_node(node)
        else:
            node.args = (x, *node.args[1:])
        if not inner.users:
            graph.erase_node(inner)


def move_views(graph: torch.fx.Graph, device: torch.device) -> None:
    _column_sums_before_merges(graph)
    # (a view, the way it was moved: "before" an op or "after" one, or None): a moved view moves on that way only,
    # or the two ways would undo each other
    work = [(n, None) for n in graph.nodes if n.op == "call_function" and n.target == aten.view.default]
    while work:
        view, way = work.pop()
        rank = val(view).dim()
        op = view.args[0]
        x = _unary_input(op, device) if isinstance(op, torch.fx.Node) and way != "after" else None
        if through_view(view, identity(rank), rank) is not None or x is None or not _viewable(x, view.args[1]) \
                or not _read_by_fusable(view, device):
            moved = _after(graph, view, device) if way != "before" else None
            if moved is not None:
                work.append((moved, "after"))
            continue
        with graph.inserting_before(op):
            moved = graph.call_function(aten.view.default, (x, view.args[1]))
            applied = graph.node_copy(op, lambda a: moved if a is x else a)
        for new in (moved, applied):
            new.meta.update({k: v for k, v in op.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                      "source_fn_stack")})
        infer_meta([moved, applied])
        view.replace_all_uses_with(applied)
        graph.erase_node(view)
        graph.erase_node(op)
        work.append((moved, "before"))
    _views_of_views(graph)  # a view moved before a unary op may now view a view


def _column_sums_before_merges(graph: torch.fx.Graph) -> None:
    """A column sum of a view merging its input's leading dims (a bias's gradient, ``grad.view(-1, n).sum(0)``)
    sums the input over those dims instead, then takes the sum's shape: the same sum, over the rows of the op that
    wrote them, whose group it can join."""
    for node in list(graph.nodes):
        merged = node.args[0] if is_column_sum(node) else None
        if not isinstance(merged, torch.fx.Node) or merged.op != "call_function" or \
                merged.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            continue
        x = merged.args[0]
        if not isinstance(x, torch.fx.Node) or not isinstance(x.meta.get("val"), torch.Tensor) or \
                val(x).dim() <= val(merged).dim() or str(val(x).shape[-1]) != str(val(merged).shape[-1]):
            continue
        with graph.inserting_before(node):
            summed = graph.call_function(aten.sum.dim_IntList, (x, list(range(val(x).dim() - 1)), keeps_dim(node)),
                                         {k: v for k, v in node.kwargs.items()})
            shaped = graph.call_function(aten.view.default, (summed, list(val(node).shape)))
        for new in (summed, shaped):
            new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                        "source_fn_stack")})
        infer_meta([summed, shaped])
        node.replace_all_uses_with(shaped)
        graph.erase_node(node)
        if not merged.users:
            graph.erase_node(merged)


def _after(graph: torch.fx.Graph, view: torch.fx.Node, device: torch.device) -> torch.fx.Node | None:
    """A view of a computed value read by one unary op: the op on the value, then the view (returned)."""
    y = view.args[0]
    if len(view.users) != 1 or not isinstance(y, torch.fx.Node) or y.op != "call_function":
        return None
    (op,) = view.users
    if _unary_input(op, device) is not view:
        return None
    with graph.inserting_before(op):
        applied = graph.node_copy(op, lambda a: y if a is view else a)
        moved = graph.call_function(aten.view.default, (applied, view.args[1]))
    for new in (applied, moved):
        new.meta.update({k: v for k, v in op.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                  "source_fn_stack")})
    try:
        infer_meta([applied, moved])
    except Exception:  # the op's result does not take the view: leave them as they were
        graph.erase_node(moved)
        graph.erase_node(applied)
        return None
    op.replace_all_uses_with(moved)
    graph.erase_node(op)
    graph.erase_node(view)
    return moved
