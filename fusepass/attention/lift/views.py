"""Coordinates: where each value of the chain is read, as index expressions of the kernel's flat batch-head index,
query and key positions (`index.Idx`), through the views between it and the scores; and those expressions as code."""
from __future__ import annotations

import torch
import torch.fx

from fusepass.attention.index import Idx, merge
from fusepass.attention.layout import Unsupported
from fusepass.attention.lift.sizes import Sizes
from fusepass.attention.lift.values import Canon
from fusepass.fx_util import packet, val

aten = torch.ops.aten


def render(idx: Idx, canon: Canon) -> tuple[str, frozenset[str]]:
    """Code for an index and what it uses; the common batch/head splits render as ``b`` and ``h``."""
    H, B = canon.heads, canon.batch
    parts, uses = [], set()
    for t in idx.terms:
        if t.var == "f":
            if t.div == H and (t.mod is None or t.mod == B):
                parts.append(coef("b", t.coef))
                uses.add("b")
                continue
            if t.div == 1 and t.mod == H:
                parts.append(coef("h", t.coef))
                uses.add("h")
                continue
            uses.update(("b", "h"))
        elif t.var in ("q", "k"):
            uses.add(t.var)
            size = canon.q_len if t.var == "q" else canon.kv_len
            if t.div == 1 and (t.mod is None or t.mod >= size):
                parts.append(coef("q_idx" if t.var == "q" else "kv_idx", t.coef))
                continue
        else:
            uses.update(("b", "h", "q", "k"))
        parts.append(Idx((t,)).render({"f": f"(b * {H} + h)", "q": "q_idx", "k": "kv_idx"}))
    if idx.const or not parts:
        parts.append(str(idx.const))
    text = parts[0] if len(parts) == 1 else "(" + " + ".join(parts) + ")"
    return text, frozenset(uses)

def root_coords(node: torch.fx.Node) -> tuple[Idx, ...]:
    shape = tuple(val(node).shape)
    return Idx.var("f").split(shape[:-2]) + (Idx.var("q"), Idx.var("k"))

def bounds(uses: frozenset[str], canon: Canon, sizes: Sizes) -> str | None:
    terms = []
    if "q" in uses:
        terms.append(f"(q_idx < {sizes.text(canon.q_len)})")
    if "k" in uses:
        terms.append(f"(kv_idx < {sizes.text(canon.kv_len)})")
    return " & ".join(terms) if terms else None

def broadcast(coords: tuple[Idx, ...], shape: tuple, arg_shape: tuple) -> tuple[Idx, ...]:
    offset = len(shape) - len(arg_shape)
    return tuple(Idx.constant(0) if (size == 1 and shape[i + offset] != 1) else coords[i + offset]
                 for i, size in enumerate(arg_shape))


def view_coords(node: torch.fx.Node, coords: tuple[Idx, ...]) -> tuple[Idx, ...]:
    """The coordinates of a view's input, given those its output is read at."""
    kind = packet(node)
    source = node.args[0]
    in_shape, out_shape = tuple(val(source).shape), tuple(val(node).shape)
    ndim = len(in_shape)
    if kind in (aten.alias, aten.clone, aten.contiguous, aten.detach, aten.lift_fresh_copy):
        return coords
    if kind == aten.expand:
        return broadcast(coords, out_shape, in_shape)
    if kind in (aten.permute, aten.transpose, aten.t):
        if kind == aten.permute:
            order = [d % ndim for d in node.args[1]]
        elif kind == aten.transpose:
            order = list(range(ndim))
            a, b = node.args[1] % ndim, node.args[2] % ndim
            order[a], order[b] = order[b], order[a]
        else:
            order = list(range(ndim))[::-1]
        result = [None] * ndim
        for j, i in enumerate(order):
            result[i] = coords[j]
        return tuple(result)
    if kind == aten.slice:
        dim = (node.args[1] if len(node.args) > 1 else 0) % ndim
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        step = node.args[4] if len(node.args) > 4 else 1
        if start < 0:
            start += in_shape[dim]
        start = min(max(start, 0), in_shape[dim])
        return coords[:dim] + (coords[dim].scaled(step, start),) + coords[dim + 1:]
    if kind == aten.select:
        dim = node.args[1] % ndim
        index = node.args[2] % in_shape[dim]
        return coords[:dim] + (Idx.constant(index),) + coords[dim:]
    if not (all(isinstance(s, int) for s in in_shape) and all(isinstance(s, int) for s in out_shape)):
        raise Unsupported("a view with symbolic sizes in the score chain")
    return reshape_coords(coords, out_shape, in_shape)


def repeat_coords(node: torch.fx.Node, coords: tuple[Idx, ...]) -> tuple[Idx, ...] | None:
    """The coordinates of a ``repeat``'s input where each dim it repeats has size 1 there (a broadcast written as a
    copy: ``ids[None, None, :].repeat(batch, n, 1)``), the dims it adds in front dropped; None for a repeat that
    tiles a longer dim."""
    in_shape, repeats = tuple(val(node.args[0]).shape), tuple(node.args[1])
    lead = len(repeats) - len(in_shape)
    if any(r != 1 and size != 1 for r, size in zip(repeats[lead:], in_shape)):
        return None
    return tuple(Idx.constant(0) if size == 1 else coords[lead + i] for i, size in enumerate(in_shape))


def reshape_coords(coords: tuple[Idx, ...], out_shape: tuple[int, ...], in_shape: tuple[int, ...]
                    ) -> tuple[Idx, ...]:
    """view, reshape, unsqueeze, squeeze, flatten, unflatten keep row-major order: match the input and
    output dims in groups of equal size and, within each, merge the output coordinates and split them
    over the input dims (size-1 dims carry coordinate 0 and are set aside)."""
    out_dims = [j for j, s in enumerate(out_shape) if s != 1]
    in_dims = [i for i, s in enumerate(in_shape) if s != 1]
    result = [Idx.constant(0)] * len(in_shape)
    i = j = 0
    while i < len(in_dims) or j < len(out_dims):
        group_in, group_out = [in_dims[i]], [out_dims[j]]
        i, j = i + 1, j + 1
        size_in, size_out = in_shape[group_in[0]], out_shape[group_out[0]]
        while size_in != size_out:
            if size_in < size_out:
                group_in.append(in_dims[i])
                size_in *= in_shape[in_dims[i]]
                i += 1
            else:
                group_out.append(out_dims[j])
                size_out *= out_shape[out_dims[j]]
                j += 1
        flat = merge(tuple(coords[d] for d in group_out), tuple(out_shape[d] for d in group_out))
        for d, part in zip(group_in, flat.split(tuple(in_shape[d] for d in group_in))):
            result[d] = part
    return tuple(result)


def needs_int64_offsets(tensor: torch.Tensor) -> bool:
    """Whether element offsets into ``tensor`` can leave int32 (indices, positions and program ids are int32)."""
    return sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride())) >= 2 ** 31


def offset_term(index: str, stride: int, wide: bool, sizes: Sizes) -> str:
    index = f"({index}).to(tl.int64)" if wide else index
    return index if stride == 1 else f"{index} * {sizes.text(stride)}"


def coef(name: str, factor: int) -> str:
    return name if factor == 1 else f"{factor} * {name}"
