"""HBM bytes and flops: the ops a rewrite replaces, run one by one, versus the kernel that replaces them.

docs/report.md states every formula of this file; tests/report/test_ledger.py checks them by hand.

Ops one by one (``bytes_unfused``, ``flops``):
- an op reads each tensor input once and writes its output once; a view (its value aliases an input)
  moves nothing; a broadcast (stride-0) dimension counts once: a tensor's bytes are the elements it holds;
- dropout also writes its keep mask (one byte per element);
- a matmul is 2·M·N·K flops, a softmax 3 per element (max, exp and sum, divide: the seeds' count), any
  other op 1 per output element.
Their backward, as eager autograd runs it, for each op whose output a gradient flows to: a matmul
C = A·B computes dA = dC·Bᵀ and dB = Aᵀ·dC (each reads dC and the other operand, writes its gradient), a
softmax reads dY and Y and writes dX (4 flops per element), dropout reads dY and its mask and writes dX,
any other op moves what its forward moves.

A fused elementwise kernel reads each external input once and writes each output once (that is also its
ideal). The flash-attention kernels' own bytes, a model of their tiles, are the attention pass's
(fusepass/attention/cost.py).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from fusepass.fx_util import op_name, packet
from fusepass.report.records import Rewrite

aten = torch.ops.aten
MATMULS = frozenset({aten.matmul, aten.mm, aten.bmm})
BIASED_MATMULS = frozenset({aten.addmm, aten.baddbmm})  # input + mat1 · mat2
SOFTMAXES = frozenset({aten.softmax, aten._softmax})
DROPOUTS = frozenset({aten.dropout, aten.native_dropout})
# Ops reading, of their first argument, the elements their indices pick: one for each element they write.
INDEXED_READS = frozenset({aten.gather, aten.index_select, aten.embedding})
SOFTMAX_FLOPS = 3  # per element: max, exp and sum, divide
SOFTMAX_BACKWARD_FLOPS = 4  # per element: dY·Y, its row sum, subtract, times Y


# ---------------------------------------------------------------------------------------------------
# Ops one by one


def _int(size: object) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


def numel(val: object) -> int:
    return math.prod(_int(s) for s in val.shape) if isinstance(val, torch.Tensor) else 0


def tensor_bytes(val: object) -> int:
    """The bytes a tensor holds: its broadcast (stride-0) dimensions count once."""
    if not isinstance(val, torch.Tensor):
        return 0
    held = math.prod(_int(n) for n, s in zip(val.shape, val.stride()) if _int(s) != 0)
    return held * val.element_size()


def value_bytes(node: torch.fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))


def aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose memory ``node``'s value is a view of, if any."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    for arg in node.all_input_nodes:
        arg_val = arg.meta.get("val")
        if isinstance(arg_val, torch.Tensor) and torch._C._is_alias_of(val, arg_val):
            return arg
    return None


def moves_no_bytes(node: torch.fx.Node) -> bool:
    """Moves no bytes: a view of an input, or an element of a tuple an op returned."""
    return node.op == "call_function" and (node.target is operator.getitem or aliased_input(node) is not None)


def _dropout_mask_bytes(node: torch.fx.Node) -> int:
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return numel(node.meta.get("val")) if packet(node) in DROPOUTS and training else 0


def op_bytes(node: torch.fx.Node) -> int:
    """Bytes one op moves on its own: its tensor inputs read (of an indexed read's source, the elements it picks),
    its output written."""
    if moves_no_bytes(node):
        return 0
    read = sum(value_bytes(a) for a in node.all_input_nodes)
    if packet(node) in INDEXED_READS and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0].meta.get("val")
        read += numel(node.meta.get("val")) * source.element_size() - value_bytes(node.args[0])
    return read + value_bytes(node) + _dropout_mask_bytes(node)


def is_matmul(node: torch.fx.Node) -> bool:
    return packet(node) in MATMULS or packet(node) in BIASED_MATMULS


def matmul_operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A matmul's two factors."""
    return (node.args[1], node.args[2]) if packet(node) in BIASED_MATMULS else (node.args[0], node.args[1])


def _matmul_flops(node: torch.fx.Node) -> int:
    left = matmul_operands(node)[0].meta.get("val")
    return 2 * numel(node.meta.get("val")) * _int(left.shape[-1])


def op_flops(node: torch.fx.Node) -> int:
    if moves_no_bytes(node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return 0
    if is_matmul(node):
        return _matmul_flops(node)
    per_element = SOFTMAX_FLOPS if packet(node) in SOFTMAXES else 1
    return per_element * numel(node.meta.get("val"))


def unfused_bytes(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(op_bytes(n) for n in nodes)


def unfused_flops(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(op_flops(n) for n in nodes)


def fused_bytes(inputs: Iterable[torch.fx.Node], outputs: Iterable[torch.fx.Node]) -> int:
    return sum(value_bytes(n) for n in inputs) + sum(value_bytes(n) for n in outputs)


def _needs_grad(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and bool(node.meta.get("requires_grad", False))


@dataclass(frozen=True)
class BackwardOp:
    """One op eager autograd runs for the backward of a forward op."""

    name: str
    bytes: int
    flops: int
    matmul: bool = False


def backward_ops(node: torch.fx.Node) -> list[BackwardOp]:
    """What the backward of ``node`` runs, as eager autograd runs it; none for views and for ops no
    gradient flows to."""
    if not _needs_grad(node) or moves_no_bytes(node):
        return []
    out = value_bytes(node)
    if is_matmul(node):
        left, right = matmul_operands(node)
        flops = _matmul_flops(node)
        ops = [BackwardOp("aten.matmul", out + value_bytes(other) + value_bytes(operand), flops, matmul=True)
               for operand, other in ((right, left), (left, right)) if _needs_grad(operand)]
        if packet(node) in BIASED_MATMULS and _needs_grad(node.args[0]):  # the added input's gradient
            ops.append(BackwardOp(op_name(node), out + value_bytes(node.args[0]), numel(node.meta["val"])))
        return ops
    if packet(node) in SOFTMAXES:
        return [BackwardOp("aten._softmax_backward_data", 2 * out + value_bytes(node.args[0]),
                           SOFTMAX_BACKWARD_FLOPS * numel(node.meta["val"]))]
    if _dropout_mask_bytes(node):
        return [BackwardOp("aten.native_dropout_backward", op_bytes(node), numel(node.meta["val"]))]
    return [BackwardOp(op_name(node), op_bytes(node), numel(node.meta.get("val")))]


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``node``'s value lives in (through views)."""
    while (source := aliased_input(node)) is not None:
        node = source
    return node


def saved_for_backward(node: torch.fx.Node) -> tuple[list[torch.fx.Node], int]:
    """(values eager autograd keeps from the forward for ``node``'s backward, bytes of tensors it keeps that
    are no graph value). A lower bound: an op that keeps its own result (a softcap's tanh) is not counted."""
    if not _needs_grad(node) or moves_no_bytes(node):
        return [], 0
    if is_matmul(node):
        left, right = matmul_operands(node)
        return [other for operand, other in ((left, right), (right, left)) if _needs_grad(operand)], 0
    if packet(node) in SOFTMAXES:
        return [node], 0
    mask = _dropout_mask_bytes(node)
    if mask:
        return [], mask
    # A mask or a constant operand is read again by the backward.
    return [a for a in node.all_input_nodes if not _needs_grad(a) and isinstance(a.meta.get("val"), torch.Tensor)
            and a.meta["val"].dim() > 0], 0


def elementwise_rewrite(phase: str, location: str, ops: tuple[str, ...], compute_nodes: Sequence[torch.fx.Node],
                        inputs: Sequence[torch.fx.Node], outputs: Sequence[torch.fx.Node],
                        detail: dict, kind: str = "elementwise", extra_bytes: int = 0) -> Rewrite:
    """A fused pointwise group's record; `kind` "reduction" where it holds row reductions or column sums;
    `extra_bytes`: what its kernel moves past each input read once and each output written once (a walked row's
    second reads, column sums' partial sums)."""
    ideal = fused_bytes(inputs, outputs)
    flops = unfused_flops(compute_nodes)
    return Rewrite(kind=kind, phase=phase, location=location, ops=ops,
                   bytes_unfused=unfused_bytes(compute_nodes), bytes_fused=ideal + extra_bytes, bytes_ideal=ideal,
                   flops=flops, flops_fused=flops, detail=detail)
