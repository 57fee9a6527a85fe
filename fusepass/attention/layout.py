"""Where the kernel reads Q, K and V: a [B, H, N, D] strided view of the tensor the user's code started from.

From each matmul operand the pass walks up through views (transposes, reshapes, slices, broadcasts) and
through the copies that repeat K/V heads for grouped-query attention (``repeat_interleave``, or
``expand`` + ``reshape``), to the tensor they started from. Replaying the views on a meta tensor with
that tensor's strides gives the strided view the kernel reads; a repeat of heads becomes the group size
(query head ``h`` reads K/V head ``h // group``), so the kernel never reads a repeated copy.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx

from fusepass.codegen.translate import exact_widening
from fusepass.fx_util import packet, val

aten = torch.ops.aten

# Views, and copies that keep their input's values: read through to the tensor they started from.
REARRANGING_OPS = {aten.transpose, aten.t, aten.permute, aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze,
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

    @functools.lru_cache(maxsize=64)  # asked on every backward call
    def covers(self, numel: int) -> bool:
        """Whether the view is each element of a source of `numel` elements exactly once (then writing a
        gradient through it leaves nothing unwritten)."""
        if math.prod(self.size) != numel or self.offset != 0:
            return False
        dims = sorted((st, n) for st, n in zip(self.stride, self.size) if n > 1)
        reach = 0  # the furthest offset the dims so far reach, plus one
        for stride, size in dims:
            if stride < reach:
                return False  # overlapping
            reach = stride * (size - 1) + reach if reach else stride * (size - 1) + 1
        return True


def _runs(size: tuple[int, ...], stride: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (size, stride) dims of a strided view, innermost first, size-1 dims dropped and each dim merged into
    the one inside it where together they are one run (its stride the inner one's times its size)."""
    dims: list[tuple[int, int]] = []
    for n, s in sorted(((n, s) for n, s in zip(size, stride) if n != 1), key=lambda d: d[1]):
        if dims and s == dims[-1][1] * dims[-1][0]:
            dims[-1] = (dims[-1][0] * n, dims[-1][1])
        else:
            dims.append((n, s))
    return dims


def tile_one_source(layouts: list[OperandLayout], source: torch.Tensor) -> bool:
    """Whether `layouts`, views of one source without gaps, read each of its elements exactly once between them:
    their gradients are then one buffer laid out as the source, each written through its view, with nothing to
    zero and nothing to add. Decided for views as the parts of a split (Q, K and V of one projection, K and V of
    fewer heads) are: each a run of elements repeated at one period (the same nested, gapless dims above it),
    the views' runs side by side filling the period."""
    if _runs(tuple(source.shape), tuple(source.stride())) != [(source.numel(), 1)]:
        return False
    runs = [_runs(layout.size, layout.stride) for layout in layouts]
    if any(not dims or dims[0][1] != 1 for dims in runs) or len({tuple(dims[1:]) for dims in runs}) != 1:
        return False
    period = 0
    for offset, run in sorted((layout.offset, dims[0][0]) for layout, dims in zip(layouts, runs)):
        if offset != period:
            return False
        period += run
    outer = period
    for n, s in runs[0][1:]:  # the repeats: nested, gapless dims above the period
        if s != outer:
            return False
        outer *= n
    return outer == source.numel()


def _static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def _head_repeat(node: torch.fx.Node) -> tuple[torch.fx.Node, int, int] | None:
    """``(x, dim, group)`` if ``node`` repeats dimension ``dim`` of ``x`` ``group`` times, each entry
    ``group`` times in a row (``repeat_interleave``, or ``expand`` + ``reshape`` as Hugging Face's
    ``repeat_kv`` writes it); None otherwise."""
    # (a symbolic repeat count, a graph value, is found too: the dynamic path plans with it constant)
    if packet(node) == aten.repeat_interleave and isinstance(node.args[1], (int, torch.fx.Node)) \
            and len(node.args) > 2:
        x = node.args[0]
        return x, node.args[2] % val(x).dim(), node.args[1]
    if packet(node) in (aten.reshape, aten.view, aten._unsafe_view) and packet(node.args[0]) == aten.expand:
        expand = node.args[0]
        unsqueezed = expand.args[0]
        before, after = tuple(val(unsqueezed).shape), tuple(val(expand).shape)
        merged = tuple(val(node).shape)
        for d in range(len(before) - 1):
            if before[d + 1] == 1 and after[d + 1] > 1 and after[:d + 1] == before[:d + 1] and \
                    merged == after[:d] + (after[d] * after[d + 1],) + after[d + 2:]:
                if packet(unsqueezed) == aten.unsqueeze and unsqueezed.args[1] % len(before) == d + 1:
                    return unsqueezed.args[0], d, after[d + 1]
    return None


# Ops whose outputs are views of parts of their input (Q, K and V split from one projection): an element of their
# output is read through as a view of the input.
SPLITTING_OPS = {aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.tensor_split}


def _part_of_split(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one output of a split, chunk or unbind (`SPLITTING_OPS`)."""
    return node.op == "call_function" and node.target is operator.getitem and \
        isinstance(node.args[0], torch.fx.Node) and packet(node.args[0]) in SPLITTING_OPS


@dataclass(frozen=True)
class Scale:
    """An operand of the scores multiplied (``aten.mul``) or divided (``aten.div``) by a number: the score
    functions apply it to the scores instead, so the kernel reads the tensor before it (no pass of its own)."""

    op: object  # the op's packet
    by: float


def _scale(node: torch.fx.Node) -> Scale | None:
    """The scale ``node`` applies to its tensor: ``x * c`` or ``x / c`` for a number ``c`` that does not make it
    larger (1/√d, a temperature: eager's scaled tensor then overflows nowhere that the unscaled one does not), in
    x's floating dtype."""
    if packet(node) not in (aten.mul, aten.div) or len(node.args) != 2 or node.kwargs:
        return None
    x, c = node.args
    if not isinstance(x, torch.fx.Node) or isinstance(c, bool) or not isinstance(c, (int, float)) or \
            not val(x).dtype.is_floating_point or val(x).dtype != val(node).dtype:
        return None
    shrinks = 0 < abs(c) <= 1 if packet(node) == aten.mul else 1 <= abs(c) < math.inf
    return Scale(packet(node), float(c)) if shrinks else None


def _exact_widening(node: torch.fx.Node, source_dtype: torch.dtype | None) -> bool:
    """Whether ``node`` is an exact widening (`exact_widening`) of a ``source_dtype`` tensor."""
    return source_dtype is not None and exact_widening(node) and val(node.args[0]).dtype == source_dtype


def walk_up(node: torch.fx.Node, widen_from: torch.dtype | None = None, through_splits: bool = True,
            through_scales: bool = False
            ) -> tuple[torch.fx.Node, list[torch.fx.Node], tuple[int, int] | None, tuple[Scale, ...]]:
    """The source tensor, the view ops from it to ``node`` (in order), the head repeat among them
    (``(index of the first op after it, group)``) if any, and the scales between them (`Scale`). With
    `widen_from`, exact widening casts of tensors of that dtype are walked through as views are (the kernel reads
    the narrower tensor); with `through_splits`, an output of a split is (the split's input is the source); with
    `through_scales`, a product or quotient by a number (Q or K scaled before the product: the scores take it)."""
    ops: list[torch.fx.Node] = []
    scales: list[Scale] = []
    repeat = None
    while True:
        scale = _scale(node) if through_scales else None
        if scale is not None:
            scales.append(scale)
            node = node.args[0]
            continue
        if through_splits and _part_of_split(node):
            ops.append(node)
            node = node.args[0].args[0]
            continue
        if _exact_widening(node, widen_from):
            ops.append(node)
            node = node.args[0]
            continue
        found = _head_repeat(node)
        if found is not None:
            if repeat is not None:
                raise Unsupported("K/V heads are repeated twice")
            x, dim, group = found
            repeat = (node, dim, group)
            ops.append(node)
            node = x
            continue
        if packet(node) in REARRANGING_OPS and node.args and isinstance(node.args[0], torch.fx.Node):
            if packet(node) in (aten.clone, aten.contiguous) and node.kwargs.get("memory_format") not in (
                    None, torch.contiguous_format, torch.preserve_format):
                break
            ops.append(node)
            node = node.args[0]
            continue
        break
    ops.reverse()
    scales.reverse()
    if repeat is None:
        return node, ops, None, tuple(scales)
    return node, ops, (ops.index(repeat[0]), repeat[1], repeat[2]), tuple(scales)


def _replay(node: torch.fx.Node, meta: torch.Tensor) -> torch.Tensor | None:
    """Apply one view op to a meta tensor that stands for the source's memory; None if it would copy."""
    if packet(node) in (aten.clone, aten.contiguous, aten.lift_fresh_copy, aten.detach, aten.alias, aten.to,
                         aten._to_copy):
        return meta  # the same values (a cast only if an exact widening: `walk_up`): read the original
    if _part_of_split(node):
        split, part = node.args
        out = split.target(meta, *split.args[1:], **split.kwargs)[part]
        return out if out._base is not None else None
    out = node.target(meta, *node.args[1:], **node.kwargs)
    return out if out._base is not None else None


@dataclass
class OperandView:
    """An operand as the kernel will read it: its source, and a meta tensor with the source's strides whose
    last two dims are the operand's (N, D) and whose leading dims, flattened, are the operand's batch dims
    flattened. Those may be finer than the operand's own batch dims, where a reshape merged dims that no
    single stride describes (Bloom's ``[B, H] → [B·H]``): the kernel reads them separately."""

    source: torch.fx.Node
    meta: torch.Tensor
    batch: tuple[int, ...]  # the operand's own batch dims (the matmul sees these)
    group: int = 1  # a head repeat (repeat_interleave or expand + reshape) of ``group`` ...
    group_dim: int | None = None  # ... at this leading dim of ``meta``
    scales: tuple[Scale, ...] = ()  # products and quotients by numbers between the source and the operand

    @property
    def merged(self) -> bool:
        return tuple(self.meta.shape[:-2]) != self.batch

    def swap_last(self) -> "OperandView":
        return replace(self, meta=self.meta.transpose(-1, -2))

    def permute(self, perm: tuple[int, ...]) -> "OperandView":
        rank = len(perm)
        if tuple(perm[:rank - 2]) != tuple(range(rank - 2)):
            if self.merged or self.group_dim is not None:
                raise Unsupported("an einsum that reorders the batch of a reshaped operand")
            return OperandView(self.source, self.meta.permute(perm), tuple(self.meta.permute(perm).shape[:-2]),
                               scales=self.scales)
        return self.swap_last() if tuple(perm[rank - 2:]) == (rank - 1, rank - 2) else self


def operand_view(operand: torch.fx.Node, widen_from: torch.dtype | None = None, through_splits: bool = True,
                 through_scales: bool = False) -> OperandView:
    """Walk up from a matmul operand to its source, replaying the views on a meta tensor (and exact widening
    casts of `widen_from` tensors, splits where `through_splits`, products by numbers where `through_scales`: see
    `walk_up`)."""
    source, ops, repeat, scales = walk_up(operand, widen_from, through_splits, through_scales)
    value = val(source)
    if not _static(value.shape):
        raise Unsupported("symbolic shapes")
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    shape = tuple(value.shape)  # the logical shape so far (meta may be finer in its leading dims)
    group, group_dim = 1, None
    for i, op in enumerate(ops):
        out_shape = tuple(val(op).shape)
        if repeat is not None and i == repeat[0]:
            if tuple(meta.shape) != shape:
                raise Unsupported("K/V heads repeated after a reshape that copies")
            group, group_dim = repeat[2], repeat[1]
            shape = out_shape
            continue  # read the unrepeated tensor; the group stands for the repeat
        if group_dim is not None:
            if _batch_reshape(op, shape, out_shape):
                # [B, H] → [B·H] for bmm: meta keeps its dims, the repeated one apart (see `canonical`).
                shape = out_shape
                continue
            if packet(op) not in (aten.transpose, aten.permute, aten.t):
                raise Unsupported("a view after repeating K/V heads")
            if meta.dim() == len(shape):  # else only the last two dims may swap (`_replay_on_finer`)
                group_dim = _moved_dim(op, group_dim, meta.dim())
        if tuple(meta.shape) == shape:
            replayed = _replay(op, meta)
            if replayed is not None:
                meta, shape = replayed, out_shape
                continue
        meta = _replay_on_finer(op, meta, shape, out_shape)
        shape = out_shape
    return OperandView(source, meta, shape[:-2], group, group_dim, scales)


def _batch_reshape(op: torch.fx.Node, shape: tuple[int, ...], out_shape: tuple[int, ...],
                   finer: tuple[int, ...] | None = None) -> bool:
    """Whether ``op`` reshapes leading dims only, into dims that merge whole dims of ``finer`` (``shape``'s
    leading dims unless given)."""
    return out_shape[-2:] == shape[-2:] and packet(op) in (
        aten.reshape, aten.view, aten._unsafe_view, aten.flatten, aten.unflatten, aten.unsqueeze, aten.squeeze) \
        and math.prod(out_shape[:-2]) == math.prod(shape[:-2]) \
        and _nests(out_shape[:-2], shape[:-2] if finer is None else finer)


def _replay_on_finer(op: torch.fx.Node, meta: torch.Tensor, shape: tuple[int, ...], out_shape: tuple[int, ...]
                     ) -> torch.Tensor:
    """An op on an operand whose leading dims no stride merges: a reshape of its batch dims only, or a
    swap of its last two dims."""
    if _batch_reshape(op, shape, out_shape, tuple(meta.shape[:-2])):
        return meta
    if packet(op) in (aten.transpose, aten.t, aten.permute):
        rank = len(shape)
        order = list(range(rank))
        if packet(op) == aten.permute:
            order = [d % rank for d in op.args[1]]
        elif packet(op) == aten.transpose:
            a, b = op.args[1] % rank, op.args[2] % rank
            order[a], order[b] = order[b], order[a]
        else:
            order.reverse()
        if order[:rank - 2] == list(range(rank - 2)):
            return meta.transpose(-1, -2) if order[rank - 2:] == [rank - 1, rank - 2] else meta
    raise Unsupported(f"{op.target} of an operand whose batch dims were merged by a copying reshape")


def _nests(coarse: tuple[int, ...], fine: tuple[int, ...]) -> bool:
    """Whether every boundary between ``coarse`` dims is one between ``fine`` dims."""
    boundaries, product = set(), 1
    for size in fine:
        product *= size
        boundaries.add(product)
    product = 1
    for size in coarse:
        product *= size
        if product not in boundaries and size != 1:
            return False
    return True


def _moved_dim(op: torch.fx.Node, dim: int, ndim: int) -> int:
    if packet(op) == aten.permute:
        return [d % ndim for d in op.args[1]].index(dim)
    a, b = (op.args[1] % ndim, op.args[2] % ndim) if packet(op) == aten.transpose else (0, 1)
    return b if dim == a else a if dim == b else dim


def broadcast_to(view: OperandView, batch: tuple[int, ...]) -> OperandView:
    """The operand broadcast to the attention's batch dims, as the matmul broadcasts it."""
    if view.batch == batch:
        return view
    if view.merged:
        raise Unsupported("a reshaped operand broadcast over the batch")
    meta = view.meta
    pad = len(batch) - len(view.batch)
    meta = meta.reshape((1,) * pad + tuple(meta.shape))
    group_dim = None if view.group_dim is None else view.group_dim + pad
    target = list(batch)
    if group_dim is not None:
        target[group_dim] //= view.group  # the unrepeated dim stays its size
    return replace(view, meta=meta.expand(*target, *meta.shape[-2:]), batch=tuple(batch), group_dim=group_dim)


def canonical(view: OperandView, batch: int, heads: int) -> OperandLayout:
    """The operand as the kernel's [B, H_source, N, D] for an attention of ``batch`` × ``heads`` (whose flat
    index the operand's leading dims, flattened, also count).

    Each leading dim is (size, stride, repeat): a head repeat or a broadcast (stride 0) dim reads source
    index ``h // repeat``. The leading dims whose sizes multiply to ``batch`` must merge into one stride;
    the rest into one head dim with one repeat: the group of query heads per K/V head.
    """
    meta = view.meta
    dims = []
    for i, (size, stride) in enumerate(zip(meta.shape[:-2], meta.stride()[:-2])):
        repeat = view.group if i == view.group_dim else 1
        if stride == 0 and size > 1:
            size, repeat = 1, repeat * size
        dims.append([size, stride, repeat])
    b_dims, h_dims, product = [], [], 1
    for size, stride, repeat in dims:
        logical = size * repeat
        if product < batch:
            if repeat > 1 and logical > 1:
                raise Unsupported("an operand broadcast or repeated over the batch")
            if product * logical > batch:  # split this dim between batch and heads
                inner = product * logical // batch
                b_dims.append([size // inner, stride * inner, 1])
                h_dims.append([inner, stride, 1])
            else:
                b_dims.append([size, stride, 1])
            product *= logical
        else:
            h_dims.append([size, stride, repeat])
    b_size, b_stride = _merge(b_dims, "batch")[:2]
    h_size, h_stride, group = _merge(h_dims, "heads")
    if b_size != batch or h_size * group != heads:
        raise Unsupported("an operand's batch and heads do not match the scores'")
    return OperandLayout(size=(b_size, h_size, meta.shape[-2], meta.shape[-1]),
                         stride=(b_stride, h_stride, meta.stride(-2), meta.stride(-1)),
                         offset=meta.storage_offset(), group=group)


def _merge(dims: list[list[int]], what: str) -> tuple[int, int, int]:
    """Merge (size, stride, repeat) dims, outer to inner, into one; raises where no one stride does."""
    size, stride, repeat = 1, 0, 1
    for s, st, r in dims:
        if s == 1 and r == 1:
            continue
        if size == 1 and repeat == 1:
            size, stride, repeat = s, st, r
            continue
        if s == 1:  # a broadcast inner dim: the merged dim repeats each entry r more times
            if repeat != 1:
                raise Unsupported(f"{what} repeated twice")
            repeat = r
            continue
        if repeat != 1 or stride != st * s:
            raise Unsupported(f"the {what} of an operand cannot be read with one stride")
        size, stride, repeat = size * s, st, r
    return size, stride, repeat
