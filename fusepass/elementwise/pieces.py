"""Ops whose output is pieces of their inputs placed along one dim: ``cat`` (each input at its offset) and
``slice_backward`` (a slice's gradient: the gradient placed where the slice read, zeros elsewhere), as rotary
embeddings' ``rotate_half`` and its backward write them. In a fused group a piece is its input read at the output's
coordinates shifted back by the piece's start, where a guard on that dim's coordinate holds (`lower`); the loads
under a guard are masked by it, and the output takes the piece whose guard holds."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from fusepass.fx_util import packet, val

aten = torch.ops.aten
PIECEWISE = {aten.cat, aten.slice_backward}


@dataclass(frozen=True)
class Piece:
    input: torch.fx.Node | None  # None: zeros
    start: int  # where along the dim, in the output's coordinates
    stop: int


def is_piecewise(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and packet(node) in PIECEWISE


def pieces(node: torch.fx.Node) -> tuple[int, list[Piece]]:
    """(the dim, the pieces covering it, in order) of a piecewise node `piece_gap` admits."""
    out = val(node)
    if packet(node) == aten.cat:
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.dim()
        found, start = [], 0
        for x in node.args[0]:
            found.append(Piece(x, start, start + val(x).shape[dim]))
            start += val(x).shape[dim]
        return dim, found
    grad, sizes, dim, start, end = node.args[:5]
    dim, size = dim % out.dim(), sizes[dim % out.dim()]
    start, end = _clamped(start, size), _clamped(end, size)
    found = [Piece(None, 0, start)] if start else []
    found.append(Piece(grad, start, end))
    return dim, found + ([Piece(None, end, size)] if end < size else [])


def _clamped(index: int, size: int) -> int:
    return min(max(index + size if index < 0 else index, 0), size)


def piece_gap(node: torch.fx.Node) -> str | None:
    """Why a piecewise node cannot be lowered as its pieces, or None."""
    out = val(node)
    if not all(isinstance(s, int) for s in out.shape):
        return f"{packet(node).__name__} of symbolic sizes"
    if packet(node) == aten.cat:
        tensors = node.args[0]
        if any(not isinstance(x, torch.fx.Node) or val(x).dim() != out.dim() for x in tensors):
            return "cat of tensors of another rank than its result (an empty 1-d one)"
        return None
    step = node.args[5] if len(node.args) > 5 else 1
    return "slice_backward of a strided slice" if step != 1 else None
