"""An attention's plan: where the kernel reads Q, K and V, the lifted score chain, the checks that decline what the
kernels cannot compute exactly, and the spec the graph's op names."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from fusepass.attention.layout import OperandLayout, OperandView, Unsupported, broadcast_to, canonical, operand_view
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
    forward_tiles: FlashConfig | None = None  # the forward's, where the density model knows the mask's rows
    replay: bool = True  # replay launches as CUDA graphs where arguments repeat (`fusepass.runtime.replay`)

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


def _operand_view(node: torch.fx.Node, perm: tuple[int, ...] | None, batch: tuple[int, ...],
                  swap: bool = False, widen_from: torch.dtype | None = None) -> OperandView:
    """A matmul operand read as [*batch, N, D]: permuted (einsum), last two dims swapped (Kᵀ, V), broadcast."""
    view = operand_view(node, widen_from)
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


def plan(m: AttentionMatch, name: str, replay: bool, sizes_vary: bool = False
         ) -> tuple[AttentionSpec, list[torch.fx.Node], list[str]]:
    """The spec of the rewrite (`replay`: the option; `sizes_vary`: the attention is planned again at each new
    size, its score functions take sizes at run time), the graph values the op reads and the rewrite's features;
    raises ``Unsupported``."""
    shape = tuple(val(m.qk).shape)
    if not all(isinstance(s, int) for s in shape):
        raise Unsupported("symbolic shapes")
    batch, q_len, kv_len = shape[:-2], shape[-2], shape[-1]
    flat = math.prod(batch)
    if 0 in (flat, q_len, kv_len):
        raise Unsupported("an empty attention (a length of 0): its ops have nothing to move")
    pv_batch = _pv_batch(m)
    if math.prod(pv_batch) != flat:
        raise Unsupported("the matmul with V has another batch than the scores")
    v_view = _operand_view(m.values.right, m.values.right_perm, pv_batch, swap=True)
    # Q and K upcast for the scores (``q.float() @ k.float().T``) beside a V left as it was: the kernel reads them
    # as V's dtype, whose products its fp32 accumulation holds exactly (eager differs in summation order only).
    widen_from = val(v_view.source).dtype
    q_view = _operand_view(m.scores.left, m.scores.left_perm, batch, widen_from=widen_from)
    k_view = _operand_view(m.scores.right, m.scores.right_perm, batch, widen_from=widen_from)
    # The kernel's batch: the first of Q's leading dims (finer than the scores' where a reshape merged them),
    # or where K's heads are repeated, K's dims before them (bmm's [B·H] merges Q's batch and heads into one).
    B = q_view.meta.shape[0] if q_view.meta.dim() > 2 else 1
    if k_view.group_dim is not None:
        B = math.prod(k_view.meta.shape[:k_view.group_dim])
    H = flat // B
    q, k, v = (canonical(view, B, H) for view in (q_view, k_view, v_view))
    q_src, k_src, v_src = q_view.source, k_view.source, v_view.source
    if q.group != 1:
        raise Unsupported("queries shared across heads")
    dtypes = {val(q_src).dtype, val(k_src).dtype, val(v_src).dtype}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float16, torch.bfloat16):
        raise Unsupported(f"Q, K, V dtypes {sorted(map(str, dtypes))}")
    if k.group != v.group or k.size[1] != v.size[1]:
        raise Unsupported("K and V have different head layouts")
    if q.size[3] != k.size[3] or q.size[3] != v.size[3]:
        raise Unsupported(f"head dims differ: q {q.size[3]}, k {k.size[3]}, v {v.size[3]}")
    if q.size[3] not in HEAD_DIMS:
        raise Unsupported(f"head dim {q.size[3]} outside 16..256")
    canon = Canon(batch=B, heads=H, q_len=q_len, kv_len=kv_len)
    lifted = Lifter(m, canon, sizes_vary).lift()
    if any(lifted.aux_needs_grad) and torch.are_deterministic_algorithms_enabled():
        # Dynamo recompiles where the setting changes (it guards on it).
        raise Unsupported("deterministic algorithms are requested: the kernel would sum the gradient of a score "
                          "input (a learnable bias) with atomic adds, in no fixed order")
    spec = AttentionSpec(name=name, q=q, k=k, v=v, lifted=lifted, out_dtype=val(m.pv).dtype,
                         dropout_p=m.dropout_p, aux_strides=[tuple(val(a).stride()) for a in lifted.aux],
                         replay=replay)
    features = list(lifted.features)
    if k.group > 1:
        features.append("gqa")
    if q_len != kv_len:
        features.append("cross")
    if m.dropout_p > 0:
        features.append("dropout")
    return spec, [q_src, k_src, v_src], sorted(set(features))
