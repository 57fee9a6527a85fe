"""Row reductions: sums, means, maxima and minima over a tensor's last dimension, which a fused group may hold.

A group that holds one computes, per row of its root shape (the reductions' input shape), the pointwise ops
before the reduction over the whole row, the reduction, and the pointwise ops after it, reading the row value
broadcast along the row (``keepdim=True``) or writing it out: a norm, a softmax written by hand, a loss's
row sums, a backward's ``sum(dy * x, -1)`` beside its pointwise ops. Reductions over other dimensions (a
bias gradient's sum over the batch) stay ATen ops.
"""
from __future__ import annotations

import torch
import torch.fx

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


def reduction_kind(node: torch.fx.Node) -> str | None:
    """"sum", "mean", "amax" or "amin" where `node` reduces its floating input over the last dimension only."""
    kind = ROW_REDUCTIONS.get(node.target) if node.op == "call_function" else None
    if kind is None:
        return None
    source, out = node.args[0], val(node)
    if not isinstance(source, torch.fx.Node) or val(source) is None or out is None:
        return None
    x = val(source)
    if x.dim() == 0 or x.dtype not in FLOATING or out.dtype not in FLOATING:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if [d % x.dim() for d in dims] != [x.dim() - 1]:
        return None
    return kind


def keeps_dim(node: torch.fx.Node) -> bool:
    if len(node.args) > 2:
        return bool(node.args[2])
    return bool(node.kwargs.get("keepdim", False))


def reduced_input(node: torch.fx.Node) -> torch.fx.Node:
    return node.args[0]


def is_row_reduction(node: torch.fx.Node) -> bool:
    return reduction_kind(node) is not None
