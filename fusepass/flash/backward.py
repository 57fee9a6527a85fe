"""Backward flash-attention kernels over lifted score functions (after Triton's tutorial 06).

Two kernels, no atomics for dQ / dK / dV, launched in this order:

1. dQ: one program per (batch, query head, q block) first computes delta = rowsum(dO · O), the
   softmax-backward correction of each of its query rows, and stores it for the dK/dV kernel; then walks the
   kv blocks of its q block, at tiles of its own;
2. dK/dV: one program per (batch, kv head, kv block) walks, for each query head sharing the kv head, the
   q blocks the block map lists for its kv block, accumulating dK and dV in registers. Its tiles are laid
   out [kv, q] (pᵀ and d sᵀ are then the dots' operands as they are; transposing a tile in registers goes
   through shared memory). dV's product takes a tile's weights before dp is computed, so that fewer tiles
   are live at once (the kernel's registers are what bound its q chunks). At wide head dims (`BackwardConfigs.apart`)
   it runs twice, dV's launch and then dK's, each holding one accumulator for twice the kv rows.

dO may come in `out`'s dtype; the dots read it in the inputs' dtype. As in the forward, the scores, dQ = dS·K and
dK = dSᵀ·Q run at Q's and K's head dim in its parts (`tiles.load_parts`), dO·Vᵀ, dV and the row term dO·O at V's.

Both recompute the weights p = exp(x - m - log_sum) from the forward's lse and log_sum (m = lse - log_sum,
see FlashForwardExtra), then ds = p · (dp - delta) with dp = dO · Vᵀ, and push ds through the score chain
with `score_grad` (and `fill_grad` on PARTIAL tiles). Aux-tensor gradients accumulate in the dK/dV kernel
only; the dQ kernel calls the gradient functions with `aux_grad=None`.

Rows the forward recomputed over all tiles (FlashForwardExtra.fallback_rows) see all tiles here too: the dQ
kernel walks every kv block for a q block holding such a row, and flags the dK/dV kernel's q blocks that hold
one (its q blocks divide its own); the dK/dV kernel adds the flagged q blocks whose tile with its kv block is
EMPTY (the others are in its lists already). The flags come with the dQ kernel's launch, not one of their own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from fusepass.flash.blockmap import (EMPTY, FULL_LIST, PARTIAL_LIST, BlockMap, block_list, block_map_for, list_entry,
                                     row_lists, walk_start, walk_step)
from fusepass.flash.config import FlashConfig, backward_configs, head_block, head_blocks, launch_fitting, tile_width
from fusepass.flash.distance_table import add_distance_gradients, distance_gradients, distance_tables
from fusepass.flash.forward import LOG2E, FlashForwardExtra, has_partial_tiles
from fusepass.flash.tiles import (check_attention_inputs, dot, dropout_kept, dropout_seed, grouped_program,
                                  load_kv_tile, load_parts, load_tile, masked_scores, parts_product, parts_scores,
                                  q_block_program, store_parts, store_rows, tail_placement, tile_operands,
                                  tile_positions, truncated, zero_parts)
from fusepass.flash.score_mod import ScoreMod
from fusepass.runtime.sizes import cdiv


@triton.jit
def row_statistics(Lse, LogSum, bh, rows, Nq, EXACT_WEIGHTS: tl.constexpr):
    """Per query row, (m, a, c) that recompute the forward's weights as 2^((x - m) · log2(e) - a), times c where
    EXACT_WEIGHTS (cut to the inputs' dtype first: `_tile_weights`). Without it m is the row's max and a log2 of its
    denominator, c unused. With it, from the forward's (shift, ±1 / l) (`forward.FlashForwardExtra`): m = 0 and a the
    whole shift, or where the forward recomputed the row's block the exact way (its -1 / l) m its max and a = 0;
    c = 1 / l. Rows past Nq weigh 0."""
    row_in = rows < Nq
    lse = tl.load(Lse + bh * Nq + rows, mask=row_in, other=float("inf"))
    log_sum = tl.load(LogSum + bh * Nq + rows, mask=row_in, other=0.0)
    if EXACT_WEIGHTS:
        exact_form = log_sum < 0.0
        return tl.where(exact_form, lse, 0.0), tl.where(exact_form, 0.0, lse), tl.abs(log_sum)
    return lse - log_sum, log_sum * LOG2E, log_sum


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
def _tile_weights(s, stats, like, b, h, bh, rows, cols, block, Nq, Nk, aux, seed, dropout_p,
                  SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr, PARTIAL: tl.constexpr,
                  DROPOUT: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                  EXACT_WEIGHTS: tl.constexpr):
    """The weights of one tile from its products s and its rows' `stats` (`row_statistics`): (p, p_dropped,
    kept, dropped), and the index tiles the score functions saw, (q_idx, kv_idx, kv_in). `kept` (where KEEP held)
    stands in as kv_in on tiles that are not PARTIAL, `dropped` (dropout's kept weights) as kv_in without dropout.
    With EXACT_WEIGHTS, p is the forward's weights times their sum l: cut to `like`'s dtype as their product with V
    took them (`tiles.truncated`); p_dropped (dV's) the forward's weights themselves, divided by l (rounded once
    more by dV's product: from the uncut 2^(…) / l instead, dV took their cut's mean, ~2^-9 of a weight, as a bias:
    1.5x eager's distance for a value projection's weight under near-uniform weights, 1.0x as it is).

    The tiles are [q, kv], or [kv, q] when TRANSPOSED (the dK/dV kernel: its dots then take pᵀ and d sᵀ as
    they are, where transposing a tile in registers goes through shared memory); the score functions see
    the index tiles transposed alike. `block` is the tile's block along the axis the kernel walks (q when
    TRANSPOSED, else kv), of BLOCK positions, placed by TAIL (`tile_positions`; the caller loaded the tile's
    rows there); the other axis's positions are the program's."""
    if TRANSPOSED:
        _, q_idx, _ = tile_positions(block, Nq, BLOCK, TAIL)
        q_idx = q_idx[None, :]
        kv_idx = tl.minimum(cols, Nk - 1)[:, None]
        kv_in = (cols < Nk)[:, None]
        subtracted, shift2, scale = stats[0][None, :], stats[1][None, :], stats[2][None, :]
    else:
        q_idx = tl.minimum(rows, Nq - 1)[:, None]
        _, kv_idx, kv_in = tile_positions(block, Nk, BLOCK, TAIL)
        kv_idx, kv_in = kv_idx[None, :], kv_in[None, :]
        subtracted, shift2, scale = stats[0][:, None], stats[1][:, None], stats[2][:, None]
    if PARTIAL:
        x, kept = masked_scores(s, b, h, q_idx, kv_idx, kv_in, aux, SCORE, KEEP, FILL)
    else:
        kept = kv_in
        x = SCORE(s, b, h, q_idx, kv_idx, aux)
    p = tl.math.exp2(tl.math.fma(x - subtracted, LOG2E, -shift2))
    weights = p  # for dV's product
    if EXACT_WEIGHTS:
        p = truncated(p, like)  # the forward's weight times l (`_weights_gradient` takes the 1 / l)
        weights = p * scale
    if DROPOUT:
        if TRANSPOSED:
            dropped = dropout_kept(seed, dropout_p, ((bh * Nq + rows) * Nk)[None, :], cols[:, None])
        else:
            dropped = dropout_kept(seed, dropout_p, ((bh * Nq + rows) * Nk)[:, None], cols[None, :])
        p_dropped = tl.where(dropped, weights * (1.0 / (1.0 - dropout_p)), 0.0)
    else:
        dropped = kv_in
        p_dropped = weights
    return p, p_dropped, kept, dropped, q_idx, kv_idx, kv_in


@triton.jit
def _weights_gradient(s, p, dp, kept, dropped, delta, scale, b, h, q_idx, kv_idx, kv_in, aux, aux_grad, dropout_p,
                      SCORE_GRAD: tl.constexpr, FILL_GRAD: tl.constexpr, PARTIAL: tl.constexpr,
                      DROPOUT: tl.constexpr, TRANSPOSED: tl.constexpr, EXACT_WEIGHTS: tl.constexpr):
    """The score-side gradient d s of a tile, from its weights (see `_tile_weights`) and dp = dO · Vᵀ; with
    EXACT_WEIGHTS p is l times the weights and `scale` the rows' 1 / l, taken in the row term's fused multiply-add."""
    if EXACT_WEIGHTS:
        scaled_delta = delta * scale
        if TRANSPOSED:
            scale, scaled_delta = scale[None, :], scaled_delta[None, :]
        else:
            scale, scaled_delta = scale[:, None], scaled_delta[:, None]
    elif TRANSPOSED:
        delta = delta[None, :]
    else:
        delta = delta[:, None]
    if DROPOUT:
        dp = tl.where(dropped, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    if EXACT_WEIGHTS:
        ds = p * tl.math.fma(dp, scale, -scaled_delta)
    else:
        ds = p * (dp - delta)
    return _score_gradient(s, ds, kept, b, h, q_idx, kv_idx, kv_in, aux, aux_grad, SCORE_GRAD, FILL_GRAD,
                           PARTIAL)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_block, Q, Q2, DO, q_strides, do_strides, Lse, LogSum, Delta, b, h, bh,
               cols, Nq, Nk, aux, aux_grad, seed, dropout_p, SCORE: tl.constexpr, KEEP: tl.constexpr,
               FILL: tl.constexpr, SCORE_GRAD: tl.constexpr, FILL_GRAD: tl.constexpr, PARTIAL: tl.constexpr,
               DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DESCRIPTORS: tl.constexpr,
               Q_TAIL: tl.constexpr, EXACT_WEIGHTS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """Add one q tile's share to dK where DK and to dV where DV (dK and the kv block's K in the parts of their head
    dim, `tiles.load_parts`; `v` None without DK)."""
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    like = k[0]  # the inputs' dtype (V's too)
    q = load_parts(Q, Q2, b, h, q_block * BLOCK_M, Nq, q_strides, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D2, True,
                   DESCRIPTORS)
    do = load_tile(DO, b, h, q_block * BLOCK_M, Nq, do_strides, HEAD_DIM_V, BLOCK_M, BLOCK_DV, True, DESCRIPTORS)
    do = do.to(like.dtype)
    stats = row_statistics(Lse, LogSum, bh, rows, Nq, EXACT_WEIGHTS)
    # dV's product takes the weights before dp = dO · Vᵀ is computed: fewer tiles live at once.
    s = parts_scores(k, q)
    p, p_dropped, kept, dropped, q_idx, kv_idx, kv_in = _tile_weights(
        s, stats, like, b, h, bh, rows, cols, q_block, Nq, Nk, aux, seed, dropout_p, SCORE, KEEP, FILL, PARTIAL,
        DROPOUT, True, BLOCK_M, Q_TAIL, EXACT_WEIGHTS)
    if DV:
        dv = dot(p_dropped.to(do.dtype), do, dv)
    if DK:
        dp = dot(v, tl.trans(do))
        delta = tl.load(Delta + bh * Nq + rows, mask=rows < Nq, other=0.0)
        grad = _weights_gradient(s, p, dp, kept, dropped, delta, stats[2], b, h, q_idx, kv_idx, kv_in, aux,
                                 aux_grad, dropout_p, SCORE_GRAD, FILL_GRAD, PARTIAL, DROPOUT, True, EXACT_WEIGHTS)
        dk = parts_product(grad.to(like.dtype), q, dk)
    return dk, dv


@triton.jit
def _partial_walk_block(i, walk):
    """The q block of step i of the dK/dV kernel's PARTIAL loop (see there): entry i of its PARTIAL list; past
    the list, q block i - n_partial where its tile is EMPTY and it holds a recomputed row, else the block past
    the last. Read a step ahead, as `list_entry`."""
    n_partial, partial_blocks, flags, kinds, n_kv_blocks, n_q_blocks = walk
    listed = i < n_partial
    walked = i - n_partial
    in_walk = (not listed) & (walked < n_q_blocks)
    flag = tl.load(flags + walked, mask=in_walk, other=0)
    tile_kind = tl.load(kinds + walked.to(tl.int64) * n_kv_blocks, mask=in_walk, other=EMPTY)
    adds = (flag != 0) & (tile_kind == EMPTY)
    return tl.where(listed, list_entry(partial_blocks, n_partial, i), tl.where(adds, walked, n_q_blocks))


# dK/dV q blocks whose fallback flags the dK/dV kernel reads at once: every block up to N = 8192 at 64-row
# blocks, in one load.
FALLBACK_CHUNK = tl.constexpr(128)


@triton.jit
def _dkdv_walk(dk, dv, k, v, Q, Q2, DO, q_strides, do_strides, Lse, LogSum, Delta, b, kv_head, kv_block, cols,
               first_head, n_heads, n_q_heads, n_kv_blocks, n_q_blocks, Nq, Nk, group, q_lists, fallback_blocks,
               aux, aux_grad, seed, dropout_p, SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr,
               SCORE_GRAD: tl.constexpr, FILL_GRAD: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DESCRIPTORS: tl.constexpr,
               PARTIAL_TILES: tl.constexpr, FLAT: tl.constexpr, Q_TAIL: tl.constexpr, EXACT_WEIGHTS: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr):
    """dK (where DK) and dV (where DV) of the kv block after the tiles of `n_heads` query heads from `first_head` (of
    the kv head's group): with FLAT, heads that share one block map, in one walk over (query head, q block) pairs for
    each tile kind, the map's lists of the first head repeated for each head; else one head (n_heads 1). A loop over
    the heads around the two tile loops spilled 176 bytes under triton 3.6 at 4 heads, document mask, D128; in one
    walk, 56, and none once K and V came through descriptors (bench/kernel_resources.py). One head's walk is not
    flattened: its divisions and the wrap to the list's start raised MHA's spills (causal 40 → 64 bytes)."""
    first_h = kv_head * group + first_head
    first_bh = b.to(tl.int64) * n_q_heads + first_h
    if KEEP is None:
        # Without a mask only a last kv block reaching past Nk has PARTIAL tiles (all of them).
        n_partial = tl.where((kv_block + 1) * BLOCK_N > Nk, n_q_blocks, 0)
        n_full, full_blocks = n_q_blocks - n_partial, None
    else:
        count, index, map_batch_stride, map_head_stride, kind = q_lists
        map_bh = b * map_batch_stride + first_h * map_head_stride
        n_full, full_blocks = block_list(count, index, map_bh, kv_block, n_kv_blocks, n_q_blocks, FULL_LIST)
        n_partial, partial_blocks = block_list(count, index, map_bh, kv_block, n_kv_blocks, n_q_blocks,
                                               PARTIAL_LIST)
    # The PARTIAL loop runs before the FULL loop: in the other order the two pipelines spilled 128 bytes
    # under triton 3.6 at D128, causal (16 in this one; 112 and 8 for a window, 104 and 8 for a document
    # mask; bench/kernel_resources.py with triton 3.6).
    # q blocks holding rows the forward recomputed over all tiles (flagged by the dQ kernel) add their EMPTY
    # tiles. Where any of the walk's heads has any, the PARTIAL loop goes on past its list over every q block
    # for each head, and a block that adds nothing (not flagged, or its tile already listed) is walked as the
    # block past the last one, whose rows are out of range and weigh 0. A loop of its own, a third copy of the
    # tile body, raised the kernel's registers: under triton 3.6 it spilled more and the causal backward ran
    # slower than with the walk in this loop.
    n_walked = n_partial
    if KEEP is not None:
        any_flagged = 0
        for chunk in range(0, n_heads * n_q_blocks, FALLBACK_CHUNK):  # the walk's heads' flags lie in a row
            blocks = chunk + tl.arange(0, FALLBACK_CHUNK)
            flags = tl.load(fallback_blocks + first_bh * n_q_blocks + blocks, mask=blocks < n_heads * n_q_blocks,
                            other=0)
            any_flagged = tl.maximum(any_flagged, tl.max(flags, 0).to(tl.int32))
        n_walked = n_partial + any_flagged * n_q_blocks
        kinds = kind + (map_bh * n_q_blocks).to(tl.int64) * n_kv_blocks + kv_block
        walk = (n_partial, partial_blocks, fallback_blocks + first_bh * n_q_blocks, kinds, n_kv_blocks,
                n_q_blocks)
        next_block = _partial_walk_block(0, walk)
    if PARTIAL_TILES:
        for j in range(0, n_heads * n_walked):
            g, i = _head_and_step(j, n_walked, FLAT)
            if KEEP is None:
                q_block = i
            else:
                q_block = next_block
                following_head, following = _head_and_step(j + 1, n_walked, FLAT)
                # Past the walk's last step, step 0 of its last head (read, not used): no flags past the group's.
                following_head = tl.minimum(following_head, n_heads - 1)
                next_block = _partial_walk_block(following, _walk_of_head(walk, following_head))
            dk, dv = _dkdv_tile(dk, dv, k, v, q_block, Q, Q2, DO, q_strides, do_strides, Lse, LogSum, Delta, b,
                                first_h + g, first_bh + g, cols, Nq, Nk, aux, aux_grad, seed, dropout_p, SCORE,
                                KEEP, FILL, SCORE_GRAD, FILL_GRAD, True, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                                BLOCK_D, BLOCK_D2, BLOCK_DV, DESCRIPTORS, Q_TAIL, EXACT_WEIGHTS, DK, DV)
    first_block = walk_start(full_blocks, n_full, KEEP is not None)
    next_block = first_block
    for j in range(0, n_heads * n_full):
        g, i = _head_and_step(j, n_full, FLAT)
        q_block, next_block = walk_step(full_blocks, n_full, i, next_block, 0, KEEP is not None)
        if FLAT and KEEP is not None:  # the next head's walk starts the list again
            next_block = tl.where(i + 1 == n_full, first_block, next_block)
        dk, dv = _dkdv_tile(dk, dv, k, v, q_block, Q, Q2, DO, q_strides, do_strides, Lse, LogSum, Delta, b,
                            first_h + g, first_bh + g, cols, Nq, Nk, aux, aux_grad, seed, dropout_p, SCORE, KEEP,
                            FILL, SCORE_GRAD, FILL_GRAD, False, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D,
                            BLOCK_D2, BLOCK_DV, DESCRIPTORS, Q_TAIL, EXACT_WEIGHTS, DK, DV)
    return dk, dv


@triton.jit
def _head_and_step(j, steps, FLAT: tl.constexpr):
    """(head, step) of step j of a walk of `steps` steps per head (one head unless FLAT)."""
    if FLAT:
        head = j // steps
        return head, j - head * steps
    else:
        return 0, j


@triton.jit
def _walk_of_head(walk, g):
    """The PARTIAL walk of the g-th head after the walk's first (the same lists, the head's fallback flags)."""
    n_partial, partial_blocks, flags, kinds, n_kv_blocks, n_q_blocks = walk
    return n_partial, partial_blocks, flags + g * n_q_blocks, kinds, n_kv_blocks, n_q_blocks


@triton.jit
def _flash_backward_dkdv_kernel(
    Q, Q2, K, K2, V, DO, Lse, LogSum, Delta, DK_OUT, DV_OUT,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides,
    Nq, Nk, group, q_lists, fallback_blocks, aux, aux_grad, Seed, dropout_p,
    SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr, SCORE_GRAD: tl.constexpr,
    FILL_GRAD: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    DESCRIPTORS: tl.constexpr, HEAD_GROUP: tl.constexpr,
    PARTIAL_TILES: tl.constexpr, FLAT_HEADS: tl.constexpr, Q_TAIL: tl.constexpr, EXACT_WEIGHTS: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr,
):
    """dK where DK, dV where DV: both in one launch, or each in a launch of its own (`BackwardConfigs.apart`; V
    then None in dV's)."""
    # First kv blocks first: under a causal mask they hold the most tiles.
    kv_block, kv_head, b = grouped_program(HEAD_GROUP)
    seed = dropout_seed(Seed, DROPOUT)
    n_kv_blocks = tl.num_programs(0)
    n_q_blocks = tl.cdiv(Nq, BLOCK_M)
    n_q_heads = tl.num_programs(1) * group
    cols = kv_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k = load_parts(K, K2, b, kv_head, kv_block * BLOCK_N, Nk, k_strides, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_D2, True,
                   DESCRIPTORS)
    v = None
    if DK:  # dp = dO · Vᵀ is dK's only
        v = load_tile(V, b, kv_head, kv_block * BLOCK_N, Nk, v_strides, HEAD_DIM_V, BLOCK_N, BLOCK_DV, True,
                      DESCRIPTORS)
    dk = zero_parts(BLOCK_N, BLOCK_D, BLOCK_D2)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # The query heads reading this kv head: with FLAT_HEADS (GQA, their block maps one) in one walk, else a
    # walk each.
    if FLAT_HEADS:
        dk, dv = _dkdv_walk(dk, dv, k, v, Q, Q2, DO, q_strides, do_strides, Lse, LogSum, Delta, b, kv_head, kv_block,
                            cols, 0, group, n_q_heads, n_kv_blocks, n_q_blocks, Nq, Nk, group, q_lists,
                            fallback_blocks, aux, aux_grad, seed, dropout_p, SCORE, KEEP, FILL, SCORE_GRAD,
                            FILL_GRAD, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV,
                            DESCRIPTORS, PARTIAL_TILES, True, Q_TAIL, EXACT_WEIGHTS, DK, DV)
    else:
        for g in range(0, group):
            dk, dv = _dkdv_walk(dk, dv, k, v, Q, Q2, DO, q_strides, do_strides, Lse, LogSum, Delta, b, kv_head,
                                kv_block, cols, g, 1, n_q_heads, n_kv_blocks, n_q_blocks, Nq, Nk, group, q_lists,
                                fallback_blocks, aux, aux_grad, seed, dropout_p, SCORE, KEEP, FILL, SCORE_GRAD,
                                FILL_GRAD, DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D2,
                                BLOCK_DV, DESCRIPTORS, PARTIAL_TILES, False, Q_TAIL, EXACT_WEIGHTS, DK, DV)

    if DK:
        store_parts(DK_OUT + b.to(tl.int64) * dk_strides[0] + kv_head.to(tl.int64) * dk_strides[1], dk, cols, Nk,
                    dk_strides[2], dk_strides[3], HEAD_DIM, BLOCK_D, BLOCK_D2)
    if DV:
        store_rows(DV_OUT + b.to(tl.int64) * dv_strides[0] + kv_head.to(tl.int64) * dv_strides[1], dv, cols, Nk,
                   dv_strides[2], tl.arange(0, BLOCK_DV), dv_strides[3], HEAD_DIM_V)


@triton.jit
def _dq_tile(dq, q, do, stats, delta, kv_block, K, K2, V, k_strides, v_strides, b, h, kv_head, bh, rows,
             Nq, Nk, aux, seed, dropout_p, SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr,
             SCORE_GRAD: tl.constexpr, FILL_GRAD: tl.constexpr, PARTIAL: tl.constexpr, DROPOUT: tl.constexpr,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DESCRIPTORS: tl.constexpr, KV_TAIL: tl.constexpr,
             EXACT_WEIGHTS: tl.constexpr):
    """Add one kv tile's share to dQ (dQ and Q in the parts of their head dim, `tiles.load_parts`)."""
    cols, k, v = load_kv_tile(K, K2, V, b, kv_head, kv_block, Nk, k_strides, v_strides, HEAD_DIM, HEAD_DIM_V,
                              BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, PARTIAL, DESCRIPTORS, KV_TAIL)
    s = parts_scores(q, k)
    dp = dot(do, tl.trans(v))
    p, _, kept, dropped, q_idx, kv_idx, kv_in = _tile_weights(
        s, stats, v, b, h, bh, rows, cols, kv_block, Nq, Nk, aux, seed, dropout_p, SCORE, KEEP, FILL,
        PARTIAL, DROPOUT, False, BLOCK_N, KV_TAIL, EXACT_WEIGHTS)
    grad = _weights_gradient(s, p, dp, kept, dropped, delta, stats[2], b, h, q_idx, kv_idx, kv_in, aux, None,
                             dropout_p, SCORE_GRAD, FILL_GRAD, PARTIAL, DROPOUT, False, EXACT_WEIGHTS)
    return parts_product(grad.to(v.dtype), k, dq)


@triton.jit
def row_delta(out, do, residual, DELTA_BY_DOT: tl.constexpr):
    """delta_i = dO_i · O_i of a block of rows, the softmax backward's row term (`residual`: the forward's rounding
    residual of O, or None). With DELTA_BY_DOT (O in the inputs' dtype), as the dot dp_ij = dO_i · V_j is computed
    (the diagonal of dO · Oᵀ): where a row's weight is all on one key, its O is that key's V and dp - delta cancels
    exactly, as in eager's softmax backward; summed another way, the two roundings differ, and a saturated row's key
    gradient is that difference times |q| (q·kᵀ ~ 1e6: an exact 0 came out as 0.9)."""
    if DELTA_BY_DOT:
        square = dot(do, tl.trans(out))
        diagonal = tl.arange(0, out.shape[0])[:, None] == tl.arange(0, out.shape[0])[None, :]
        delta = tl.sum(tl.where(diagonal, square, 0.0), 1)
    else:
        delta = tl.sum(out.to(tl.float32) * do.to(tl.float32), 1)
    if residual is not None:
        # What rounding O left out (`keeps_residual`): without it a row's score gradients sum to dO · (O - round(O)),
        # not 0. A row whose weight is all on one key has O = V exactly, residual 0: the cancellation above stays.
        delta += tl.sum(residual.to(tl.float32) * do.to(tl.float32), 1)
    return delta


@triton.jit
def _flash_backward_dq_kernel(
    Q, Q2, K, K2, V, Out, Residual, DO, Lse, LogSum, Delta, DQ,
    q_strides, k_strides, v_strides, out_strides, do_strides, dq_strides,
    Nq, Nk, group, kv_lists, fallback_rows, fallback_blocks, aux, Seed, dropout_p,
    SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr, SCORE_GRAD: tl.constexpr,
    FILL_GRAD: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    DESCRIPTORS: tl.constexpr, DKDV_BLOCK_M: tl.constexpr,
    HEAD_GROUP: tl.constexpr, PARTIAL_TILES: tl.constexpr, KV_TAIL: tl.constexpr, DELTA_BY_DOT: tl.constexpr,
    EXACT_WEIGHTS: tl.constexpr,
):
    n_q_blocks = tl.num_programs(0)
    q_block, h, b, bh = q_block_program(HEAD_GROUP)
    n_kv_blocks = tl.cdiv(Nk, BLOCK_N)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    kv_head = h // group
    seed = dropout_seed(Seed, DROPOUT)
    q = load_parts(Q, Q2, b, h, q_block * BLOCK_M, Nq, q_strides, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D2, True,
                   DESCRIPTORS)
    do = load_tile(DO, b, h, q_block * BLOCK_M, Nq, do_strides, HEAD_DIM_V, BLOCK_M, BLOCK_DV, True, DESCRIPTORS)
    out = load_tile(Out, b, h, q_block * BLOCK_M, Nq, out_strides, HEAD_DIM_V, BLOCK_M, BLOCK_DV, True, DESCRIPTORS)
    do = do.to(q[0].dtype)
    residual = None
    if Residual is not None:
        residual = load_tile(Residual, b, h, q_block * BLOCK_M, Nq, out_strides, HEAD_DIM_V, BLOCK_M, BLOCK_DV,
                             True, DESCRIPTORS)
    delta = row_delta(out, do, residual, DELTA_BY_DOT)
    tl.store(Delta + bh * Nq + rows, delta, mask=rows < Nq)  # for the dK/dV kernel, launched after this one
    stats = row_statistics(Lse, LogSum, bh, rows, Nq, EXACT_WEIGHTS)

    if KEEP is None:
        n_full, full_blocks = Nk // BLOCK_N, None
        n_partial, partial_blocks = n_kv_blocks - n_full, None
        n_all = 0
    else:
        n_full, full_blocks, n_partial, partial_blocks = row_lists(kv_lists, b, h, q_block, n_q_blocks,
                                                                   n_kv_blocks)
        # A q block holding a row the forward recomputed over all tiles walks every kv tile instead, in the
        # PARTIAL loop: in a loop of its own, a third copy of the tile body, ptxas took much longer on the kernel
        # (offline, triton 3.6; bench/NOTES.md).
        recomputed = tl.load(fallback_rows + bh * Nq + rows, mask=rows < Nq, other=0)
        n_all = tl.max(recomputed.to(tl.int32), 0) * n_kv_blocks
        n_full = tl.where(n_all > 0, 0, n_full)
        n_partial = tl.where(n_all > 0, 0, n_partial)
        # The dK/dV kernel's q blocks within this one: which hold such a row.
        sub_blocks = q_block * (BLOCK_M // DKDV_BLOCK_M) + tl.arange(0, BLOCK_M // DKDV_BLOCK_M)
        sub_flags = tl.max(tl.reshape(recomputed, (BLOCK_M // DKDV_BLOCK_M, DKDV_BLOCK_M)), 1)
        n_sub_blocks = tl.cdiv(Nq, DKDV_BLOCK_M)
        tl.store(fallback_blocks + bh * n_sub_blocks + sub_blocks, sub_flags, mask=sub_blocks < n_sub_blocks)

    dq = zero_parts(BLOCK_M, BLOCK_D, BLOCK_D2)
    next_block = walk_start(full_blocks, n_full, KEEP is not None)
    for i in range(0, n_full):
        kv_block, next_block = walk_step(full_blocks, n_full, i, next_block, 0, KEEP is not None)
        dq = _dq_tile(dq, q, do, stats, delta, kv_block, K, K2, V, k_strides, v_strides, b, h, kv_head, bh,
                      rows, Nq, Nk, aux, seed, dropout_p, SCORE, KEEP, FILL, SCORE_GRAD, FILL_GRAD, False,
                      DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, DESCRIPTORS, KV_TAIL,
                      EXACT_WEIGHTS)
    if PARTIAL_TILES:
        next_block = walk_start(partial_blocks, n_partial, KEEP is not None)
        for i in range(0, n_partial + n_all):  # one of the two is 0
            kv_block, next_block = walk_step(partial_blocks, n_partial, i, next_block, n_full, KEEP is not None)
            if KEEP is not None:
                kv_block = tl.where(n_all > 0, i, kv_block)
            dq = _dq_tile(dq, q, do, stats, delta, kv_block, K, K2, V, k_strides, v_strides, b, h, kv_head,
                          bh, rows, Nq, Nk, aux, seed, dropout_p, SCORE, KEEP, FILL, SCORE_GRAD, FILL_GRAD, True,
                          DROPOUT, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, DESCRIPTORS, KV_TAIL,
                          EXACT_WEIGHTS)

    store_parts(DQ + b.to(tl.int64) * dq_strides[0] + h.to(tl.int64) * dq_strides[1], dq, rows, Nq,
                dq_strides[2], dq_strides[3], HEAD_DIM, BLOCK_D, BLOCK_D2)


def backward_map(mod: ScoreMod, aux: tuple, extra: FlashForwardExtra, q: torch.Tensor, kv_len: int, block_m: int,
                 block_n: int, cols: bool) -> BlockMap:
    """The block map a backward kernel at block_m × block_n tiles reads (its cols lists where `cols`, else its rows
    lists): the forward's where that serves, else the cached map (built for this call where the mask reads tensors)."""
    forward_map = extra.block_map
    if forward_map is not None and forward_map.serves(block_m, block_n, cols):
        return forward_map
    batch, q_heads, q_len, _ = q.shape
    return block_map_for(mod, aux, batch, q_heads, q_len, kv_len, block_m, block_n, q.device)


def backward_launches(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, log_sum: torch.Tensor, fallback_rows: torch.Tensor | None, mod: ScoreMod,
                      aux: tuple, aux_grad: tuple | None, delta: torch.Tensor, grads: tuple, dropout_p: float,
                      seed: torch.Tensor | None, map_at: Callable[[FlashConfig, bool], BlockMap],
                      device: torch.device | None = None,
                      residual: torch.Tensor | None = None) -> Iterator[tuple[Any, tuple, tuple, dict]]:
    """(kernel, grid, arguments, keywords) of the dQ kernel's launch, then of the dK/dV kernel's: in that order,
    each map (`map_at` a kernel's config and whether it reads the cols lists, masks only) asked for just before
    its launch. `aux` includes the distance tables, `aux_grad` the gradients by distance; `lse` and `log_sum`
    contiguous. `device`: where the kernels will run, where the tensors are meta stand-ins (q's otherwise)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    configs = backward_configs(tile_width(head_dim, head_dim_v), q.dtype, mod.has_mask, device or q.device)
    assert not mod.has_mask or configs.dq.block_m % configs.dkdv.block_m == 0, \
        "a dQ q block flags whole dK/dV q blocks"
    qk_blocks, block_dv = head_blocks(head_dim), head_block(head_dim_v)
    dq, dk, dv = grads
    # Per (b, h) and dK/dV q block: whether it holds a row the forward recomputed (written by the dQ kernel).
    fallback_blocks = None if fallback_rows is None else torch.empty(
        batch * q_heads, cdiv(q_len, configs.dkdv.block_m), dtype=torch.int8, device=q.device)
    read_seed = seed if dropout_p > 0.0 else None

    def constants(config: FlashConfig) -> dict:
        return dict(SCORE=mod.score, KEEP=mod.keep, FILL=mod.fill, SCORE_GRAD=mod.score_grad,
                    FILL_GRAD=mod.fill_grad, DROPOUT=dropout_p > 0.0, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                    BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=qk_blocks[0], BLOCK_D2=qk_blocks[1],
                    BLOCK_DV=block_dv, HEAD_GROUP=config.head_group,
                    PARTIAL_TILES=has_partial_tiles(mod, kv_len, config.block_n), EXACT_WEIGHTS=residual is not None,
                    num_warps=config.num_warps,
                    num_stages=config.num_stages)

    config = configs.dq
    kv_lists = None
    if mod.has_mask:
        block_map = map_at(config, False)
        kv_lists = (block_map.rows.count, block_map.rows.index, *block_map.batch_head_strides)
    tiled = ((q, config.block_m, qk_blocks), (k, config.block_n, qk_blocks), (v, config.block_n, block_dv),
             (out, config.block_m, block_dv), (do, config.block_m, block_dv))
    operands, descriptors = tile_operands(
        tiled + (((residual, config.block_m, block_dv),) if residual is not None else ()), config.descriptors)
    qk_v_operands, (out_operand, do_operand, *residual_operand) = operands[:5], operands[5:]  # Q, Q2, K, K2, V
    yield (_flash_backward_dq_kernel, (cdiv(q_len, config.block_m), q_heads, batch),
           (*qk_v_operands, out_operand, *(residual_operand or [None]), do_operand, lse, log_sum, delta, dq,
            q.stride(), k.stride(), v.stride(), out.stride(), do.stride(), dq.stride(),
            q_len, kv_len, q_heads // kv_heads, kv_lists, fallback_rows, fallback_blocks, aux, read_seed, dropout_p),
           dict(DESCRIPTORS=descriptors, DKDV_BLOCK_M=configs.dkdv.block_m,
                KV_TAIL=tail_placement(kv_len, config.block_n, True), DELTA_BY_DOT=out.dtype == v.dtype,
                **constants(config)))

    config = configs.dkdv
    q_lists = None
    if mod.has_mask:
        block_map = map_at(config, True)
        q_lists = (block_map.cols.count, block_map.cols.index, *block_map.batch_head_strides, block_map.kind)
    operands, descriptors = tile_operands(
        ((q, config.block_m, qk_blocks), (k, config.block_n, qk_blocks), (v, config.block_n, block_dv),
         (do, config.block_m, block_dv)), config.descriptors)
    flat_heads = q_heads > kv_heads and (not mod.has_mask or block_map.batch_head_strides[1] == 0)
    qk_operands, (v_operand, do_operand) = operands[:4], operands[4:]
    # Apart: dV's launch (without V, and the aux gradients), then dK's.
    for computes_dk, computes_dv in ((False, True), (True, False)) if configs.apart else ((True, True),):
        yield (_flash_backward_dkdv_kernel, (cdiv(kv_len, config.block_n), kv_heads, batch),
               (*qk_operands, v_operand if computes_dk else None, do_operand, lse, log_sum, delta, dk, dv,
                q.stride(), k.stride(), v.stride(), do.stride(), dk.stride(), dv.stride(),
                q_len, kv_len, q_heads // kv_heads, q_lists, fallback_blocks, aux,
                aux_grad if computes_dk else None, read_seed, dropout_p),
               dict(DESCRIPTORS=descriptors, Q_TAIL=tail_placement(q_len, config.block_m, False), FLAT_HEADS=flat_heads,
                    DK=computes_dk, DV=computes_dv, **constants(config)))


def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, extra: FlashForwardExtra, mod: ScoreMod,
                             aux: tuple, aux_grad: tuple | None, *, dropout_p: float = 0.0,
                             seed: torch.Tensor | None = None,
                             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of `flash_attention_forward`; dk and dv summed over the query heads sharing a
    kv head. When `mod.has_aux_grad`, aux gradients accumulate into the tensors of `aux_grad`. `grads`: where
    to write them (tensors of q's, k's and v's shapes, any strides), else new tensors.

    `dropout_p` and `seed` (the tensor the seed was drawn into) must be the forward's. Each kernel reads the block
    map at its tiles: the forward's where it serves them (see `BlockMap.serves`), else the cached map.
    """
    check_attention_inputs(q, k, v)
    assert dropout_p == 0.0 or seed is not None, "dropout reads its seed from a tensor"
    assert do.shape == out.shape == (*q.shape[:3], v.shape[3]), \
        f"do {tuple(do.shape)}, out {tuple(out.shape)}, q {tuple(q.shape)}, v {tuple(v.shape)}"
    kv_len = k.shape[2]
    assert lse.shape == extra.log_sum.shape == q.shape[:3]
    aux = aux + distance_tables(mod, aux, q.device)
    by_distance = distance_gradients(mod, q.device) if mod.has_aux_grad else ()
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)  # written by the dQ kernel
    dq, dk, dv = grads or (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # Where the two kernels tile alike (dK/dV and dQ at 64 × 64 for D ≤ 64) and the forward's map serves neither,
    # they read one map: a mask that reads tensors is mapped on every call, two launches each.
    maps: dict[tuple[int, int], BlockMap] = {}

    def map_at(config: FlashConfig, cols: bool) -> BlockMap:
        tiles = (config.block_m, config.block_n)
        if tiles not in maps or not maps[tiles].serves(*tiles, cols):
            maps[tiles] = backward_map(mod, aux, extra, q, kv_len, *tiles, cols)
        return maps[tiles]

    for kernel, grid, args, keywords in backward_launches(
            do, q, k, v, out, lse.contiguous(), extra.log_sum.contiguous(), extra.fallback_rows, mod, aux,
            aux_grad + by_distance if mod.has_aux_grad else None, delta, (dq, dk, dv), dropout_p, seed, map_at,
            residual=extra.residual):
        launch_fitting(kernel, grid, *args, **keywords)
    if by_distance:
        add_distance_gradients(mod, aux, aux_grad, by_distance)
    return dq, dk, dv
