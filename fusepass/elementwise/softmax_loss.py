"""Softmaxes and the negative log-likelihood written out in the joint graph, before AOTAutograd's partition.

To the min-cut partitioner ``_softmax`` and ``_log_softmax`` are reductions it will not recompute: it keeps their
output, a full tensor, for the backward (a cross-entropy's log-probabilities over a 50257-word vocabulary, fp32 at
8192 rows: 1.6 GB written by the forward and read by the backward), and ``nll_loss_forward`` reads that tensor
for one value a row. Written out as eager's kernel computes them (in fp32 for half precision, the output rounded
once: ``reduction.expand``'s composites), the partitioner keeps the input and two row values and the backward's
row kernel recomputes the rest; the loss picks each row's target value of the input (``x[t] − max − log Σ exp``
is the log-probability picked), so the log-probabilities are never written: by a gather where the input is a tensor
(the row walk then reads the logits alone, not a class index beside each), in the walk of the row's maximum where a
kernel computes the input (gathered from, it would have to be written out).

Written out only where the elementwise pass fuses row reductions on a device that runs its kernels: in ATen ops
the written-out form is several kernels where eager runs one.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from fusepass.codegen.translate import CASTS, exact_widening, packet_of
from fusepass.elementwise.partition import is_pointwise
from fusepass.elementwise.reduction import REDUCTIONS_BY_MEAN, reduction_kind
from fusepass.fx_util import Writer, val

aten = torch.ops.aten
SOFTMAXES = (aten._softmax.default, aten._log_softmax.default)
ORDER_KEEPING_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
                       aten.unsqueeze.default)
# Written again as `aten.view`: a reshape copies what it cannot view, an _unsafe_view is one of a fresh tensor only.
WRITTEN_AS_VIEW = (aten._unsafe_view.default, aten.reshape.default)
NLL_FORWARD = aten.nll_loss_forward.default
REDUCTIONS_BY_SUM, NO_REDUCTION = 2, 0


@dataclass(frozen=True)
class _LogSoftmax:
    """A written-out log-softmax's parts: the input in the dtype it is computed in, the row maximum, and the log of
    the row's sum of exponentials."""

    x: torch.fx.Node
    maximum: torch.fx.Node
    log_total: torch.fx.Node


def _write_out_softmax(graph: torch.fx.Graph, node: torch.fx.Node) -> _LogSoftmax | None:
    w = Writer(graph, node)
    out_dtype = val(node).dtype
    dtype = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype  # eager's kernels' own
    dim = node.args[1]
    x = w.cast(node.args[0], dtype)
    maximum = w(aten.amax.default, x, [dim], True)
    shifted = w(aten.sub.Tensor, x, maximum)
    exps = w(aten.exp.default, shifted)
    total = w(aten.sum.dim_IntList, exps, [dim], True)
    if node.target == aten._softmax.default:
        node.replace_all_uses_with(w.cast(w(aten.div.Tensor, exps, total), out_dtype))
        graph.erase_node(node)
        return None
    log_total = w(aten.log.default, total)
    difference = w(aten.sub.Tensor, shifted, log_total)
    out = w.cast(difference, out_dtype)
    # Recomputed in the backward, never kept: in half precision the log-probabilities are as many bytes as the
    # logits, and the cut, finding them as cheap to keep, would have the forward write them.
    for part in {x, shifted, difference, out} - {node.args[0]}:
        part.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return _LogSoftmax(x, maximum, log_total)


def _nll_fits(node: torch.fx.Node) -> bool:
    """Rows of classes (2-d log-probabilities of a known class count, 1-d integer targets), no class weights, each
    output read by index."""
    if node.op != "call_function" or node.target != NLL_FORWARD or len(node.args) < 5:
        return False
    logp, target, weight, reduction = node.args[0], node.args[1], node.args[2], node.args[3]
    lp, t = val(logp), val(target)
    return (weight is None and reduction in (NO_REDUCTION, REDUCTIONS_BY_MEAN, REDUCTIONS_BY_SUM) and
            isinstance(lp, torch.Tensor) and lp.dim() == 2 and lp.dtype.is_floating_point and
            isinstance(lp.shape[1], int) and isinstance(t, torch.Tensor) and t.dim() == 1 and
            not t.dtype.is_floating_point and all(u.target is operator.getitem for u in node.users))


def _write_out_nll(graph: torch.fx.Graph, node: torch.fx.Node, log_softmax: _LogSoftmax | None) -> None:
    """Each row's −log-probability at its target class (0 where the target is ignored), then their mean or sum."""
    w = Writer(graph, node)
    logp, target, _, reduction, ignored = node.args[:5]
    dtype = val(logp).dtype
    counted = w(aten.ne.Scalar, target, ignored)

    def pick(x: torch.fx.Node) -> torch.fx.Node:
        """Each row's value of `x` at its target class: gathered (`_gathered_from`; an ignored target reads class
        0), else summed over the row where the class is the target."""
        source = _gathered_from(w, x)
        if source is not None:
            index = w(aten.unsqueeze.default, w(aten.where.ScalarOther, counted, target, 0), 1)
            return w.cast(w(aten.gather.default, source, 1, index), val(x).dtype)
        classes = w(aten.arange.start_step, 0, val(logp).shape[1], 1, dtype=torch.int64, device=val(logp).device)
        hit = w(aten.eq.Tensor, classes, w(aten.unsqueeze.default, target, 1))
        return w(aten.sum.dim_IntList, w(aten.where.ScalarOther, hit, x, 0.0), [-1], True)

    if log_softmax is not None:  # x[t] − max − log Σ exp: the log-probability, picked before it is computed
        picked_x = pick(log_softmax.x)
        picked = w.cast(w(aten.sub.Tensor, w(aten.sub.Tensor, picked_x, log_softmax.maximum), log_softmax.log_total),
                        dtype)
    else:
        picked = pick(logp)
    losses = w(aten.where.ScalarOther, counted, w(aten.neg.default, w(aten.squeeze.dim, picked, -1)), 0.0)
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # eager's accumulator
    if reduction == NO_REDUCTION:
        outputs = [losses, w(aten.full.default, [], 0.0, dtype=dtype, device=val(logp).device)]
    else:
        total = w(aten.sum.dim_IntList, w.cast(losses, acc), [0])
        count = w.cast(w(aten.sum.dim_IntList, counted, [0]), acc)
        loss = w(aten.div.Tensor, total, count) if reduction == REDUCTIONS_BY_MEAN else total
        outputs = [w.cast(loss, dtype), w.cast(count, dtype)]
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


def _gathered_from(w: Writer, x: torch.fx.Node) -> torch.fx.Node | None:
    """A tensor of `x`'s shape whose values `x` holds exactly: what lies below the views keeping the elements' order
    and the exact widening casts that `x` is, through the same views. None where a kernel may compute that (a
    pointwise op or a cast: gathered from, it would have to be written out) or the views do not view it."""
    source, views = x, []
    while source.op == "call_function" and isinstance(source.args[0], torch.fx.Node) and (
            source.target in ORDER_KEEPING_VIEWS or exact_widening(source)):
        if source.target in ORDER_KEEPING_VIEWS:
            views.append(source)
        source = source.args[0]
    if source.op == "call_function" and (is_pointwise(source) or packet_of(source.target) in CASTS):
        return None
    # Each view again on what the casts read (a reshape as a view: that it views is checked on the fake values
    # first; the casts' fresh output views where their input may not, and a reshape would then copy).
    views = [(aten.view.default if view.target in WRITTEN_AS_VIEW else view.target, view.args[1:])
             for view in reversed(views)]
    try:
        value = val(source)
        for target, args in views:
            value = target(value, *torch.fx.node.map_arg(args, val))
    except RuntimeError:
        return None
    for target, args in views:
        source = w(target, source, *args)
    return source


def write_out(joint: torch.fx.GraphModule, losses_only: bool = False) -> None:
    """Write out every softmax and log-softmax over the last dim, and every negative log-likelihood that fits;
    `losses_only` (an inference graph, where a softmax's kernel needs no written-out form): the log-softmaxes a
    negative log-likelihood reads and the likelihoods, whose row kernel then never writes the log-probabilities."""
    graph = joint.graph
    written: dict[torch.fx.Node, _LogSoftmax] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in SOFTMAXES and reduction_kind(node) == "softmax":
            users = list(node.users)
            if losses_only and not any(u.target == NLL_FORWARD for u in users):
                continue
            parts = _write_out_softmax(graph, node)
            if parts is not None:
                written.update({u: parts for u in users if u.target == NLL_FORWARD})
    for node in list(graph.nodes):
        if _nll_fits(node):
            _write_out_nll(graph, node, written.get(node))
    graph.lint()
    joint.recompile()

