"""The forward on sm_90 for the attention SDPA computes (unmasked or causal, the scores times a positive constant):
a Gluon kernel in FlashAttention-3's structure, where Triton's forward trails cuDNN's.

One warp loads Q, K and V by TMA into rings guarded by mbarriers. An item's 128 query rows (one q block of one head)
are split between two partitions of one warpgroup each, which run out of step (one's softmax beside the other's
products); each issues tile j's q·kᵀ, then tile j - 1's product with V, and takes tile j's softmax while that product
runs. A program computes one item, or at keys up to `PERSISTENT_UP_TO` one program a multiprocessor walks items one
after another, the next item's Q and first tiles loading while the one before ends (Q in two buffers, the K/V rings
running on across items). Triton 3.6 waits for each q·kᵀ right after issuing it and puts CTA barriers around every
tile's loads (bench/NOTES.md).

What it serves (`HopperForward.serves`): sm_90, fp16 or bf16, head dim 64 or 128, lengths a multiple of the
tiles (no tail tile), and Q, K, V and the output each rows of one matrix (`_Rows`): contiguous [B, H, N, D],
[B, N, H, D] or a fused projection's slices; K and V heads shared by groups of query heads. The weights are
`exp2((s - m) · scale · log2(e))` with m the running max of the raw products: exact at any magnitude (the fused
form's Triton kernel recomputes rows whose max is not tame; this form has none). It writes lse and log_sum as
Triton's forward does (`forward.FlashForwardExtra`), so the Triton backward follows it, and zeros into the fallback
rows (none is recomputed). In half precision with a backward (`forward.keeps_residual`) it takes the Triton
forward's exact weights instead (whole-power-of-two shifts, each weight cut toward zero to V's dtype, l their sum),
writes their statistics and the output's rounding residual (docs/flash-kernel-interface.md). The Triton kernel runs
everything else, every other GPU and the interpreter.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fusepass.flash.forward import LOG2E

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon's Hopper language: the Triton kernel serves
    gluon = None

BLOCK_M, BLOCK_N, STAGES = 128, 128, 2
PARTS = 2  # partitions of BLOCK_M // PARTS query rows each, out of step
# The longest keys at which the grid is persistent (one program a multiprocessor walking (q block, head) items one
# after another, each item's loads beside the end of the one before) rather than one program an item: where an item
# is a few tiles, their prologue and epilogue are a share of it worth hiding (bench/NOTES.md)
PERSISTENT_UP_TO = 2048
HEAD_DIMS = (64, 128)

if gluon is not None:
    @gluon.jit
    def truncated(p, dtype: gl.constexpr):
        """fp32 values cut toward zero to `dtype` (bf16 or fp16) by a bitwise and, kept in fp32 (`tiles.truncated`)."""
        if dtype == gl.bfloat16:
            return (p.to(gl.uint32, bitcast=True) & 0xFFFF0000).to(gl.float32, bitcast=True)
        return (p.to(gl.uint32, bitcast=True) & 0xFFFFE000).to(gl.float32, bitcast=True)

    @gluon.jit
    def _tile_weights(s, m_i, sub_i, shift_i, l_i, c, q_pos, k_pos, dtype: gl.constexpr, MASKED: gl.constexpr,
                      EXACT: gl.constexpr):
        """One tile's online softmax: its weights in `dtype`, the accumulator's rescale, the new running max (of
        the raw products), the weights' (subtracted, shift) and sum. Without EXACT the weights are 2^((s - m) · c)
        (sub and shift unused). With it (`forward.keeps_residual`), the Triton forward's exact weights: while a row's
        max is tame, 2^(s · c - shift) for the whole shift ceil(m · c), every rescale exact; past that, 2^((s - m) · c)
        (the row's statistics say which, `backward.row_statistics`); each cut toward zero to `dtype` by a bitwise
        and (`tiles.truncated`), and l their sum."""
        if MASKED:
            s = gl.where(q_pos[:, None] >= k_pos[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        if EXACT:
            tame = gl.abs(m_new * c) < 16777216.0  # 2^24, the Triton forward's TAME
            sub = gl.where(tame, 0.0, m_new)
            shift = gl.where(tame, gl.ceil(m_new * c), 0.0)
            p = truncated(gl.exp2(gl.fma(s - sub[:, None], c, -shift[:, None])), dtype)
            # From the shift before; a whole power of two while the row stays tame (rows start at m = -inf).
            alpha = gl.exp2(gl.fma(sub_i - sub, c, shift_i - shift))
            return p.to(dtype), alpha, m_new, sub, shift, l_i * alpha + gl.sum(p, 1)
        p = gl.exp2((s - m_new[:, None]) * c)
        alpha = gl.exp2((m_i - m_new) * c)
        return p.to(dtype), alpha, m_new, sub_i, shift_i, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _load(desc, row, col, bar, dest):
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, col], bar, dest)

    @gluon.jit
    def _item(i, n_q_blocks, n_heads, CAUSAL: gl.constexpr, UNIT: gl.constexpr):
        """Item i's (q block, batch, head): a head's q blocks one after another, causal ones longest first, or with
        UNIT = 2 in pairs of the longest left and the shortest left (every pair the same work: programs walking
        pairs end together)."""
        bh = i // n_q_blocks
        r = i - bh * n_q_blocks
        if CAUSAL:
            if UNIT == 2:
                odd = r % 2
                r = (1 - odd) * (n_q_blocks - 1 - r // 2) + odd * (r // 2)
            else:
                r = n_q_blocks - 1 - r
        b = bh // n_heads
        return r, b, bh - b * n_heads

    @gluon.jit
    def _loads(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, done, q_strides,
               k_strides, v_strides, n_heads, group, n_q_blocks, n_items, kv_len, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr, CAUSAL: gl.constexpr,
               UNIT: gl.constexpr):
        """The loading warp, item after item of the program's: Q (a part for each partition) into the next of two
        buffers once the partitions are done with the item that had it before, then K and V a tile at a time into
        the next free buffer of their rings. Tiles are counted over the program's items: `done[i]` completes each
        time both partitions have read tile g's K and tile g - 1's V, for a g with g % STAGES == i."""
        rows: gl.constexpr = q_desc.block_type.shape[0]
        g = 0  # the program's tiles so far
        c = 0  # its items so far
        for u in range(gl.program_id(0), (n_items + UNIT - 1) // UNIT, gl.num_programs(0)):
            for i in range(u * UNIT, gl.minimum(u * UNIT + UNIT, n_items)):
                start_m, b, h = _item(i, n_q_blocks, n_heads, CAUSAL, UNIT)
                kv_h = h // group
                q_base = b.to(gl.int64) * q_strides[0] + h.to(gl.int64) * q_strides[1]
                k_base = b.to(gl.int64) * k_strides[0] + kv_h.to(gl.int64) * k_strides[1]
                v_base = b.to(gl.int64) * v_strides[0] + kv_h.to(gl.int64) * v_strides[1]
                q_row = (q_base // q_strides[2]).to(gl.int32) + start_m * BLOCK_M
                k_row = (k_base // k_strides[2]).to(gl.int32)
                v_row = (v_base // v_strides[2]).to(gl.int32)
                n_tiles = (start_m + 1) * (BLOCK_M // BLOCK_N) if CAUSAL else kv_len // BLOCK_N
                buf = (c % 2) * PARTS
                for part in gl.static_range(PARTS):
                    # Both buffers start free: the first wait on each is for the phase before its first.
                    mbarrier.wait(q_free.index(buf + part), ((c // 2) & 1) ^ 1)
                    _load(q_desc, q_row + part * rows, (q_base % q_strides[2]).to(gl.int32), q_ready.index(buf + part),
                          q_smem.index(buf + part))
                for j in range(n_tiles):
                    slot = g % STAGES
                    # A ring's buffers start free: the first wait on each is for the phase before its first.
                    mbarrier.wait(done.index(slot), ((g // STAGES) & 1) ^ 1)
                    _load(k_desc, k_row + j * BLOCK_N, (k_base % k_strides[2]).to(gl.int32), k_ready.index(slot),
                          k_smem.index(slot))
                    # V[g] goes where V[g - STAGES] was, read by tile g - STAGES + 1 (≡ g + 1 modulo STAGES): by the
                    # next item's first tile where g - STAGES was an item's last (its V read before that tile's K).
                    mbarrier.wait(done.index((g + 1) % STAGES), ((g + 1 - STAGES) // STAGES) & 1, pred=g >= STAGES)
                    _load(v_desc, v_row + j * BLOCK_N, (v_base % v_strides[2]).to(gl.int32), v_ready.index(slot),
                          v_smem.index(slot))
                    g += 1
                c += 1

    @gluon.jit
    def _step(j, r, p_prev, alpha_prev, acc, m_i, sub_i, shift_i, l_i, c, q_pos, q_smem, k_smem, v_smem, k_ready,
              v_ready, done, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, MASKED: gl.constexpr, EXACT: gl.constexpr):
        """Tile j's scores (the program's tile r, its place in the rings), then tile j - 1's product with V beside
        tile j's softmax (neither the accumulator nor the weights' registers are touched while a product that reads
        them runs)."""
        slot = r % STAGES
        before = (r + STAGES - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (r // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)),
                          gl.zeros([q_pos.shape[0], BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha_prev, gl.SliceLayout(1, O_LAYOUT))[:, None]
        mbarrier.wait(v_ready.index(before), ((r - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_prev, v_smem.index(before), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        k_pos = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        p, alpha, m_i, sub_i, shift_i, l_i = _tile_weights(s, m_i, sub_i, shift_i, l_i, c, q_pos, k_pos,
                                                           v_smem.dtype, MASKED, EXACT)
        # The weights as a dependency of the wait: computed before it, not sunk past it to their use.
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(done.index(slot))  # K of tile r and V of tile r - 1 read
        p = gl.convert_layout(p, gl.DotOperandLayout(0, O_LAYOUT, 2))
        return p, alpha, acc, m_i, sub_i, shift_i, l_i

    @gluon.jit
    def _attend(o_desc, r_desc, lse_ptr, log_sum_ptr, fallback_ptr, q_smem, k_smem, v_smem, q_bar, q_phase, k_ready,
                v_ready, done, o_row, o_col, stat_row, start_m, n_tiles, g, scale, part, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                ROWS: gl.constexpr, EXACT: gl.constexpr):
        """One item's `ROWS` query rows of this partition: their products and softmax over the item's `n_tiles` K/V
        tiles (the program's tiles g onwards), then their output (by TMA, staged where their Q was), lse and
        log_sum."""
        warps: gl.constexpr = gl.num_warps()
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        c = scale * LOG2E
        q_pos = start_m * BLOCK_M + part * ROWS + gl.arange(0, ROWS, layout=s_rows)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
        l_i = gl.zeros([ROWS], gl.float32, s_rows)
        sub_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)  # EXACT's (see _tile_weights)
        shift_i = gl.zeros([ROWS], gl.float32, s_rows)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

        mbarrier.wait(q_bar, q_phase)
        mbarrier.wait(k_ready.index(g % STAGES), (g // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(g % STAGES).permute((1, 0)),
                          gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False)
        mbarrier.arrive(done.index(g % STAGES))
        # A causal item's masked tiles are its last BLOCK_M // BLOCK_N.
        n_full = n_tiles - BLOCK_M // BLOCK_N if CAUSAL else n_tiles
        k_pos = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p, alpha, m_i, sub_i, shift_i, l_i = _tile_weights(s, m_i, sub_i, shift_i, l_i, c, q_pos, k_pos,
                                                           v_smem.dtype, CAUSAL, EXACT)
        p = gl.convert_layout(p, gl.DotOperandLayout(0, o_layout, 2))
        for j in range(1, n_full):
            p, alpha, acc, m_i, sub_i, shift_i, l_i = _step(
                j, g + j, p, alpha, acc, m_i, sub_i, shift_i, l_i, c, q_pos, q_smem, k_smem, v_smem, k_ready, v_ready,
                done, s_layout, o_layout, BLOCK_N, STAGES, False, EXACT)
        for j in range(gl.maximum(n_full, 1), n_tiles):
            p, alpha, acc, m_i, sub_i, shift_i, l_i = _step(
                j, g + j, p, alpha, acc, m_i, sub_i, shift_i, l_i, c, q_pos, q_smem, k_smem, v_smem, k_ready, v_ready,
                done, s_layout, o_layout, BLOCK_N, STAGES, CAUSAL, EXACT)
        last = g + n_tiles - 1
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc)

        acc = acc / gl.convert_layout(l_i, o_rows)[:, None]
        stat_layout: gl.constexpr = gl.BlockedLayout([1], [32], [warps], [0])
        rows = stat_row + part * ROWS + gl.arange(0, ROWS, layout=stat_layout)
        if EXACT:
            # As the Triton forward's exact weights (`forward.FlashForwardExtra`): (the whole shift, 1 / l) while
            # tame, else (the max in score units, -1 / l).
            tame = gl.convert_layout(sub_i == 0.0, stat_layout)
            gl.store(lse_ptr + rows, gl.where(tame, gl.convert_layout(shift_i, stat_layout),
                                              gl.convert_layout(m_i * scale, stat_layout)))
            gl.store(log_sum_ptr + rows, gl.where(tame, 1.0, -1.0) / gl.convert_layout(l_i, stat_layout))
        else:
            # As the Triton forward's: log_sum the log of the row's sum relative to its max m (in score units), lse
            # m + log_sum.
            log_sum = gl.convert_layout(gl.log(l_i), stat_layout)
            gl.store(log_sum_ptr + rows, log_sum)
            gl.store(lse_ptr + rows, gl.convert_layout(m_i * scale, stat_layout) + log_sum)
        if fallback_ptr is not None:
            gl.store(fallback_ptr + rows, gl.zeros([ROWS], gl.int8, stat_layout))
        rounded = acc.to(q_smem.dtype)
        q_smem.store(rounded)  # Q is read no more: its buffer stages the output for one TMA store
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [o_row + part * ROWS, o_col], q_smem)
        tma.store_wait(0)
        if EXACT:  # the output's rounding residual, laid out as it (`forward.keeps_residual`), staged alike
            q_smem.store((acc - rounded.to(gl.float32)).to(q_smem.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(r_desc, [o_row + part * ROWS, o_col], q_smem)
            tma.store_wait(0)

    @gluon.jit
    def _partition(o_desc, r_desc, lse_ptr, log_sum_ptr, fallback_ptr, q_smem, k_smem, v_smem, q_ready, q_free,
                   k_ready, v_ready, done, o_strides, n_heads, n_q_blocks, n_items, q_len, kv_len, scale, part,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                   STAGES: gl.constexpr, PARTS: gl.constexpr, EXACT: gl.constexpr, UNIT: gl.constexpr):
        """A computing partition (one warpgroup): its share of each of the program's items (`_attend`), in the
        loading warp's order; an item's Q buffer is freed once its output, staged there, is stored."""
        g = 0  # the program's tiles so far
        c = 0  # its items so far
        for u in range(gl.program_id(0), (n_items + UNIT - 1) // UNIT, gl.num_programs(0)):
            for i in range(u * UNIT, gl.minimum(u * UNIT + UNIT, n_items)):
                start_m, b, h = _item(i, n_q_blocks, n_heads, CAUSAL, UNIT)
                o_base = b.to(gl.int64) * o_strides[0] + h.to(gl.int64) * o_strides[1]
                n_tiles = (start_m + 1) * (BLOCK_M // BLOCK_N) if CAUSAL else kv_len // BLOCK_N
                buf = (c % 2) * PARTS + part
                _attend(o_desc, r_desc, lse_ptr, log_sum_ptr, fallback_ptr, q_smem.index(buf), k_smem, v_smem,
                        q_ready.index(buf), (c // 2) & 1, k_ready, v_ready, done,
                        (o_base // o_strides[2]).to(gl.int32) + start_m * BLOCK_M, (o_base % o_strides[2]).to(gl.int32),
                        (b * n_heads + h) * q_len + start_m * BLOCK_M, start_m, n_tiles, g, scale, part, HEAD_DIM,
                        BLOCK_M, BLOCK_N, CAUSAL, STAGES, BLOCK_M // PARTS, EXACT)
                mbarrier.arrive(q_free.index(buf))
                g += n_tiles
                c += 1

    @gluon.jit
    def _hopper_forward(q_desc, k_desc, v_desc, o_desc, r_desc, lse_ptr, log_sum_ptr, fallback_ptr, q_strides,
                        k_strides, v_strides, o_strides, n_heads, batch_heads, group, q_len, kv_len, scale,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                        STAGES: gl.constexpr, EXACT: gl.constexpr, UNIT: gl.constexpr):
        """Program p walks the items (q block, batch · head) u · UNIT to u · UNIT + UNIT - 1 (`_item`'s order) for u
        from p on in steps of the program count: one unit a program, or a persistent grid. Each tensor's
        [B, H, N, D] strides (batch, head, row) place its rows in the matrix its descriptor covers (`_Rows`)."""
        dtype: gl.constexpr = q_desc.dtype
        PARTS: gl.constexpr = 2
        ROWS: gl.constexpr = BLOCK_M // PARTS
        n_q_blocks = q_len // BLOCK_M
        n_items = n_q_blocks * batch_heads

        # Q in two buffers (by item) of a part for each partition
        q_smem = gl.allocate_shared_memory(dtype, [2 * PARTS, ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * PARTS, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [2 * PARTS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * PARTS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(done.index(i), count=PARTS)

        gl.warp_specialize([
            (_partition, (o_desc, r_desc, lse_ptr, log_sum_ptr, fallback_ptr, q_smem, k_smem, v_smem, q_ready, q_free,
                          k_ready, v_ready, done, o_strides, n_heads, n_q_blocks, n_items, q_len, kv_len, scale, 0,
                          HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, STAGES, PARTS, EXACT, UNIT)),
            (_partition, (o_desc, r_desc, lse_ptr, log_sum_ptr, fallback_ptr, q_smem, k_smem, v_smem, q_ready, q_free,
                          k_ready, v_ready, done, o_strides, n_heads, n_q_blocks, n_items, q_len, kv_len, scale, 1,
                          HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, STAGES, PARTS, EXACT, UNIT)),
            (_loads, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, done,
                      q_strides, k_strides, v_strides, n_heads, group, n_q_blocks, n_items, kv_len, BLOCK_M, BLOCK_N,
                      STAGES, PARTS, CAUSAL, UNIT))], [4, 1], [240, 24])


@dataclass(frozen=True)
class _Rows:
    """A [B, H, N, D] tensor as rows of one matrix: element (b, h, n, d) at row (b·sb + h·sh) // sn + n, column
    (b·sb + h·sh) % sn + d of a [rows, width] matrix with row stride sn, where no head's D columns wrap past sn."""

    rows: int
    width: int

    @staticmethod
    def of(t: torch.Tensor) -> _Rows | None:
        """The matrix `t`'s rows lie in, where its batches start rows and its heads start rows or lie side by
        side within one (TMA's alignment: 16 bytes), else None."""
        b, h, n, d = t.shape
        sb, sh, sn, sd = t.stride()
        if sd != 1 or sn < d or (sn * t.element_size()) % 16 or (t.data_ptr() % 16) or sb % sn or min(sb, sh) < 0:
            return None
        if sh % sn == 0:
            width = d
        elif (h - 1) * sh + d <= sn:  # heads side by side: [B, N, H, D], a fused projection's slice
            width = (h - 1) * sh + d
        else:
            return None
        rows = ((b - 1) * sb + (h - 1) * sh) // sn + n
        if t.storage_offset() + (rows - 1) * sn + width > t.untyped_storage().nbytes() // t.element_size():
            return None
        return _Rows(rows, width)

    def described(self, t: torch.Tensor, block_rows: int) -> TensorDescriptor:
        d = t.shape[3]
        layout = gl.NVMMASharedLayout.get_default_for([block_rows, d], _GL_DTYPES[t.dtype])
        matrix = t.as_strided((self.rows, self.width), (t.stride(2), 1))
        return TensorDescriptor(matrix, [self.rows, self.width], [t.stride(2), 1], [block_rows, d], layout)


_GL_DTYPES = {} if gluon is None else {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: an sm_90 GPU and a Triton with Gluon's Hopper language."""
    return gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether the kernel computes softmax(q kᵀ · scale [causal]) v for these [B, H, N, D] tensors into an output of
    their dtype laid out as `forward.forward_outputs` lays it out (rows of a matrix either way); the caller has
    checked the function (`sdpa_floor.sdpa_form`)."""
    (_, q_heads, q_len, d), (_, kv_heads, kv_len, _) = q.shape, k.shape
    # One head dim for Q, K and V: values of another (multi-head latent attention's) take the Triton forward, which
    # runs each product at its own width.
    return (available(q.device) and q.dtype in _GL_DTYPES and k.dtype == v.dtype == q.dtype and d in HEAD_DIMS
            and v.shape[3] == d
            and q_len % BLOCK_M == 0 and kv_len % BLOCK_N == 0 and q_heads % kv_heads == 0
            and (not causal or q_len == kv_len) and all(_Rows.of(t) is not None for t in (q, k, v)))


DESCRIBED = "the forward ran the sm_90 kernel (warp-specialized, Gluon)"  # in the report, per shape


def hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   log_sum: torch.Tensor, fallback_rows: torch.Tensor | None, scale: float, causal: bool,
                   residual: torch.Tensor | None = None) -> None:
    """The forward into `out` ([B, H, N, D] view), `lse` and `log_sum` ([B, H, N] contiguous fp32) and zeros into
    `fallback_rows` ([B, H, N] int8, a mask's; None without), where `serves`. With `residual` (laid out as `out`),
    the Triton forward's exact weights and their statistics, and the output's rounding residual
    (`forward.keeps_residual`)."""
    batch, q_heads, q_len, d = q.shape
    described = [_Rows.of(t).described(t, rows) for t, rows in
                 ((q, BLOCK_M // PARTS), (k, BLOCK_N), (v, BLOCK_N), (out, BLOCK_M // PARTS))]
    residual_described = described[3] if residual is None else _Rows.of(residual).described(residual, BLOCK_M // PARTS)
    strides = [t.stride()[:3] for t in (q, k, v, out)]
    persistent = k.shape[2] <= PERSISTENT_UP_TO
    unit = item_unit(k.shape[2], causal)
    items = q_len // BLOCK_M * batch * q_heads
    units = (items + unit - 1) // unit
    _hopper_forward[(min(units, _multiprocessors(q.device)) if persistent else units,)](
        *described, residual_described, lse, log_sum, fallback_rows, *strides, q_heads, batch * q_heads,
        q_heads // k.shape[1], q_len, k.shape[2], scale, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=causal,
        STAGES=STAGES, EXACT=residual is not None, UNIT=unit, num_warps=4)


def item_unit(kv_len: int, causal: bool) -> int:
    """The items a program takes at a time (`_item`): causal ones in pairs of equal work on a persistent grid."""
    return 2 if kv_len <= PERSISTENT_UP_TO and causal else 1


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The persistent grid's programs on `device`: one a multiprocessor."""
    return torch.cuda.get_device_properties(device).multi_processor_count
