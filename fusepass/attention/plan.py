"""An attention's plan: where the kernel reads Q, K and V, the lifted score chain, the checks that decline what the
kernels cannot compute exactly, and the spec the graph's op names."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from fusepass.attention.layout import (OperandLayout, OperandView, Scale, Unsupported, broadcast_to, canonical,
                                       operand_view, tile_one_source)
from fusepass.attention.lift import Canon, Lifted, Lifter
from fusepass.attention.match import AttentionMatch
from fusepass.flash.config import FlashConfig
from fusepass.fx_util import val

HEAD_DIMS = range(16, 257)


@dataclass(frozen=True)
class AttentionSpec:
    """Everything static about one rewritten attention: where the kernel reads Q, K and V, the lifted score
    functions, dtypes and the kernels' options. The graph names it; `call.AttentionCall` holds what changes at run
    time."""


    name: str
    q: OperandLayout
    k: OperandLayout
    v: OperandLayout
    lifted: Lifted
    out_dtype: torch.dtype
    dropout_p: float
    aux_strides: list[tuple[int, ...]]
    # For Q, K and V, which of them writes its gradient (`gradient_owners`): its own buffer, or one it shares with
    # the others reading the same source, whose views tile it; the op returns the others' gradients empty.
    gradient_owners: tuple[int, int, int] = (0, 1, 2)
    # The output [B, H, N, D] laid out [B, N, H, D], each position's heads side by side: its one reader swaps heads
    # and positions (`.transpose(1, 2).contiguous()` before the output projection), and reads it contiguous.
    out_by_position: bool = False
    forward_tiles: FlashConfig | None = None  # the forward's, where the density model knows the mask's rows
    replay: bool = True  # replay launches as CUDA graphs where arguments repeat (`fusepass.runtime.replay`)
    sdpa: bool = True  # SDPA may run in its place where it computes the attention and is faster (`sdpa_floor`)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        batch, heads, q_len, _ = self.q.size
        return batch, heads * self.q.group, q_len, self.v.size[3]

    @property
    def fallback_shape(self) -> tuple[int, ...]:
        """Of the op's per-row flags of rows recomputed over all tiles: none without a mask."""
        return self.out_shape[:3] if self.lifted.functions.get("keep") else (0,)

    @property
    def passes_map(self) -> bool:
        """Whether the op returns the forward's block map: for a mask that reads tensors, mapped on every call,
        so that the backward need not map it again at the forward's tiles (other maps are cached)."""
        return bool(self.lifted.functions.get("keep")) and self.lifted.keep_reads_aux

    def kernel_aux(self, read: tuple[torch.Tensor, ...]) -> tuple:
        """The kernels' aux tuple: the tensors the score functions read (`read`), then the sizes they take at run
        time (`lift.sizes`); the kernels add the distance tables."""
        return read + self.lifted.sizes

    def kernel_aux_grad(self, aux_grad: tuple[torch.Tensor, ...]) -> tuple:
        """The aux gradients laid out as `kernel_aux`: a 0 in each size's place, which nothing accumulates into."""
        return aux_grad + (0,) * len(self.lifted.sizes)

    def aux_needs_grad(self, count: int) -> list[bool]:
        """Which of `count` aux inputs get a gradient: those the score functions read and a gradient flows to (the
        other graph values the replaced ops read, passed for them, get none)."""
        needs = list(self.lifted.aux_needs_grad)
        return needs + [False] * (count - len(needs))


def _operand_view(node: torch.fx.Node, perm: tuple[int, ...] | None, batch: tuple[int, ...], through_splits: bool,
                  swap: bool = False, widen_from: torch.dtype | None = None, through_scales: bool = False
                  ) -> OperandView:
    """A matmul operand read as [*batch, N, D]: permuted (einsum), last two dims swapped (Kᵀ, V), broadcast."""
    view = operand_view(node, widen_from, through_splits, through_scales)
    if perm is not None:
        view = view.permute(perm)
    if swap:
        view = view.swap_last()
    return broadcast_to(view, batch)


def _pv_batch(m: AttentionMatch) -> tuple[int, ...]:
    """The batch dims of the matmul with V, in [*batch, q, d] order (an einsum may write them otherwise)."""
    shape = tuple(val(m.pv).shape)
    if m.values.out_perm is None:
        return shape[:-2]
    canonical_out = [0] * len(shape)
    for i, p in enumerate(m.values.out_perm):
        canonical_out[p] = shape[i]
    return tuple(canonical_out[:-2])


def _read(m: AttentionMatch, flat: int, through_splits: bool
          ) -> tuple[list[OperandLayout], list[torch.fx.Node], int, tuple[Scale, ...]]:
    """Q's, K's and V's layouts, their sources and the kernel's batch, reading through splits or not, and the
    scales between Q's and K's sources and the scores' operands (the score functions apply them)."""
    shape = tuple(val(m.qk).shape)
    v_view = _operand_view(m.values.right, m.values.right_perm, _pv_batch(m), through_splits, swap=True)
    # Q and K upcast for the scores (``q.float() @ k.float().T``) beside a V left as it was: the kernel reads them
    # as V's dtype, whose products its fp32 accumulation holds exactly (eager differs in summation order only).
    widen_from = val(v_view.source).dtype
    q_view = _operand_view(m.scores.left, m.scores.left_perm, shape[:-2], through_splits, widen_from=widen_from,
                           through_scales=True)
    k_view = _operand_view(m.scores.right, m.scores.right_perm, shape[:-2], through_splits, widen_from=widen_from,
                           through_scales=True)
    # The kernel's batch: the first of Q's leading dims (finer than the scores' where a reshape merged them),
    # or where K's heads are repeated, K's dims before them (bmm's [B·H] merges Q's batch and heads into one).
    B = q_view.meta.shape[0] if q_view.meta.dim() > 2 else 1
    if k_view.group_dim is not None:
        B = math.prod(k_view.meta.shape[:k_view.group_dim])
    views = (q_view, k_view, v_view)
    return [canonical(view, B, flat // B) for view in views], [view.source for view in views], B, \
        q_view.scales + k_view.scales


def _layouts(m: AttentionMatch, flat: int
             ) -> tuple[list[OperandLayout], list[torch.fx.Node], tuple[int, int, int], int, tuple[Scale, ...]]:
    """`_read`'s layouts, sources, batch and scales, and which of Q, K and V writes each one's gradient
    (`gradient_owners`). Q, K and V split from one projection are read from it where their views tile it: their
    gradients are then one buffer, the projection's, where the split's backward would concatenate three; where
    they do not tile it (a part of the split used elsewhere), from the split's parts, as they were written."""
    layouts, sources, B, scales = _read(m, flat, through_splits=True)
    owners = gradient_owners(layouts, sources)
    unsplit = None
    for i, source in enumerate(sources):
        if owners.count(owners[i]) == 1:  # a gradient of its own: read through a split, it would zero the rest
            unsplit = unsplit or _read(m, flat, through_splits=False)
            if unsplit[1][i] is not source:
                layouts, sources, B, scales = unsplit
                return layouts, sources, gradient_owners(layouts, sources), B, scales
    return layouts, sources, owners, B, scales


def gradient_owners(layouts: list[OperandLayout], sources: list[torch.fx.Node]) -> tuple[int, int, int]:
    """For Q, K and V, which of them writes its gradient: the first of those reading one source whose views tile it
    (`tile_one_source`: one buffer for all, nothing zeroed or added), else itself."""
    owners = []
    for i, source in enumerate(sources):
        sharing = [j for j, s in enumerate(sources) if s is source]
        tiled = len(sharing) > 1 and tile_one_source([layouts[j] for j in sharing], val(source))
        owners.append(sharing[0] if tiled else i)
    return tuple(owners)


def plan(m: AttentionMatch, name: str, replay: bool, sizes_vary: bool = False, sdpa: bool = True
         ) -> tuple[AttentionSpec, list[torch.fx.Node], list[str]]:
    """The spec of the rewrite (`replay`, `sdpa`: the options; `sizes_vary`: the attention is planned again at each new
    size, its score functions take sizes at run time), the graph values the op reads and the rewrite's features;
    raises ``Unsupported``."""
    shape = tuple(val(m.qk).shape)
    if not all(isinstance(s, int) for s in shape):
        raise Unsupported("symbolic shapes")
    batch, q_len, kv_len = shape[:-2], shape[-2], shape[-1]
    flat = math.prod(batch)
    if 0 in (flat, q_len, kv_len):
        raise Unsupported("an empty attention (a length of 0): its ops have nothing to move")
    if math.prod(_pv_batch(m)) != flat:
        raise Unsupported("the matmul with V has another batch than the scores")
    (q, k, v), sources, owners, B, scales = _layouts(m, flat)
    q_src, k_src, v_src = sources
    H = flat // B
    if q.group != 1:
        raise Unsupported("queries shared across heads")
    dtypes = {val(q_src).dtype, val(k_src).dtype, val(v_src).dtype}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float16, torch.bfloat16):
        raise Unsupported(f"Q, K, V dtypes {sorted(map(str, dtypes))}")
    if k.group != v.group or k.size[1] != v.size[1]:
        raise Unsupported("K and V have different head layouts")
    if q.size[3] != k.size[3]:
        raise Unsupported(f"head dims differ: q {q.size[3]}, k {k.size[3]}")
    if q.size[3] not in HEAD_DIMS:
        raise Unsupported(f"head dim {q.size[3]} outside 16..256")
    # V may have a head dim of its own (multi-head latent attention: q·k over 192, values 128 wide): the kernels run
    # each product at its operands' width.
    if v.size[3] not in HEAD_DIMS:
        raise Unsupported(f"V's head dim {v.size[3]} outside 16..256")
    canon = Canon(batch=B, heads=H, q_len=q_len, kv_len=kv_len)
    lifted = Lifter(m, canon, sizes_vary, scales).lift()
    if any(lifted.aux_needs_grad) and torch.are_deterministic_algorithms_enabled():
        # Dynamo recompiles where the setting changes (it guards on it).
        raise Unsupported("deterministic algorithms are requested: the kernel would sum the gradient of a score "
                          "input (a learnable bias) with atomic adds, in no fixed order")
    spec = AttentionSpec(name=name, q=q, k=k, v=v, lifted=lifted, out_dtype=val(m.pv).dtype,
                         dropout_p=m.dropout_p, aux_strides=[tuple(val(a).stride()) for a in lifted.aux],
                         gradient_owners=owners, replay=replay, sdpa=sdpa)
    features = list(lifted.features)
    if k.group > 1:
        features.append("gqa")
    if q_len != kv_len:
        features.append("cross")
    if v.size[3] != q.size[3]:
        features.append("value_head_dim")
    if m.dropout_p > 0:
        features.append("dropout")
    return spec, [q_src, k_src, v_src], sorted(set(features))
