"""Forward flash-attention kernel (FlashAttention-2 online softmax) over lifted score functions.

One program computes BLOCK_M query rows of one (batch, query head): it walks the kv tiles the block map
lists for its q block (FULL tiles evaluate SCORE only, PARTIAL tiles `where(KEEP, SCORE, FILL)`), keeping a
running row max `m`, the running denominator `l` and the unnormalised output in fp32. Without a mask every
kv tile is FULL except a last, partly out-of-range one. See docs/flash-kernel-interface.md for the contract.

q·kᵀ runs over Q's and K's head dim, in two parts where two powers of two cover it in fewer columns than one
(`config.head_blocks`: 192 = 128 + 64, two products into one accumulator), P·V and the output at V's own head dim
(multi-head latent attention's values are narrower than its queries and keys).

Dots accumulate in fp32; fp32 inputs use input_precision="ieee" (no TF32) so fp32 results match eager
fp32, half inputs run on tensor cores (the P·V dot takes P cast to V's dtype).

Exponentials are base 2, of `fma(x, log2(e), -m2)` with `m2 = rn(m · log2(e))`: one fused multiply-add per
score (the product is not rounded), instead of a subtraction and a multiply. Every weight of a row then
carries the same factor 2^δ, δ the exponent of its max element (m · log2(e) - m2, computed exactly by another
fma; with a declared scale folded into the fma's constant, also the difference that constant's rounding
makes; when m moves, the running sums are rescaled by the difference of the rounded shifts so earlier
weights share the new δ), which cancels in the output and is taken out of `log_sum`. Rows whose max is not
TAME (|δ| could reach exp2's range: no finite score yet, a row masked with `finfo.min` throughout, or scores
of 2^24 and more) are recomputed in the form `exp2((x - m) · log2(e))`, exact at any magnitude, as are rows a
skipped tile might have touched.

The jit helpers it shares with the backward kernels (backward.py), which recompute the scores, are tiles.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from fusepass.flash.blockmap import BlockMap, block_map_for, capturing, row_lists, walk_start, walk_step
from fusepass.flash.config import (FlashConfig, forward_config, forward_warps, head_block, head_blocks, kind_block_m,
                                    launch_fitting, narrow_kv_tiles, tile_width)
from fusepass.flash.distance_table import distance_tables
from fusepass.flash.score_mod import ScoreMod
from fusepass.flash.tiles import (check_attention_inputs, dot, dropout_kept, dropout_seed, load_kv_tile, load_parts,
                                  masked_scores, parts_scores, q_block_program, store_rows, tail_placement,
                                  tile_operands, tile_positions, truncated)
from fusepass.runtime.sizes import cdiv

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# A skipped (masked-out) tile is exact only if exp(FILL - row max) vanishes next to the row's kept weights.
SKIP_MARGIN = tl.constexpr(-60.0)
# Row maxima below this magnitude take the fused exponent form (FUSED_EXP): m · log2(e) rounds by at most 1
# there, and a folded scale's constant (its relative rounding ~2^-24, times |m| < 2^24) moves the max element's
# exponent by a few units more, so 2^δ stays far inside float32's range. Up to 2^125 (where m · log2(e) would
# overflow) δ reached 2^100 and the weights inf (tests/kernels/test_flash.py, scores near 2^122).
TAME = tl.constexpr(2.0 ** 24)


@triton.jit
def _attend_tile(acc, m, l, excess, q, K, K2, V, k_strides, v_strides, kv_block, b, h, kv_head, q_idx, Nk, aux,
                 seed, dropout_p, drop_rows, SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr,
                 SCALE: tl.constexpr, PARTIAL: tl.constexpr, DROPOUT: tl.constexpr, FUSED_EXP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DESCRIPTORS: tl.constexpr, KV_TAIL: tl.constexpr,
                 EXACT_WEIGHTS: tl.constexpr):
    """Fold one kv tile into the running (acc, m, l, excess) of a q block (`excess`: see the fused form below;
    `EXACT_WEIGHTS`: the weights the backward recomputes, see `row_statistics`). `q` in the parts of its head dim
    (`tiles.load_parts`)."""
    cols, k, v = load_kv_tile(K, K2, V, b, kv_head, kv_block, Nk, k_strides, v_strides, HEAD_DIM, HEAD_DIM_V,
                              BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, PARTIAL, DESCRIPTORS, KV_TAIL)
    s = parts_scores(q, k)
    x_scale = 1.0  # the final scores are x · x_scale
    if PARTIAL:
        _, kv_idx, kv_in = tile_positions(kv_block, Nk, BLOCK_N, KV_TAIL)
        x, _ = masked_scores(s, b, h, q_idx, kv_idx[None, :], kv_in[None, :], aux, SCORE, KEEP, FILL)
    elif FUSED_EXP and SCALE is not None:
        # SCORE(s) = s · SCALE, folded into the exponent's fma (see ScoreMod.linear_scale): x stays s.
        x = s
        x_scale = SCALE
    else:
        x = SCORE(s, b, h, q_idx, cols[None, :], aux)
    x_max = tl.max(x, 1)
    tile_max = x_max * x_scale
    m_new = tl.maximum(m, tile_max)
    if FUSED_EXP and EXACT_WEIGHTS:
        # Shifts by whole powers of two (base 2: the ceiling of the max), so that every rescale is exact and each
        # weight is, as cut to V's dtype, cut(2^(x·c - M)) · 2^(M - shift) for the row's last shift M: the
        # weight the backward recomputes from M. Rows whose max is not tame shift by 0 and are recomputed.
        shift2 = tl.math.ceil(tl.where(tl.abs(m_new) < TAME, m_new, 0.0) * LOG2E)
        p = tl.math.exp2(tl.math.fma(x, x_scale * LOG2E, -shift2[:, None]))
        old_shift2 = tl.math.ceil(tl.where(tl.abs(m) < TAME, m, 0.0) * LOG2E)
        alpha = tl.where(m == float("-inf"), 0.0, _power_of_two(old_shift2 - shift2))
    elif FUSED_EXP:
        # Rows whose max is not tame shift by 0: their weights so far are 0 or garbage, and they are
        # recomputed (see the kernel's fallback).
        shift2 = tl.where(tl.abs(m_new) < TAME, m_new, 0.0) * LOG2E
        p = tl.math.exp2(tl.math.fma(x, x_scale * LOG2E, -shift2[:, None]))
        # Every weight of a row carries the factor 2^excess, excess the exponent of its max element: the
        # rounding of m · log2(e), and with the scale folded, how x · rn(scale · log2(e)) differs from
        # rn(x · scale) · log2(e) (~|m| · 2^-22). Taken where this tile holds the row's new max, exactly (fma).
        excess = tl.where(tile_max > m, tl.math.fma(x_max, x_scale * LOG2E, -shift2), excess)
        # The weights so far are 2^(x·log2(e) - old shift2): rescaled by the difference of the rounded
        # shifts, they share the new ones' factor 2^δ exactly. A row without a finite score so far has none.
        old_shift2 = tl.where(tl.abs(m) < TAME, m, 0.0) * LOG2E
        alpha = tl.where(m == float("-inf"), 0.0, tl.math.exp2(old_shift2 - shift2))
    else:
        # Rows without a finite score so far shift by 0, which keeps their weights and alpha at 0 instead of
        # exp(-inf - -inf) = NaN; a row that stays so gets l = 0 and out = 0 / 0 = NaN, as eager softmax.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        # Subtract before scaling by log2(e): finfo.min * log2(e) would overflow to -inf.
        p = tl.math.exp2((x - shift[:, None]) * LOG2E)
        alpha = tl.math.exp2((m - shift) * LOG2E)
    if EXACT_WEIGHTS:
        # The weights cut to V's dtype (toward zero: one bitwise and, no conversion back for their sum), and l their
        # sum: the output is made of weights that sum to 1, the same the backward recomputes.
        p = truncated(p, v)
    l = l * alpha + tl.sum(p, 1)
    weights = p.to(v.dtype)  # as their product with V takes them (exactly, where truncated)
    if DROPOUT:
        p = tl.where(dropout_kept(seed, dropout_p, drop_rows[:, None], cols[None, :]), p, 0.0)
        weights = p.to(v.dtype)
    acc = dot(weights, v, acc * alpha[:, None])
    return acc, m_new, l, excess


@triton.jit
def _power_of_two(e):
    """2^e for whole e, exactly (0 below float32's normal range)."""
    e = tl.minimum(tl.maximum(e, -127.0), 127.0)
    bits = (e.to(tl.int32) + 127) << 23
    return tl.where(e > -127.0, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _flash_forward_kernel(
    Q, Q2, K, K2, V, Out, Residual, Lse, LogSum, Fallback,
    q_strides, k_strides, v_strides, out_strides,
    Nq, Nk, group, kv_lists, aux, fill_bound, Seed, dropout_p,
    SCORE: tl.constexpr, KEEP: tl.constexpr, FILL: tl.constexpr, SCALE: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DESCRIPTORS: tl.constexpr,
    HEAD_GROUP: tl.constexpr, PARTIAL_TILES: tl.constexpr, KV_TAIL: tl.constexpr,
):
    n_q_blocks = tl.num_programs(0)
    q_block, h, b, bh = q_block_program(HEAD_GROUP)
    n_kv_blocks = tl.cdiv(Nk, BLOCK_N)
    seed = dropout_seed(Seed, DROPOUT)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < Nq
    offs_d = tl.arange(0, BLOCK_DV)
    # Positions past Nq are clamped for the score functions, which may load aux tensors by position.
    q_idx = tl.minimum(rows, Nq - 1)[:, None]
    drop_rows = (bh * Nq + rows) * Nk

    kv_head = h // group
    q = load_parts(Q, Q2, b, h, q_block * BLOCK_M, Nq, q_strides, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D2, True,
                   DESCRIPTORS)

    if KEEP is None:
        n_full, full_blocks = Nk // BLOCK_N, None
        n_partial, partial_blocks = n_kv_blocks - n_full, None
    else:
        n_full, full_blocks, n_partial, partial_blocks = row_lists(kv_lists, b, h, q_block, n_q_blocks,
                                                                   n_kv_blocks)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    excess = tl.zeros([BLOCK_M], tl.float32)
    next_block = walk_start(full_blocks, n_full, KEEP is not None)
    for i in range(0, n_full):
        kv_block, next_block = walk_step(full_blocks, n_full, i, next_block, 0, KEEP is not None)
        acc, m, l, excess = _attend_tile(acc, m, l, excess, q, K, K2, V, k_strides, v_strides, kv_block, b, h, kv_head,
                                         q_idx, Nk, aux, seed, dropout_p, drop_rows, SCORE, KEEP, FILL, SCALE, False,
                                         DROPOUT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_D2,
                                         BLOCK_DV, DESCRIPTORS, KV_TAIL, Residual is not None)
    if PARTIAL_TILES:
        next_block = walk_start(partial_blocks, n_partial, KEEP is not None)
        for i in range(0, n_partial):
            kv_block, next_block = walk_step(partial_blocks, n_partial, i, next_block, n_full, KEEP is not None)
            acc, m, l, excess = _attend_tile(acc, m, l, excess, q, K, K2, V, k_strides, v_strides, kv_block, b, h,
                                             kv_head, q_idx, Nk, aux, seed, dropout_p, drop_rows, SCORE, KEEP, FILL,
                                             SCALE, True, DROPOUT, True, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
                                             BLOCK_D2, BLOCK_DV, DESCRIPTORS, KV_TAIL, Residual is not None)

    # Rows recomputed over all tiles the exact way. EMPTY tiles were skipped; that is exact only for rows
    # whose max stands SKIP_MARGIN above every fill value: not for rows without a kept element, or with
    # scores as low as the fill (the comparison is written so that a NaN, -inf fill and -inf max, also
    # asks for it). And FUSED_EXP is only for rows whose max is tame.
    if KEEP is not None:
        fallback = (~(fill_bound - m < SKIP_MARGIN)) & row_in
    else:
        fallback = tl.zeros([BLOCK_M], tl.int1)
    fallback = fallback | ((~(tl.abs(m) < TAME)) & row_in)
    # A row whose max element holds all its weight (the others vanished beside it in l, which is then that
    # element's 2^excess) has an exact score gradient of 0, which eager's softmax backward gives exactly; here it
    # is dp - delta, a rounding of the output's (the weight 2^excess, not 1, leaves O an ulp off that key's V). In a
    # block where most rows are so (scores of 1e4 and more), those roundings are the block's whole gradient: its
    # saturated rows are recomputed the exact way, whose weight is 1 and output that V exactly, so that the
    # backward's delta (a dot as dp's) cancels. Elsewhere they are a rounding among the others' gradients.
    # With EXACT_WEIGHTS, l is that element's cut weight, the same in O and in the backward: none is needed.
    if Residual is None:
        weighted = row_in & (l > 0.0)  # rows without a kept key (l = 0) are the fallback's already
        saturated = (l == tl.math.exp2(excess)) & weighted
        most = 2 * tl.sum(saturated.to(tl.int32), 0) > tl.sum(weighted.to(tl.int32), 0)
        fallback = fallback | (saturated & most)
    recomputed = tl.max(fallback.to(tl.int32), 0) > 0
    if recomputed:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for kv_block in range(0, n_kv_blocks):
            acc, m, l, excess = _attend_tile(acc, m, l, excess, q, K, K2, V, k_strides, v_strides, kv_block, b, h,
                                             kv_head, q_idx, Nk, aux, seed, dropout_p, drop_rows, SCORE, KEEP, FILL,
                                             SCALE, True, DROPOUT, False, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D,
                                             BLOCK_D2, BLOCK_DV, DESCRIPTORS, KV_TAIL, Residual is not None)
        excess = tl.zeros([BLOCK_M], tl.float32)  # the exact form's weights carry no common factor
    if KEEP is not None:
        tl.store(Fallback + bh * Nq + rows, fallback.to(tl.int8), mask=row_in)

    if DROPOUT:
        l_out = l * (1.0 - dropout_p)  # kept weights are scaled by 1 / (1 - p)
    else:
        l_out = l
    Out_bh = Out + b.to(tl.int64) * out_strides[0] + h.to(tl.int64) * out_strides[1]
    o = acc / l_out[:, None]
    store_rows(Out_bh, o, rows, Nq, out_strides[2], offs_d, out_strides[3], HEAD_DIM_V)
    if Residual is not None:  # what rounding the output to its dtype left out, laid out as it
        residual = o - o.to(Out.dtype.element_ty).to(tl.float32)
        store_rows(Residual + b.to(tl.int64) * out_strides[0] + h.to(tl.int64) * out_strides[1], residual, rows, Nq,
                   out_strides[2], offs_d, out_strides[3], HEAD_DIM_V)
    if Residual is not None:
        # (the shift, ±1 / l), `row_statistics`: a block recomputed the exact way shifts by its maxima m
        exact_form = tl.zeros([BLOCK_M], tl.int1) | recomputed
        shift2 = tl.math.ceil(tl.where(tl.abs(m) < TAME, m, 0.0) * LOG2E)
        tl.store(Lse + bh * Nq + rows, tl.where(exact_form, m, shift2), mask=row_in)
        tl.store(LogSum + bh * Nq + rows, tl.where(exact_form, -1.0, 1.0) / l, mask=row_in)
    else:
        log_sum = tl.log(l) - excess * LN2
        tl.store(Lse + bh * Nq + rows, m + log_sum, mask=row_in)
        tl.store(LogSum + bh * Nq + rows, log_sum, mask=row_in)


@dataclass(frozen=True)
class FlashForwardExtra:
    """What the backward needs besides `out` and `lse`.

    `log_sum` is log(l), the log of each row's softmax denominator relative to its max `m`: the backward
    recomputes weights as exp(x - m - log_sum) with m = lse - log_sum, because exp(x - lse) loses log_sum
    when |lse| is huge (a row masked with finfo.min has lse == finfo.min in fp32, and would get weight 1
    instead of 1/Nk).

    Where the forward kept its output's residual (`keeps_residual`, its EXACT_WEIGHTS), the two row statistics
    are instead the ones the backward recomputes the forward's very weights from, P = cut(2^(x · log2(e) - M)) / l
    with cut to V's dtype toward zero (`tiles.truncated`, `backward.row_statistics`): "lse" holds the row's last
    shift M (a whole number) and "log_sum" 1 / l, l the sum of the cut weights. A block recomputed the exact way holds
    its maxima m in score units and -1 / l, its weights cut(e^(x - m)) / l.
    """

    log_sum: torch.Tensor  # [B, Hq, Nq] fp32
    fallback_rows: torch.Tensor | None  # [B, Hq, Nq] int8, 1 where the row was recomputed over all tiles
    block_map: BlockMap | None  # the forward's block map (the backward reuses it if its tiles match)
    # [B, Hq, Nq, Dv] as `out`: out's fp32 value minus out (`keeps_residual`), or None; the backward's row term reads
    # both
    residual: torch.Tensor | None = None


def forward_tile_configs(mod: ScoreMod, width: int, dtype: torch.dtype, device: torch.device
                         ) -> tuple[FlashConfig, ...]:
    """The tiles `flash_attention_forward` may take for `mod` before it has seen the mask's rows: the config,
    and half-width kv tiles where short rows would take them (see `narrow_kv_tiles`). `width`: the head dims'
    (`config.tile_width`)."""
    config = forward_config(width, dtype, mod.has_mask, device)
    if not mod.has_mask:
        return (config,)
    narrow = narrow_kv_tiles(config, None)
    return (narrow,) if mod.keep_reads_aux or narrow == config else (config, narrow)


def has_partial_tiles(mod: ScoreMod, kv_len: int, block_n: int) -> bool:
    """Whether a kernel at kv tiles `block_n` may meet PARTIAL tiles: with a mask, or without one where the last kv
    block reaches past kv_len. Kernels where none can have no PARTIAL loop: its pipeline alone spilled 48 bytes of
    the unmasked dK/dV kernel's 56 at D128 (sm_90, triton 3.6, bench/kernel_resources.py --mask none)."""
    return mod.has_mask or kv_len % block_n != 0


def forward_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod: ScoreMod, aux: tuple, config: FlashConfig,
                   block_map: BlockMap | None, out: torch.Tensor, lse: torch.Tensor, log_sum: torch.Tensor,
                   fallback_rows: torch.Tensor | None, seed: torch.Tensor | None, dropout_p: float,
                   residual: torch.Tensor | None = None) -> tuple[Any, tuple, tuple, dict]:
    """(kernel, grid, arguments, keywords) of the forward kernel's launch at `config`'s warps and stages and the map's
    tiles (`config`'s where no mask). `aux` includes the distance tables; `residual`: where to write the output's
    rounding residual (laid out as `out`), or None."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    block_m, block_n = (block_map.block_m, block_map.block_n) if mod.has_mask else (config.block_m,
                                                                                     config.block_n)
    qk_blocks, block_dv = head_blocks(head_dim), head_block(head_dim_v)
    kv_lists = (block_map.rows.count, block_map.rows.index, *block_map.batch_head_strides) \
        if mod.has_mask else None
    grid = (cdiv(q_len, block_m), q_heads, batch)
    operands, descriptors = tile_operands(
        ((q, block_m, qk_blocks), (k, block_n, qk_blocks), (v, block_n, block_dv)), config.descriptors)
    args = (*operands, out, residual, lse, log_sum, fallback_rows,  # operands: Q, Q2, K, K2, V
            q.stride(), k.stride(), v.stride(), out.stride(),
            q_len, kv_len, q_heads // kv_heads, kv_lists, aux, mod.fill_bound, seed if dropout_p > 0.0 else None,
            dropout_p)
    keywords = dict(SCORE=mod.score, KEEP=mod.keep, FILL=mod.fill, SCALE=mod.linear_scale, DROPOUT=dropout_p > 0.0,
                    HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_M=block_m, BLOCK_N=block_n,
                    BLOCK_D=qk_blocks[0], BLOCK_D2=qk_blocks[1], BLOCK_DV=block_dv, DESCRIPTORS=descriptors,
                    HEAD_GROUP=config.head_group, PARTIAL_TILES=has_partial_tiles(mod, kv_len, block_n),
                    KV_TAIL=tail_placement(kv_len, block_n, True),
                    num_warps=forward_warps(config, bool(mod.tables)), num_stages=config.num_stages)
    return _flash_forward_kernel, grid, args, keywords


def forward_outputs(q: torch.Tensor, mod: ScoreMod, out_dtype: torch.dtype | None, device: torch.device | str,
                    by_position: bool = False, backward: bool = False, head_dim_v: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The forward kernel's outputs for `q` and values of `head_dim_v` (q's where None), on `device`: out, lse,
    log_sum, the fallback rows (masks only) and, where a `backward` will read it, the output's rounding residual
    (`keeps_residual`). `out` is [B, H, N, Dv], laid out [B, N, H, Dv] where `by_position` (the kernel writes through
    its strides); the residual as `out`."""
    b, h, n, d = q.shape
    d = head_dim_v or d
    dtype = out_dtype or q.dtype

    def output() -> torch.Tensor:
        laid_out = torch.empty((b, n, h, d) if by_position else (b, h, n, d), dtype=dtype, device=device)
        return laid_out.transpose(1, 2) if by_position else laid_out

    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=device)
    log_sum = torch.empty_like(lse)
    fallback_rows = torch.empty(q.shape[:3], dtype=torch.int8, device=device) if mod.has_mask else None
    return output(), lse, log_sum, fallback_rows, output() if backward and keeps_residual(dtype) else None


def keeps_residual(out_dtype: torch.dtype) -> bool:
    """Whether a forward whose backward follows keeps its output's rounding residual, and weights the backward can
    recompute exactly (`EXACT_WEIGHTS`: whole shifts, l summed from the weights as cut for their product with V):
    in half precision, where the backward's row term delta = dO · O taken from the rounded output, or from weights
    other than the ones O was made of, would leave each row's score gradients summing to a rounding of the output's,
    not 0 (a key projection's bias gradient, exactly 0, is their sum over every row)."""
    return out_dtype in (torch.float16, torch.bfloat16)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod: ScoreMod, aux: tuple, *,
                            block_map: BlockMap | None = None, dropout_p: float = 0.0,
                            seed: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                            outputs: tuple | None = None, map_into: BlockMap | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, FlashForwardExtra]:
    """softmax(final scores) @ v. Returns (out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32, extra for backward).

    `block_map` defaults to the cached map of `mod` at the forward's tile size; its tile size, when given,
    is the one the kernel uses. `outputs`: where to write them, as `forward_outputs` allocates them;
    `map_into`: where to map a mask that reads tensors (`empty_block_map` at the forward's tiles). `seed`: with
    dropout, the one-element int64 tensor on q's device its seed was drawn into (the kernel reads it).
    """
    check_attention_inputs(q, k, v)
    assert 0.0 <= dropout_p < 1.0
    assert dropout_p == 0.0 or seed is not None, "dropout reads its seed from a tensor"
    aux = aux + distance_tables(mod, aux, q.device)
    batch, q_heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    width = tile_width(head_dim, v.shape[3])
    config = forward_config(width, q.dtype, mod.has_mask, q.device)
    if mod.has_mask and block_map is None:
        # A cached map (KEEP reads no tensors) says once how many tiles the rows list; another would cost a
        # wait on the device per call to ask, and while a CUDA graph captures (a cached map dropped since the
        # graph's warm-up call) none may be asked.
        wide_map = None if mod.keep_reads_aux or capturing(q.device) else \
            block_map_for(mod, aux, batch, q_heads, q_len, kv_len, config.block_m, config.block_n, q.device)
        config = narrow_kv_tiles(config, wide_map)
        # A map built per call serves the backward too: its kinds at the dK/dV kernel's q blocks.
        kinds_at = kind_block_m(config, width, q.dtype, q.device) if mod.keep_reads_aux else None
        block_map = block_map_for(mod, aux, batch, q_heads, q_len, kv_len, config.block_m, config.block_n,
                                  q.device, map_into, kinds_at)
    out, lse, log_sum, fallback_rows, residual = outputs or forward_outputs(q, mod, out_dtype, q.device,
                                                                            head_dim_v=v.shape[3])
    kernel, grid, args, keywords = forward_launch(q, k, v, mod, aux, config, block_map, out, lse, log_sum,
                                                  fallback_rows, seed, dropout_p, residual)
    launch_fitting(kernel, grid, *args, **keywords)
    return out, lse, FlashForwardExtra(log_sum, fallback_rows, block_map, residual)
