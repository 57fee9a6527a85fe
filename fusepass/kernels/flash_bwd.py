"""Backward flash-attention kernels over lifted score functions (after Triton's tutorial 06).

Three kernels, no atomics for dQ / dK / dV:

1. preprocess: delta = rowsum(dO · O), the softmax-backward correction of each query row;
2. dK/dV: one program per (batch, kv head, kv block) walks, for each query head sharing the kv head, the
   q blocks the block map lists for its kv block, accumulating dK and dV in registers;
3. dQ: one program per (batch, query head, q block) walks the kv blocks of its q block.

Both recompute the weights p = exp(x - m - log_sum) from the forward's lse and log_sum (m = lse - log_sum,
see FlashForwardExtra), then ds = p · (dp - delta) with dp = dO · Vᵀ, and push ds through the score chain
with `score_grad` (and `fill_grad` on PARTIAL tiles). Aux-tensor gradients accumulate in the dK/dV kernel
only; the dQ kernel calls the gradient functions with `aux_grad=None`.

Rows the forward recomputed over all tiles (FlashForwardExtra.fallback_rows) see all tiles here too: the dQ
kernel walks every kv block for a q block holding such a row, and the dK/dV kernel adds the q blocks
holding such rows whose tile with its kv block is EMPTY (the others are in its lists already).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fusepass.attention.blockmap import EMPTY, FULL_LIST, PARTIAL_LIST, BlockMap, block_list, block_map_for
from fusepass.attention.score_mod import ScoreMod
from fusepass.kernels.flash_config import backward_config, head_block
from fusepass.kernels.flash_fwd import (
    LOG2E, FlashForwardExtra, check_attention_inputs, dropout_kept, load_rows, masked_scores, store_rows)


@triton.jit
def _delta_kernel(Out, DO, Delta, out_strides, do_strides, Nq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    q_block = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    out = load_rows(Out + b.to(tl.int64) * out_strides[0] + h.to(tl.int64) * out_strides[1], rows, Nq,
                    out_strides[2], offs_d, out_strides[3], HEAD_DIM, True)
    do = load_rows(DO + b.to(tl.int64) * do_strides[0] + h.to(tl.int64) * do_strides[1], rows, Nq,
                   do_strides[2], offs_d, do_strides[3], HEAD_DIM, True)
    bh = b.to(tl.int64) * tl.num_programs(1) + h
    delta = tl.sum(out.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh * Nq + rows, delta, mask=rows < Nq)


@triton.jit
def _row_stats(Lse, LogSum, Delta, bh, rows, Nq):
    """Per query row: the shift m and log2 of the denominator that recompute the forward's weights, and
    delta. Rows past Nq get m = +inf, hence weight 0."""
    row_in = rows < Nq
    lse = tl.load(Lse + bh * Nq + rows, mask=row_in, other=float("inf"))
    log_sum = tl.load(LogSum + bh * Nq + rows, mask=row_in, other=0.0)
    delta = tl.load(Delta + bh * Nq + rows, mask=row_in, other=0.0)
    return lse - log_sum, log_sum * LOG2E, delta


@triton.jit
def _score_gradient(s, ds, kept, b, h, q_idx, kv_idx, kv_in, aux, aux_grad, SCORE_GRAD: tl.constexpr,
                    FILL_GRAD: tl.constexpr, PARTIAL: tl.constexpr):
    """d final / d s · ds of a tile: SCORE's gradient where KEEP held, FILL's elsewhere inside the key range,
    nothing past it."""
    if PARTIAL:
        grad = SCORE_GRAD(s, tl.where(kept, ds, 0.0), b, h, q_idx, kv_idx, aux, aux_grad)
        if FILL_GRAD is not None:
            filled = (~kept) & kv_in
            grad += FILL_GRAD(s, tl.where(filled, ds, 0.0), b, h, q_idx, kv_idx, aux, aux_grad)
    else:
        grad = SCORE_GRAD(s, ds, b, h, q_idx, kv_idx, aux, aux_grad)
    return grad


@triton.jit
def _tile_gradients(q, k, v, do, shift, log2_sum, delta, visit, b, h, rows, cols, Nq, Nk, aux, aux_grad,
                    seed, dropout_p, SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr,
                    SCORE_GRAD: tl.constexpr, FILL_GRAD: tl.constexpr, PARTIAL: tl.constexpr,
                    DROPOUT: tl.constexpr):
    """The (dropped) weights and the score-side gradient of one tile: (p_dropped, d s).

    `visit` (a scalar) zeroes both for a tile that must not count (see the dK/dV fallback loop)."""
    q_idx = tl.minimum(rows, Nq - 1)[:, None]
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if PARTIAL:
        kv_in = (cols < Nk)[None, :]
        kv_idx = tl.minimum(cols, Nk - 1)[None, :]
        x, kept = masked_scores(s, b, h, q_idx, kv_idx, kv_in, aux, SCORE, KEEP, FILL)
    else:
        kv_in = None
        kept = None
        kv_idx = cols[None, :]
        x = SCORE(s, b, h, q_idx, kv_idx, aux)
    p = tl.math.exp2((x - shift[:, None]) * LOG2E - log2_sum[:, None])
    p = tl.where(visit, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    if DROPOUT:
        dropped = dropout_kept(seed, dropout_p, ((b.to(tl.int64) * tl.num_programs(1) + h) * Nq + rows) * Nk,
                               cols)
        p_dropped = tl.where(dropped, p, 0.0)
        dp = tl.where(dropped, dp / (1.0 - dropout_p), 0.0)
    else:
        p_dropped = p
    ds = tl.where(visit, p * (dp - delta[:, None]), 0.0)
    grad = _score_gradient(s, ds, kept, b, h, q_idx, kv_idx, kv_in, aux, aux_grad, SCORE_GRAD, FILL_GRAD,
                           PARTIAL)
    return p_dropped, grad
