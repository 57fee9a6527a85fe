"""Where a fused kernel reads each value: affine maps from the group's root coordinates.

A fused group iterates over the coordinates ``c`` of its outputs (the root shape, rank ``r``). Every
value inside the group is read at coordinates that are an affine function of ``c``: a broadcast zeroes
rows, a permute reorders them, a slice scales and shifts one, a view that splits a dimension combines
several. A map is a tuple of rows, one per coordinate of the value, each ``r`` coefficients and a
constant. Views whose coordinates are not affine in ``c`` (a view that merges dimensions) return
``None``: the group ends there.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

Row = tuple[int, ...]
Map = tuple[Row, ...]

aten = torch.ops.aten


def identity(rank: int) -> Map:
    return tuple(tuple(1 if j == i else 0 for j in range(rank + 1)) for i in range(rank))


def _zero(rank: int) -> Row:
    return (0,) * (rank + 1)


def broadcast(m: Map, consumer_shape: Sequence, arg_shape: Sequence, rank: int) -> Map:
    """Coordinates of an argument broadcast into a consumer read at ``m``."""
    offset = len(consumer_shape) - len(arg_shape)
    rows = []
    for i, size in enumerate(arg_shape):
        j = i + offset
        broadcast_dim = isinstance(size, int) and size == 1 and not (
            isinstance(consumer_shape[j], int) and consumer_shape[j] == 1)
        rows.append(_zero(rank) if broadcast_dim else m[j])
    return tuple(rows)


def _static(shape: Sequence) -> bool:
    return all(isinstance(s, int) for s in shape)


def _scaled(row: Row, k: int) -> Row:
    return tuple(k * v for v in row)


def _plus(a: Row, b: Row) -> Row:
    return tuple(x + y for x, y in zip(a, b))


def _reshape(m: Map, in_shape: Sequence[int], out_shape: Sequence[int], rank: int) -> Map | None:
    """A view that only splits (or keeps) dimensions: each input coordinate is a linear combination of
    output coordinates. Size-1 dimensions carry coordinate 0 and are set aside first."""
    out_dims = [j for j, s in enumerate(out_shape) if s != 1]
    rows: list[Row] = [_zero(rank)] * len(in_shape)
    k = 0
    for i, size in enumerate(in_shape):
        if size == 1:
            continue
        product, group = 1, []
        while product < size and k < len(out_dims):
            group.append(out_dims[k])
            product *= out_shape[out_dims[k]]
            k += 1
        if product != size:
            return None  # this input dimension is merged with another: not affine
        row, stride = _zero(rank), 1
        for j in reversed(group):
            row = _plus(row, _scaled(m[j], stride))
            stride *= out_shape[j]
        rows[i] = row
    return tuple(rows) if k == len(out_dims) else None


def through_view(node: torch.fx.Node, m: Map, rank: int) -> Map | None:
    """Coordinates of a view's input, given the coordinates its output is read at; None if not affine."""
    target = getattr(node.target, "overloadpacket", None)
    source = node.args[0]
    in_shape = tuple(source.meta["val"].shape)
    out_shape = tuple(node.meta["val"].shape)
    if target == aten.expand:
        return broadcast(m, out_shape, in_shape, rank)
    if target in (aten.permute, aten.transpose, aten.t, aten.numpy_T):
        order = _permutation(node, len(in_shape))
        rows: list[Row] = [_zero(rank)] * len(in_shape)
        for j, i in enumerate(order):
            rows[i] = m[j]
        return tuple(rows)
    if target == aten.unsqueeze:
        dim = node.args[1] % len(out_shape)
        return m[:dim] + m[dim + 1:]
    if target == aten.squeeze:
        return _squeezed(m, in_shape, node, rank)
    if target == aten.slice:
        return _sliced(m, in_shape, node, rank)
    if target == aten.select:
        dim = node.args[1] % len(in_shape)
        if not _static(in_shape):
            return None
        index = node.args[2] % in_shape[dim]
        constant = _zero(rank)[:-1] + (index,)
        return m[:dim] + (constant,) + m[dim:]
    if target in (aten.alias, aten.detach):
        return m
    if target in (aten.view, aten.reshape, aten._unsafe_view, aten.flatten):
        if not (_static(in_shape) and _static(out_shape)):
            return m if in_shape == out_shape else None
        return _reshape(m, in_shape, out_shape, rank)
    return None


def _permutation(node: torch.fx.Node, ndim: int) -> list[int]:
    target = node.target.overloadpacket
    if target == aten.permute:
        return [d % ndim for d in node.args[1]]
    order = list(range(ndim))
    if target == aten.transpose:
        a, b = node.args[1] % ndim, node.args[2] % ndim
    else:  # t, numpy_T: reverse the (at most two) dimensions
        order.reverse()
        return order
    order[a], order[b] = order[b], order[a]
    return order


def _squeezed(m: Map, in_shape: Sequence, node: torch.fx.Node, rank: int) -> Map | None:
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = {d % len(in_shape) for d in dims}
    else:
        dims = set(range(len(in_shape)))
    removed = {d for d in dims if isinstance(in_shape[d], int) and in_shape[d] == 1}
    rows, k = [], 0
    for i in range(len(in_shape)):
        if i in removed:
            rows.append(_zero(rank))
        else:
            rows.append(m[k])
            k += 1
    return tuple(rows)


def _sliced(m: Map, in_shape: Sequence, node: torch.fx.Node, rank: int) -> Map | None:
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(in_shape)
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    size = in_shape[dim]
    if start is None:
        start = 0
    if not (isinstance(start, int) and isinstance(step, int) and isinstance(size, int)):
        return None
    if start < 0:
        start += size
    start = min(max(start, 0), size)
    row = _scaled(m[dim], step)
    row = row[:-1] + (row[-1] + start,)
    return m[:dim] + (row,) + m[dim + 1:]


# The views a group reads through as affine maps of its coordinates (`through_view`).
MAPPED_VIEWS = frozenset({aten.expand, aten.permute, aten.transpose, aten.t, aten.numpy_T, aten.unsqueeze,
                          aten.squeeze, aten.slice, aten.select, aten.view, aten.reshape, aten._unsafe_view,
                          aten.alias, aten.flatten, aten.detach})


def is_mapped_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in MAPPED_VIEWS


def strides_at(m: Map, strides: Sequence[int], rank: int) -> tuple[tuple[int, ...], int]:
    """A tensor with ``strides`` read at ``m``: its stride along each root dimension and a base offset."""
    root = tuple(sum(row[j] * s for row, s in zip(m, strides)) for j in range(rank))
    base = sum(row[-1] * s for row, s in zip(m, strides))
    return root, base
