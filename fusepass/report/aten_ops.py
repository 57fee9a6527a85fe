"""The ops a compiled graph still runs as ATen kernels, each a hotspot: the report accounts for the whole step.

A matmul (kind "matmul") carries its FLOPs, and so its roofline time beside the rest; any other ATen op that
moves HBM bytes (kind "aten") says what kept it out of a fused kernel. Views, tuple elements, allocations,
host-side scalars and fusepass's own kernels are not listed, nor are pointwise ops the elementwise pass already
reported as declined.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from fusepass.elementwise import reduction
from fusepass.elementwise.kernel import PointwiseLauncher
from fusepass.elementwise.partition import decline_reason, is_pointwise
from fusepass.elementwise.pieces import is_piecewise
from fusepass.elementwise.reduction import held_whole, is_row_reduction
from fusepass.fx_util import op_name
from fusepass.report import attribution
from fusepass.report.ledger import is_matmul, matmul_operands, moves_no_bytes, op_bytes, op_flops, tensor_bytes
from fusepass.report.records import Hotspot
from fusepass.source import location

aten = torch.ops.aten
ALLOCATIONS = frozenset({aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty})
VIEWS = frozenset({aten.view, aten._unsafe_view, aten.expand, aten.permute, aten.transpose, aten.t, aten.unsqueeze,
                   aten.squeeze, aten.slice, aten.select, aten.alias, aten.detach, aten.as_strided})  # never copy
REDUCTIONS = frozenset({aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.var_mean,
                        aten.prod, aten.logsumexp, aten.argmax, aten.argmin, aten.any, aten.all, aten._softmax,
                        aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data})


def _shape(node: object) -> str:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return "×".join(map(str, val.shape)) if isinstance(val, torch.Tensor) else "?"


def _unfused_reduction(node: torch.fx.Node) -> str:
    """What sets a reduction apart from the row reductions fused kernels hold."""
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(x, torch.Tensor) and x.dim() > 0 and isinstance(dims, (int, list, tuple)):
        dims = [dims] if isinstance(dims, int) else list(dims)
        if [d % x.dim() for d in dims] == [x.dim() - 1]:
            return f"of {str(x.dtype).removeprefix('torch.')} values over the last dim"
    return "over other dims than the last"


def _reason(node: torch.fx.Node) -> str:
    if is_matmul(node):
        a, b = matmul_operands(node)
        return f"matmul {_shape(a)} @ {_shape(b)}: ATen's GEMM"
    if is_row_reduction(node):
        return "a row reduction with no neighbour fused beside it: one ATen kernel"
    if node.target == aten.native_layer_norm_backward.default and \
            not held_whole(node.args[1].meta["val"].shape[-1]):
        return (f"a layer norm's backward over rows longer than {reduction.PERSISTENT_MAX}: its weight's and bias's "
                "sums are fused only over rows held whole; ATen's two kernels")
    if node.target.overloadpacket in REDUCTIONS:
        return f"{op_name(node)} {_unfused_reduction(node)}: an ATen reduction"
    if is_pointwise(node):
        if _kernel_across_a_view(node):  # (the kernel unnamed: alike layers' reasons alike, as the summary groups)
            return ("a pointwise op whose fused neighbour lies across a view of another shape (a group holds one "
                    "shape): one ATen kernel")
        return "a pointwise op with no fusable neighbour: one ATen kernel"
    if is_piecewise(node):
        return f"{op_name(node)} with no fusable neighbour (or none of its shape): one ATen kernel"
    return f"no fusion rule for {op_name(node)}: an ATen kernel"


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (node.target is operator.getitem or (
        isinstance(node.target, torch._ops.OpOverload) and node.target.overloadpacket in VIEWS))


def _kernel_across_a_view(node: torch.fx.Node) -> bool:
    """Whether `node` reads a fused kernel's output through views that reshape it, or a fused kernel reads `node`'s
    so."""
    def kernel(n: torch.fx.Node) -> bool:
        return n.op == "call_function" and isinstance(n.target, PointwiseLauncher)

    for x in node.all_input_nodes:  # up through views to what they view
        reshaped = False
        while _is_view(x) and not kernel(x) and x.args:
            reshaped |= x.target is not operator.getitem
            x = x.args[0]
        if reshaped and kernel(x):
            return True
    readers = [(user, False) for user in node.users]  # down through views to their readers
    while readers:
        user, reshaped = readers.pop()
        if kernel(user) and reshaped:
            return True
        if _is_view(user):
            readers += [(reader, True) for reader in user.users]
    return False


def _views(node: torch.fx.Node, val: object) -> bool:
    """A split, unbind or chunk: every element a view of an input."""
    if not isinstance(val, (tuple, list)) or not val:
        return False
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    return all(isinstance(v, torch.Tensor) and any(isinstance(x, torch.Tensor) and torch._C._is_alias_of(v, x)
                                                   for x in inputs) for v in val)


def aten_ops(graph: torch.fx.Graph, phase: str, device: torch.device, pointwise_reported: bool) -> list[Hotspot]:
    """The hotspots of the ATen ops `graph` still runs on `device`; `pointwise_reported`: the elementwise pass ran
    and reported the pointwise ops it declined."""
    found = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                target.namespace != "aten" or target.overloadpacket in ALLOCATIONS | VIEWS:
            continue
        val = node.meta.get("val")
        if moves_no_bytes(node) or (isinstance(val, torch.Tensor) and val.device != device) or _views(node, val):
            continue
        if pointwise_reported and (is_pointwise(node) or is_piecewise(node)) and \
                decline_reason(node, device) is not None:
            continue
        moved = op_bytes(node)
        if isinstance(val, (tuple, list)):  # each element is written by this op
            moved += sum(tensor_bytes(v) for v in val)
        if moved == 0:
            continue
        hotspot = Hotspot(kind="matmul" if is_matmul(node) else "aten", phase=phase, location=location(node),
                          reason=_reason(node), ops=(op_name(node),), bytes=moved, flops=op_flops(node))
        found.append(hotspot)
        attribution.tag(node, hotspot)
    return found
