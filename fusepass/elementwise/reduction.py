"""Row reductions: sums, means, maxima and minima over a tensor's last dimension, which a fused group may hold,
and the softmax family over it (``_softmax``, ``_log_softmax`` and their backward ops), which a group holds as
the reductions and pointwise ops they are made of (`expand`).

A group that holds one computes, per row of its root shape (the reductions' input shape), the pointwise ops
before the reduction over the whole row, the reduction, and the pointwise ops after it, reading the row value
broadcast along the row (``keepdim=True``) or writing it out: a norm, a softmax written by hand, a loss's
row sums, a backward's ``sum(dy * x, -1)`` beside its pointwise ops. Reductions over other dimensions (a
bias gradient's sum over the batch) stay ATen ops.
"""
from __future__ import annotations

import torch
import torch.fx

from collections.abc import Callable, Container
from typing import Any

from fusepass.fx_util import val

aten = torch.ops.aten

# The overloads, and how to read (input, dims, keepdim) off their arguments.
ROW_REDUCTIONS = {
    aten.sum.dim_IntList: "sum",
    aten.mean.dim: "mean",
    aten.amax.default: "amax",
    aten.amin.default: "amin",
}
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# The negative log-likelihood's backward (cross-entropy's, after its log-softmax): the gradient of the log-
# probabilities, one class of each row hit; its rows are the log-probabilities' (`reduced_input`), read for their
# shape only.
NLL_BACKWARD = aten.nll_loss_backward.default
REDUCTIONS_BY_MEAN = 1  # torch.nn._reduction: 0 none, 1 mean, 2 sum

# (output, and for the backward ops the output's gradient): the softmax family, by the argument holding `dim`.
COMPOSITES = {
    aten._softmax.default: 1,
    aten._log_softmax.default: 1,
    aten._softmax_backward_data.default: 2,
    aten._log_softmax_backward_data.default: 2,
}


def _nll_backward_fits(node: torch.fx.Node) -> bool:
    """Rows of classes (2-d log-probabilities, 1-d integer targets), no class weights."""
    grad, logp, target, weight = (val(a) if isinstance(a, torch.fx.Node) else a for a in node.args[:4])
    total = val(node.args[6])
    return (weight is None and logp is not None and logp.dim() == 2 and logp.dtype in FLOATING and
            target is not None and target.dim() == 1 and not target.dtype.is_floating_point and
            grad is not None and grad.dtype in FLOATING and total is not None and total.dim() == 0)


def reduction_kind(node: torch.fx.Node) -> str | None:
    """"sum", "mean", "amax", "amin", "softmax" (the family) or "nll" where `node` reduces its floating input (or
    counts its bool or integer one) over the last dimension only (or, the negative log-likelihood's backward, writes
    rows of it)."""
    if node.op == "call_function" and node.target == NLL_BACKWARD:
        return "nll" if _nll_backward_fits(node) else None
    if node.op != "call_function" or (node.target not in ROW_REDUCTIONS and node.target not in COMPOSITES):
        return None
    source, out = node.args[0], val(node)
    if not isinstance(source, torch.fx.Node) or val(source) is None or out is None:
        return None
    x = val(source)
    tensors = [val(a) for a in node.all_input_nodes]
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() == 0 or \
            any(not isinstance(t, torch.Tensor) for t in tensors):
        return None
    # A count (an amax's backward sums its ties, x == max) sums bool or integer values into int64, as eager does.
    counts = node.target == aten.sum.dim_IntList and not x.dtype.is_floating_point and not x.is_complex() and \
        out.dtype == torch.int64
    if not counts and (any(t.dtype not in FLOATING for t in tensors) or out.dtype not in FLOATING):
        return None
    if node.target in COMPOSITES:
        dims = [node.args[COMPOSITES[node.target]]]
        if any(tuple(map(str, t.shape)) != tuple(map(str, x.shape)) for t in tensors):
            return None
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
    if [d % x.dim() for d in dims] != [x.dim() - 1]:
        return None
    return "softmax" if node.target in COMPOSITES else ROW_REDUCTIONS[node.target]


# Rows up to this long are held whole in a row kernel's registers (row_kernel); a column sum needs its rows whole.
PERSISTENT_MAX = 4096


def held_whole(width: object) -> bool:
    """Whether a row kernel holds rows of `width` whole (a size known when the graph compiles, PERSISTENT_MAX at
    most), or walks them."""
    return isinstance(width, int) and width <= PERSISTENT_MAX


def is_column_sum(node: torch.fx.Node) -> bool:
    """A floating sum over every dimension but the last (a norm's weight gradient, a bias's), of rows short
    enough to be held whole: a row kernel adds each program's rows, the launcher their partial sums."""
    if node.op != "call_function" or node.target != aten.sum.dim_IntList or len(node.args) < 2:
        return False
    x, out = val(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None, val(node)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() < 2 or \
            x.dtype not in FLOATING or out.dtype not in FLOATING or set(node.kwargs) - {"dtype"}:
        return False
    dims = node.args[1]
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    width = x.shape[-1]
    return sorted(d % x.dim() for d in dims) == list(range(x.dim() - 1)) and held_whole(width)


def is_reduction(node: torch.fx.Node) -> bool:
    """A row reduction or a column sum: what a row kernel reduces."""
    return is_row_reduction(node) or is_column_sum(node)


def column_sum_of(node: torch.fx.Node, members: Container[torch.fx.Node]) -> torch.fx.Node | None:
    """The column sum of the group `members` that `node` is, or rounds to another floating dtype (a `_to_copy` its
    one reader: the launcher rounds the sum once, as eager's cast of it does); None otherwise (a cast of a sum left
    out of the group is a cast of what it reads)."""
    if is_column_sum(node):
        return node
    if node.op != "call_function" or node.target != aten._to_copy.default or not node.args or \
            node.args[0] not in members or not is_column_sum(node.args[0]) or len(node.args[0].users) != 1:
        return None
    out, summed = val(node), val(node.args[0])
    same_place = node.kwargs.get("device", summed.device) == summed.device and \
        node.kwargs.get("layout", torch.strided) == torch.strided
    fits = set(node.kwargs) <= {"dtype", "device", "layout"} and same_place and out.dtype in FLOATING
    return node.args[0] if fits else None


def keeps_dim(node: torch.fx.Node) -> bool:
    if len(node.args) > 2:
        return bool(node.args[2])
    return bool(node.kwargs.get("keepdim", False))


def reduced_input(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor whose shape is the group's root: what a row reduction or a column sum reduces."""
    return node.args[1] if node.target == NLL_BACKWARD else node.args[0]


def read_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors a reduction reads the values of (the negative log-likelihood's backward reads its
    log-probabilities' shape only)."""
    if node.target == NLL_BACKWARD:
        return [node.args[0], node.args[2], node.args[6]]
    return list(node.all_input_nodes)


def is_row_reduction(node: torch.fx.Node) -> bool:
    return reduction_kind(node) is not None


def is_composite(node: torch.fx.Node) -> bool:
    return (node.target in COMPOSITES or node.target == NLL_BACKWARD) and is_row_reduction(node)


def expand(node: torch.fx.Node, inputs: list[Any], emit: Callable[..., Any]) -> Any:
    """What a softmax-family op computes, as steps: `emit(target, args, dtype)` adds one and returns its value;
    `inputs` are the values of the op's tensor arguments. In float32 for half precision, as eager's kernels
    compute, the output rounded once."""
    out_dtype = val(node).dtype
    dtype = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype  # eager's kernels' own
    row = ((-1,), True)

    def widen(x: Any, x_dtype: torch.dtype) -> Any:  # into the dtype the kernel computes in
        return x if x_dtype == dtype else emit(aten._to_copy.default, (x,), dtype, dtype=dtype)

    def done(x: Any) -> Any:  # the output rounded once, as eager's kernel writes it
        return x if out_dtype == dtype else emit(aten._to_copy.default, (x,), out_dtype, dtype=out_dtype)

    target = node.target
    if target == NLL_BACKWARD:  # −dy (÷ the targets counted) at each row's target class, unless ignored
        grad, classes, total = inputs
        reduction, ignored = node.args[4], node.args[5]
        value = emit(aten.neg.default, (widen(grad, val(node.args[0]).dtype),), dtype)
        if reduction == REDUCTIONS_BY_MEAN:
            value = emit(aten.div.Tensor, (value, widen(total, val(node.args[6]).dtype)), dtype)
        column = emit(torch.ops.prims.iota.default, (), torch.int64)
        hit = emit(aten.logical_and.default, (emit(aten.eq.Tensor, (column, classes), torch.bool),
                                              emit(aten.ne.Scalar, (classes, ignored), torch.bool)), torch.bool)
        return done(emit(aten.where.ScalarOther, (hit, value, 0.0), dtype))
    if target in (aten._softmax.default, aten._log_softmax.default):
        x = widen(inputs[0], val(node.args[0]).dtype)
        shifted = emit(aten.sub.Tensor, (x, emit(aten.amax.default, (x, *row), dtype)), dtype)
        exps = emit(aten.exp.default, (shifted,), dtype)
        total = emit(aten.sum.dim_IntList, (exps, *row), dtype)
        if target == aten._softmax.default:
            return done(emit(aten.div.Tensor, (exps, total), dtype))
        return done(emit(aten.sub.Tensor, (shifted, emit(aten.log.default, (total,), dtype)), dtype))
    grad = widen(inputs[0], val(node.args[0]).dtype)
    out = widen(inputs[1], val(node.args[1]).dtype)
    if target == aten._softmax_backward_data.default:  # y · (dy − Σ dy·y)
        dot = emit(aten.sum.dim_IntList, (emit(aten.mul.Tensor, (grad, out), dtype), *row), dtype)
        return done(emit(aten.mul.Tensor, (out, emit(aten.sub.Tensor, (grad, dot), dtype)), dtype))
    # log-softmax: dy − exp(y) · Σ dy
    total = emit(aten.sum.dim_IntList, (grad, *row), dtype)
    return done(emit(aten.sub.Tensor, (grad, emit(aten.mul.Tensor, (emit(aten.exp.default, (out,), dtype), total),
                                                  dtype)), dtype))
