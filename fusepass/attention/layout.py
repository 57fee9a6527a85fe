"""Where the kernel reads Q, K and V: a [B, H, N, D] strided view of the tensor the user's code started from.

From each matmul operand the pass walks up through views (transposes, reshapes, slices, broadcasts) and
through the copies that repeat K/V heads for grouped-query attention (``repeat_interleave``, or
``expand`` + ``reshape``), to the tensor they started from. Replaying the views on a meta tensor with
that tensor's strides gives the strided view the kernel reads; a repeat of heads becomes the group size
(query head ``h`` reads K/V head ``h // group``), so the kernel never reads a repeated copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

aten = torch.ops.aten

VIEW_OPS = {aten.transpose, aten.t, aten.permute, aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze,
            aten.squeeze, aten.expand, aten.slice, aten.select, aten.alias, aten.flatten, aten.unflatten,
            aten.contiguous, aten.clone, aten.detach, aten.lift_fresh_copy}


class Unsupported(Exception):
    """This attention cannot be rewritten; the message is the reason the report gives."""


@dataclass(frozen=True)
class OperandLayout:
    """The kernel's view of one operand: ``source.as_strided(size, stride, source.storage_offset() +
    offset)`` is [B, H_source, N, D]; ``group`` query heads share each of its heads."""

    size: tuple[int, int, int, int]
    stride: tuple[int, int, int, int]
    offset: int
    group: int

    def view(self, source: torch.Tensor) -> torch.Tensor:
        return source.as_strided(self.size, self.stride, source.storage_offset() + self.offset)

    @property
    def covers_source_exactly(self) -> bool:
        """Whether the view is the source's every element once, as a permutation of its dims would be
        (then a gradient can be written through the view with nothing left unwritten)."""
        dense = sorted((s, n) for s, n in zip(self.stride, self.size) if n > 1)
        expected = 1
        for s, n in dense:
            if s != expected:
                return False
            expected *= n
        return self.offset == 0


def _val(node: torch.fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _packet(node: object):
    return getattr(getattr(node, "target", None), "overloadpacket", None)


def _static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def _head_repeat(node: torch.fx.Node) -> tuple[torch.fx.Node, int, int] | None:
    """``(x, dim, group)`` if ``node`` repeats dimension ``dim`` of ``x`` ``group`` times, each entry
    ``group`` times in a row (``repeat_interleave``, or ``expand`` + ``reshape`` as Hugging Face's
    ``repeat_kv`` writes it); None otherwise."""
    if _packet(node) == aten.repeat_interleave and isinstance(node.args[1], int) and len(node.args) > 2:
        x = node.args[0]
        return x, node.args[2] % _val(x).dim(), node.args[1]
    if _packet(node) in (aten.reshape, aten.view, aten._unsafe_view) and _packet(node.args[0]) == aten.expand:
        expand = node.args[0]
        unsqueezed = expand.args[0]
        before, after = tuple(_val(unsqueezed).shape), tuple(_val(expand).shape)
        merged = tuple(_val(node).shape)
        for d in range(len(before) - 1):
            if before[d + 1] == 1 and after[d + 1] > 1 and after[:d + 1] == before[:d + 1] and \
                    merged == after[:d] + (after[d] * after[d + 1],) + after[d + 2:]:
                if _packet(unsqueezed) == aten.unsqueeze and unsqueezed.args[1] % len(before) == d + 1:
                    return unsqueezed.args[0], d, after[d + 1]
    return None


def _walk_up(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node], tuple[int, int] | None]:
    """The source tensor, the view ops from it to ``node`` (in order), and the head repeat among them
    (``(index of the first op after it, group)``) if any."""
    ops: list[torch.fx.Node] = []
    repeat = None
    while True:
        found = _head_repeat(node)
        if found is not None:
            if repeat is not None:
                raise Unsupported("K/V heads are repeated twice")
            x, dim, group = found
            repeat = (node, dim, group)
            ops.append(node)
            node = x
            continue
        if _packet(node) in VIEW_OPS and node.args and isinstance(node.args[0], torch.fx.Node):
            if _packet(node) in (aten.clone, aten.contiguous) and node.kwargs.get("memory_format") not in (
                    None, torch.contiguous_format, torch.preserve_format):
                break
            ops.append(node)
            node = node.args[0]
            continue
        break
    ops.reverse()
    if repeat is None:
        return node, ops, None
    return node, ops, (ops.index(repeat[0]), repeat[1], repeat[2])


def _replay(node: torch.fx.Node, meta: torch.Tensor) -> torch.Tensor:
    """Apply one view op to a meta tensor that stands for the source's memory."""
    if _packet(node) in (aten.clone, aten.contiguous, aten.lift_fresh_copy, aten.detach, aten.alias):
        return meta  # the same values: read the original
    out = node.target(meta, *node.args[1:], **node.kwargs)
    if out._base is None:
        raise Unsupported(f"{node.target} of an operand copies it")
    return out


def operand_view(operand: torch.fx.Node) -> tuple[torch.fx.Node, torch.Tensor, int, int | None]:
    """The source node, a meta tensor with the operand's shape and the strides it has in the source's
    memory, and the head repeat (group, at which dim of the operand) if there is one."""
    source, ops, repeat = _walk_up(operand)
    val = _val(source)
    if not _static(val.shape):
        raise Unsupported("symbolic shapes")
    meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    group, group_dim = 1, None
    for i, op in enumerate(ops):
        if repeat is not None and i == repeat[0]:
            group, group_dim = repeat[2], repeat[1]
            continue  # read the unrepeated tensor; the group stands for the repeat
        if repeat is not None and i > repeat[0]:
            if _packet(op) not in (aten.transpose, aten.permute, aten.t):
                raise Unsupported("a view after repeating K/V heads")
            group_dim = _moved_dim(op, group_dim, meta.dim())
        meta = _replay(op, meta)
    return source, meta, group, group_dim


def _moved_dim(op: torch.fx.Node, dim: int, ndim: int) -> int:
    if _packet(op) == aten.permute:
        return [d % ndim for d in op.args[1]].index(dim)
    a, b = (op.args[1] % ndim, op.args[2] % ndim) if _packet(op) == aten.transpose else (0, 1)
    return b if dim == a else a if dim == b else dim


def canonical(meta: torch.Tensor, group: int, group_dim: int | None, batch: tuple[int, ...], heads: int
              ) -> OperandLayout:
    """Lay an operand of shape [*its batch, N, D] out as the kernel's [B, H_source, N, D].

    ``batch`` is the attention's batch shape (the matmul's broadcast batch); B = its first dim, H the
    product of the rest (``heads``). K/V heads shared by several query heads come from a head repeat
    (``group``) or from a size-1 or stride-0 head dimension (broadcast).
    """
    n, d = meta.shape[-2], meta.shape[-1]
    rank = len(batch)
    pad = rank - (meta.dim() - 2)
    if group_dim is not None:
        group_dim += pad
    meta = meta.reshape((1,) * pad + tuple(meta.shape)) if pad else meta
    if group_dim is not None:  # the unrepeated head dim has size H / group
        full = list(batch)
        full[group_dim] //= group
        meta = meta.expand(*full, n, d)
    else:
        meta = meta.expand(*batch, n, d)
    size, stride = list(meta.shape[:-2]), list(meta.stride()[:-2])
    b_size = size[0] if rank else 1
    b_stride = stride[0] if rank else 0
    head_sizes, head_strides = size[1:], stride[1:]
    # The head dims, outer to inner: merge into one, or recognise a broadcast inner dim as a group.
    h_size, h_stride, shared = 1, 0, 1
    for i, (s, st) in enumerate(zip(head_sizes, head_strides)):
        if s == 1:
            continue
        if st == 0 and (i + 1 == rank - 1 or all(x == 1 for x in head_sizes[i + 1:])):
            shared *= s  # the innermost varying head dim is broadcast: query heads share
            continue
        if st == 0:
            raise Unsupported("K/V broadcast over an outer head dimension")
        if h_size > 1 and h_stride != st * s:
            raise Unsupported("heads of an operand cannot be read as one strided dimension")
        h_size, h_stride = h_size * s, st
    if group_dim is not None and group_dim > 1 and any(x > 1 for x in head_sizes[group_dim:]):
        raise Unsupported("K/V heads repeated on a dimension that is not the innermost head dimension")
    total_group = shared * group
    if h_size * total_group != heads:
        raise Unsupported("K/V heads do not divide the query heads evenly")
    if b_stride == 0 and b_size > 1:
        raise Unsupported("an operand broadcast over the batch")
    return OperandLayout(size=(b_size, h_size, n, d), stride=(b_stride, h_stride, meta.stride(-2),
                                                            meta.stride(-1)),
                         offset=meta.storage_offset(), group=total_group)
