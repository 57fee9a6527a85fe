"""The backward on sm_90 for what the sm_90 forward computes in its training form (`hopper_forward`, exact weights):
one Gluon kernel for dQ, dK and dV in FlashAttention-3's structure, five products per tile pair where the Triton
backward's two kernels take seven.

A program holds a kv block of 128 rows of one kv head, split between two partitions of one warpgroup (64 kv rows
each), and walks the q blocks of 64 rows of every query head sharing it (under a causal mask, from the block's
diagonal on). One warp loads Q, dO and the q rows' statistics a q block at a time by TMA into a ring. Per q block a
partition computes its transposed tiles, [kv, q], of scores and dPᵀ = V dOᵀ, the weights and dSᵀ = Pᵀ ⊙ (dPᵀ -
delta), which are the left operands of dV += Pᵀ dO and dK += dSᵀ Q from registers (FlashAttention-3's swapped
products: no weights through shared memory); dSᵀ goes to shared memory for dQ, of which each partition takes half the
head dim, dQ = dS K over both partitions' 128 kv rows, added into an fp32 buffer by a TMA reduction
(`cp.reduce.async.bulk.tensor`) and converted to dQ's dtype at the end. A Triton kernel comes first
(`_stats_kernel`): per q row the weights' exponent offset, 1 / l and delta / l, with delta = rowsum(dO ⊙ O) (with the
forward's rounding residual; `backward.row_delta`, the Triton backward's).

The weights are the forward's (see `_step`). Served (`serves`): the sm_90 forward's cases, with dO laid out as rows
of one matrix too; with `WINDOWS`, a sliding window's band, with `KEY_MASKS` a mask of the keys alone
(`attention.key_mask`) and as `DOCUMENTS` says document ids alone or with a causal mask (`attention.document_mask`), at
those layouts after the Triton forward's training form, whose statistics are the same (on the tiles that forward
masks it takes the scores times the scale rounded, then times log2(e), where this kernel multiplies by their product:
a weight there may come out an ulp of the inputs' dtype apart). The Triton backward runs everything else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusepass.flash import hopper_forward
from fusepass.flash.backward import row_delta, row_statistics
from fusepass.flash.blockmap import BlockMap
from fusepass.flash.forward import LOG2E
from fusepass.flash.tiles import load_tile

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton._C.libtriton import ir

    from fusepass.flash.hopper_forward import truncated
except ImportError:  # a Triton without Gluon's Hopper language: the Triton backward serves
    gluon = None

BLOCK_M, BLOCK_N, STAGES = 64, 128, 2  # q rows a step, kv rows a program (two partitions of 64), the ring's depth
# Whether the kernel also serves a sliding window (a causal band of keys, `sdpa_floor.causal_band`) after the Triton
# forward's training form, whose statistics are the sm_90 forward's (bench/NOTES.md)
WINDOWS = True
# Whether the kernel also serves a mask of the keys alone (padding: `attention.key_mask`) after the Triton forward's
# training form, as it serves a window (bench/NOTES.md)
KEY_MASKS = True
# The document ids (`attention.document_mask`) the kernel serves after the Triton forward's training form, walking the
# block map's lists of q blocks per kv block, as (head dim, whether joined with a causal mask: packed documents): those
# at which it times faster than the Triton backward (bench/NOTES.md)
DOCUMENTS = frozenset({(128, False)})
STATS_BLOCK = 64  # rows a program of the statistics kernel
# Rows per head of `_stats_kernel`'s output: its three, and with document ids the q rows' ids (two int32 halves),
# padded to a TMA box's power of two
STATS, STATS_WITH_IDS = 4, 8

if gluon is not None:
    @builtin
    def _tma_add(tensor_desc, coord, src, _semantic=None):
        """Add a shared-memory tile into global memory by TMA (`cp.reduce.async.bulk.tensor`): Gluon's builder has it
        under triton 3.6, its Hopper language not."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

    @gluon.jit
    def _walk(lists, b, h, n_heads, kv_block):
        """Of kv block `kv_block` for query head h of batch b, in the block map's cols lists `lists` (count, index, the
        map's batch and head strides, its q blocks, its kv blocks, a flag per (batch, query head)): (its full tiles'
        count, their q blocks, its partial tiles' count, theirs, 1 where the head walks every q block as partial
        instead: a head with a row that keeps no key, whose weights are NaN, as eager's softmax gives them, at every
        key)."""
        count, index, map_b, map_h, n_q_blocks, n_kv_blocks, dense_ptr = lists
        dense = (gl.load(dense_ptr + b * n_heads + h) != 0).to(gl.int32)
        slot = ((b * map_b + h * map_h) * n_kv_blocks + kv_block) * 2
        n_full = gl.load(count + slot) * (1 - dense)
        n_partial = gl.load(count + slot + 1) * (1 - dense) + n_q_blocks * dense
        return (n_full, index + slot.to(gl.int64) * n_q_blocks, n_partial, index + (slot + 1).to(gl.int64) * n_q_blocks,
                dense)

    @gluon.jit
    def _listed_block(blocks, j, dense):
        """The j-th q block of a walk: entry j of the list `blocks`, or j where the walk is `dense` (`_walk`)."""
        listed = gl.load(blocks + j)  # (in the list's buffer either way: it holds every q block's room)
        return listed + dense * (j - listed)

    @gluon.jit
    def _loads(q_desc, do_desc, k_desc, v_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, stats_smem, kv_bar,
               q_ready, q_free, q_strides, do_strides, b, n_heads, first_head, k_row, k_col, v_row, v_col,
               first_block, n_blocks, group, lists, kv_block, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
               LISTED: gl.constexpr):
        """The loading warp: the program's K and V once (a half for each partition), then Q, dO and the q rows'
        statistics a q block at a time into the next free buffer of their ring; `q_free[i]` completes when both
        partitions are done with step t's buffers, for a t with t % STAGES == i. With LISTED, the q blocks of the
        block map's lists (`_walk`), the full tiles' first, else those of [first_block, n_blocks)."""
        half: gl.constexpr = k_smem.shape[1]
        mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
        for part in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [k_row + part * half, k_col], kv_bar, k_smem.index(part))
            tma.async_copy_global_to_shared(v_desc, [v_row + part * half, v_col], kv_bar, v_smem.index(part))
        t = 0
        for g in range(group):
            h = first_head + g
            q_base = b.to(gl.int64) * q_strides[0] + h.to(gl.int64) * q_strides[1]
            do_base = b.to(gl.int64) * do_strides[0] + h.to(gl.int64) * do_strides[1]
            q_row = (q_base // q_strides[2]).to(gl.int32)
            q_col = (q_base % q_strides[2]).to(gl.int32)
            do_row = (do_base // do_strides[2]).to(gl.int32)
            do_col = (do_base % do_strides[2]).to(gl.int32)
            stats_row = (b * n_heads + h) * stats_desc.block_type.shape[0]
            if LISTED:
                n_full, full, n_partial, partial, dense = _walk(lists, b, h, n_heads, kv_block)
                for j in range(n_full):
                    t = _load_step(t, gl.load(full + j), q_desc, do_desc, stats_desc, q_smem, do_smem, stats_smem,
                                   q_ready, q_free, q_row, q_col, do_row, do_col, stats_row, BLOCK_M, STAGES)
                for j in range(n_partial):
                    t = _load_step(t, _listed_block(partial, j, dense), q_desc, do_desc, stats_desc, q_smem, do_smem,
                                   stats_smem, q_ready, q_free, q_row, q_col, do_row, do_col, stats_row, BLOCK_M,
                                   STAGES)
            else:
                for i in range(first_block, n_blocks):
                    t = _load_step(t, i, q_desc, do_desc, stats_desc, q_smem, do_smem, stats_smem, q_ready, q_free,
                                   q_row, q_col, do_row, do_col, stats_row, BLOCK_M, STAGES)

    @gluon.jit
    def _load_step(t, i, q_desc, do_desc, stats_desc, q_smem, do_smem, stats_smem, q_ready, q_free, q_row, q_col,
                   do_row, do_col, stats_row, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """Step t's loads (q block i) into the next free buffer of the ring; t + 1."""
        slot = t % STAGES
        # A ring's buffers start free: the first wait on each is for the phase before its first.
        mbarrier.wait(q_free.index(slot), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + stats_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + i * BLOCK_M, q_col], q_ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [do_row + i * BLOCK_M, do_col], q_ready.index(slot),
                                        do_smem.index(slot))
        tma.async_copy_global_to_shared(stats_desc, [stats_row, i * BLOCK_M], q_ready.index(slot),
                                        stats_smem.index(slot))
        return t + 1

    @gluon.jit
    def _add_dq(dq, row, part: gl.constexpr, dq_smem, dq_desc):
        """This partition's share of a step's dQ added into the fp32 buffer at q row `row` by a TMA reduction, staged
        in the partition's buffer once the addition before has read it."""
        half: gl.constexpr = dq.shape[1]
        tma.store_wait(0)
        dq_smem.index(part).store(dq)
        fence_async_shared()
        _tma_add(dq_desc, [row, part * half], dq_smem.index(part))

    @gluon.jit
    def _step(t, i, dk, dv, dq_row, held, part: gl.constexpr, S_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
              DQ_LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
              WINDOWED: gl.constexpr, KEYED: gl.constexpr, SEPARATE: gl.constexpr, ID_EQUAL: gl.constexpr):
        """Step t (q block i of one head, its dQ rows from `dq_row`): this partition's share of dV, dK and dQ, with
        what the partition holds through its walk (`held`, `_partition`'s); c = scale · log2(e), as the
        forward's. MASKED: the causal mask on the tiles, and with WINDOWED the band of `window` keys a query keeps.
        KEYED: the keep of the partition's keys (`kept`, one per kv row). SEPARATE: a key kept where its id (`col_ids`,
        its two int32 halves) equals the query's (`ids_rows`, the ring's statistics rows 3 and 4), or differs from it
        where not ID_EQUAL, and with MASKED the causal mask too (packed documents).

        The weights are the forward's, from its statistics (`forward.FlashForwardExtra`, exact mode): 2^(s · c -
        shift) for a row whose max stayed tame (its lse the whole shift), 2^(s · c - m · log2(e)) past that (its lse
        the max m in score units, its log_sum negative), cut toward zero to the inputs' dtype, times 1 / l (|log_sum|)
        for dV; the score gradient p · (dp / l - delta / l) · scale, as the Triton backward's (`_weights_gradient`).
        The tiles are transposed, [kv, q] (a query row's values sixteen registers a thread, read where they are used
        from `stats_rows`, the ring's statistics as rows: `_stats_kernel`'s offset, 1 / l and delta / l): the
        weights and dS are then the left operands of dV's and dK's products from registers, and only dS goes through
        shared memory, for dQ over both partitions' kv rows."""
        (k_part, v_part, q_smem, do_smem, k_smem, stats_rows, ds_smem, dq_smem, q_ready, q_free, ds_ready, dq_desc,
         kv_start, window, kept, col_ids, ids_rows, c, scale) = held
        dtype: gl.constexpr = q_smem.dtype
        head_dim: gl.constexpr = q_smem.shape[2]
        slot = t % STAGES
        q_cols: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        q_at = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=q_cols)  # (the mask's)
        mbarrier.wait(q_ready.index(slot), (t // STAGES) & 1)
        q_s = q_smem.index(slot)
        do_s = do_smem.index(slot)
        rows: gl.constexpr = k_part.shape[0]
        st = warpgroup_mma(k_part, q_s.permute((1, 0)), gl.zeros([rows, BLOCK_M], gl.float32, S_LAYOUT),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_part, do_s.permute((1, 0)), gl.zeros([rows, BLOCK_M], gl.float32, S_LAYOUT),
                            use_acc=False, is_async=True)
        n_stats: gl.constexpr = stats_rows.shape[0] // STAGES
        offset = stats_rows.index(slot * n_stats)
        inverse_l = stats_rows.index(slot * n_stats + 1)
        scaled_delta = stats_rows.index(slot * n_stats + 2)
        st = warpgroup_mma_wait(1, deps=(st,))
        if MASKED:
            kv_at = kv_start + part * rows + gl.arange(0, rows, layout=gl.SliceLayout(1, S_LAYOUT))
            in_band = q_at[None, :] >= kv_at[:, None]
            if WINDOWED:
                in_band = in_band & (q_at[None, :] - kv_at[:, None] < window)
            if not SEPARATE:  # (else joined with the ids' mask below)
                st = gl.where(in_band, st, float("-inf"))
        if KEYED:
            st = gl.where(kept[:, None], st, float("-inf"))
        if SEPARATE:
            col_lo, col_hi = col_ids
            same = (ids_rows.index(slot * n_stats + 3).load(q_cols)[None, :] == col_lo[:, None]) & \
                (ids_rows.index(slot * n_stats + 4).load(q_cols)[None, :] == col_hi[:, None])
            same = same if ID_EQUAL else ~same
            if MASKED:
                same = same & in_band
            st = gl.where(same, st, float("-inf"))
        p = truncated(gl.exp2(gl.fma(st, c, offset.load(q_cols)[None, :])), dtype)  # exact in the inputs' dtype
        inverse_l = inverse_l.load(q_cols)
        weights = gl.convert_layout((p * inverse_l[None, :]).to(dtype), gl.DotOperandLayout(0, KV_LAYOUT, 2))
        p = p.to(dtype)
        dv = warpgroup_mma(weights, do_s, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        ds = p.to(gl.float32) * gl.fma(dpt, inverse_l[None, :], -scaled_delta.load(q_cols)[None, :])
        if KEYED:  # masked_fill passes no gradient to a masked score: 0 there, where a row that keeps no key has NaN
            ds = gl.where(kept[:, None], ds, 0.0)  # weights (eager's softmax of -inf alone: its dV NaN, dQ and dK not)
        if SEPARATE:
            ds = gl.where(same, ds, 0.0)
        ds = (ds * scale).to(dtype)  # the scaled score's gradient, [kv, q]
        # Both partitions' dS, for dQ over all kv rows; its two buffers alternate by step: a partition passes step
        # t + 1's wait only after the other finished step t, so step t + 2 writes over nothing still read.
        ds_slot = t % 2
        ds_smem.index(2 * ds_slot + part).store(ds)
        dk = warpgroup_mma(gl.convert_layout(ds, gl.DotOperandLayout(0, KV_LAYOUT, 2)), q_s, dk, is_async=True)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(ds_slot))
        mbarrier.wait(ds_ready.index(ds_slot), (t // 2) & 1)
        half: gl.constexpr = head_dim // 2
        dq = warpgroup_mma(ds_smem.index(2 * ds_slot).permute((1, 0)), k_smem.index(0).slice(part * half, half, 1),
                           gl.zeros([BLOCK_M, half], gl.float32, DQ_LAYOUT), use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_smem.index(2 * ds_slot + 1).permute((1, 0)),
                           k_smem.index(1).slice(part * half, half, 1), dq, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        mbarrier.arrive(q_free.index(slot))  # Q and dO of step t read
        _add_dq(dq, dq_row + i * BLOCK_M, part, dq_smem, dq_desc)
        return dk, dv

    @gluon.jit
    def _partition(dk_ptr, dv_ptr, dk_strides, dv_strides, q_smem, do_smem, k_smem, v_smem, stats_smem, ds_smem,
                   dq_smem, kv_bar, q_ready, q_free, ds_ready, dq_desc, kept_ptr, kept_batch, col_ids_ptr, lists, b,
                   kv_h, kv_block, kv_start, first_head, n_heads, q_len, first_block, n_blocks, window, group, scale, c,
                   part: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, KEYED: gl.constexpr, LISTED: gl.constexpr,
                   ID_EQUAL: gl.constexpr):
        """A computing partition (one warpgroup): dK and dV of its 64 kv rows, its half of each step's dQ. Its q
        blocks: [first_block, n_blocks), the causal mask on the first two, or with WINDOWED the band's on every one
        (a band's blocks are few, and a loop apart for the unmasked ones between its edges spilled 104 stack bytes
        at D128, offline, against 24); with KEYED its kv rows' keep (bytes at `kept_ptr`, a batch's `kept_batch`
        apart) on every one. With LISTED (document ids), the q blocks of the block map's lists (`_walk`), the ids'
        mask on the partial tiles' (the keys' ids at `col_ids_ptr`, int64, a batch's `kept_batch` apart), with CAUSAL
        the causal mask's too."""
        warps: gl.constexpr = gl.num_warps()
        rows: gl.constexpr = k_smem.shape[1]
        if not WINDOWED and not KEYED and not LISTED:  # after the sm_90 forward: its exponent scale, the fp32 scale
            c = scale * LOG2E  # times log2(e) in fp32
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                           instr_shape=[16, BLOCK_M, 16])  # [kv, q]
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                            instr_shape=[16, HEAD_DIM // 2, 16])
        dk = gl.zeros([rows, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([rows, HEAD_DIM], gl.float32, kv_layout)
        k_part = k_smem.index(part)
        v_part = v_smem.index(part)
        # With KEYED, the keep of the partition's kv rows
        kept = (gl.load(kept_ptr + b.to(gl.int64) * kept_batch + kv_start + part * rows
                        + gl.arange(0, rows, layout=gl.SliceLayout(1, s_layout))) != 0) if KEYED else 0
        # The statistics' ring (unswizzled, as the TMA writes it) as plain rows, so that a row is a vector of its own;
        # with LISTED its ids' halves as int32 rows.
        ring_rows: gl.constexpr = [stats_smem.shape[0] * stats_smem.shape[1], stats_smem.shape[2]]
        stats_rows = stats_smem._reinterpret(gl.float32, ring_rows, gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ids_rows = stats_smem._reinterpret(gl.int32, ring_rows, gl.SwizzledSharedLayout(1, 1, 1, [0])) if LISTED \
            else 0
        # With LISTED, the ids of the partition's kv rows, in two int32 halves
        col_ids = gl.load(col_ids_ptr + b.to(gl.int64) * kept_batch + kv_start + part * rows
                          + gl.arange(0, rows, layout=gl.SliceLayout(1, s_layout))) if LISTED else 0
        col_ids = (col_ids.to(gl.int32), (col_ids >> 32).to(gl.int32)) if LISTED else 0
        mbarrier.wait(kv_bar, 0)
        # Under a causal mask a kv block's first two q blocks cross the diagonal (q blocks of 64, kv blocks of 128).
        n_masked = 2 if CAUSAL else 0
        held = (k_part, v_part, q_smem, do_smem, k_smem, stats_rows, ds_smem, dq_smem, q_ready, q_free, ds_ready,
                dq_desc, kv_start, window, kept, col_ids, ids_rows, c, scale)
        t = 0
        for g in range(group):
            dq_row = (b * n_heads + first_head + g) * q_len
            if LISTED:
                n_full, full, n_partial, partial, dense = _walk(lists, b, first_head + g, n_heads, kv_block)
                for j in range(n_full):
                    dk, dv = _step(t, gl.load(full + j), dk, dv, dq_row, held, part, s_layout, kv_layout, dq_layout,
                                   BLOCK_M, STAGES, False, False, False, False, ID_EQUAL)
                    t += 1
                for j in range(n_partial):
                    dk, dv = _step(t, _listed_block(partial, j, dense), dk, dv, dq_row, held, part, s_layout,
                                   kv_layout, dq_layout, BLOCK_M, STAGES, CAUSAL, False, False, True, ID_EQUAL)
                    t += 1
            elif WINDOWED:
                for i in range(first_block, n_blocks):
                    dk, dv = _step(t, i, dk, dv, dq_row, held, part, s_layout, kv_layout, dq_layout,
                                   BLOCK_M, STAGES, True, True, False, False, ID_EQUAL)
                    t += 1
            else:
                for i in range(first_block, first_block + n_masked):
                    dk, dv = _step(t, i, dk, dv, dq_row, held, part, s_layout, kv_layout, dq_layout,
                                   BLOCK_M, STAGES, True, False, False, False, ID_EQUAL)
                    t += 1
                for i in range(first_block + n_masked, n_blocks):
                    dk, dv = _step(t, i, dk, dv, dq_row, held, part, s_layout, kv_layout, dq_layout,
                                   BLOCK_M, STAGES, False, False, KEYED, False, ID_EQUAL)
                    t += 1
        row_idx = kv_start + part * rows + gl.arange(0, rows, layout=gl.SliceLayout(1, kv_layout))
        col_idx = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        dk_at = (dk_ptr + b.to(gl.int64) * dk_strides[0] + kv_h.to(gl.int64) * dk_strides[1]
                 + row_idx[:, None].to(gl.int64) * dk_strides[2] + col_idx[None, :] * dk_strides[3])
        dv_at = (dv_ptr + b.to(gl.int64) * dv_strides[0] + kv_h.to(gl.int64) * dv_strides[1]
                 + row_idx[:, None].to(gl.int64) * dv_strides[2] + col_idx[None, :] * dv_strides[3])
        gl.store(dk_at, dk.to(dk_ptr.dtype.element_ty))
        gl.store(dv_at, dv.to(dv_ptr.dtype.element_ty))
        tma.store_wait(0)

    @gluon.jit
    def _hopper_backward(q_desc, do_desc, k_desc, v_desc, stats_desc, dq_desc, dk_ptr, dv_ptr, kept_ptr, walks_ptr,
                         col_ids_ptr, lists, q_strides, do_strides, k_strides, v_strides, dk_strides, dv_strides,
                         kept_batch, n_heads, group, q_len, window, scale, c, HEAD_DIM: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                         WINDOWED: gl.constexpr, KEYED: gl.constexpr, LISTED: gl.constexpr, ID_EQUAL: gl.constexpr):
        """Program (kv block, batch · kv head): a head's kv blocks run side by side and share its Q and dO in L2 (in
        the other order they ran slower: bench/NOTES.md). Each tensor's [B, H, N, D] strides (batch, head, row) place
        its rows in the matrix its descriptor covers (`hopper_forward._Rows`). KEYED: the keys' keep, [B or 1, Nk]
        bytes at `kept_ptr` (a batch's `kept_batch` apart), and per kv block whether to walk its q blocks at
        `walks_ptr` (`attention.key_mask.kept_keys`). LISTED: document ids, the keys' at `col_ids_ptr` (int64, a
        batch's `kept_batch` apart), the q rows' in the statistics, the q blocks walked from the block map's `lists`
        (`_walk`). c: scale · log2(e) from the host, the weights' exponent scale
        after the Triton forward (a window's, a key mask's), which folds the product of its constants, in fp64, into
        its kernel (`forward._attend_tile`); the sm_90 forward's is taken in fp32 (see `_partition`)."""
        dtype: gl.constexpr = q_desc.dtype
        HALF: gl.constexpr = BLOCK_N // 2
        kv_block = gl.program_id(0)  # the first kv blocks first: under a causal mask they walk the most q blocks
        bh = gl.program_id(1)
        kv_heads = n_heads // group
        b = bh // kv_heads
        kv_h = bh - b * kv_heads
        k_base = b.to(gl.int64) * k_strides[0] + kv_h.to(gl.int64) * k_strides[1]
        v_base = b.to(gl.int64) * v_strides[0] + kv_h.to(gl.int64) * v_strides[1]
        kv_start = kv_block * BLOCK_N
        k_row = (k_base // k_strides[2]).to(gl.int32) + kv_start
        v_row = (v_base // v_strides[2]).to(gl.int32) + kv_start
        first_block = kv_start // BLOCK_M if CAUSAL else 0
        n_blocks = q_len // BLOCK_M
        if WINDOWED:  # the queries that keep a key of this block end at kv_start + BLOCK_N - 2 + window
            n_blocks = gl.minimum(n_blocks, (kv_start + BLOCK_N - 2 + window) // BLOCK_M + 1)
        if KEYED:  # a block that keeps no key adds nothing: none walked, its dK and dV zeros
            n_blocks = n_blocks * (gl.load(walks_ptr + b * (kept_batch // BLOCK_N) + kv_block) != 0).to(gl.int32)
        first_head = kv_h * group

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], v_desc.layout)
        # Per partition its dS ([kv, q]) for both partitions' dQ, two buffers by step.
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [4, HALF, BLOCK_M], ds_layout)  # (step's buffer, partition)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)  # per partition
        stats_smem = gl.allocate_shared_memory(gl.float32, [STAGES, stats_desc.block_type.shape[0], BLOCK_M],
                                               stats_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)

        gl.warp_specialize([
            (_partition, (dk_ptr, dv_ptr, dk_strides, dv_strides, q_smem, do_smem, k_smem, v_smem, stats_smem,
                          ds_smem, dq_smem, kv_bar, q_ready, q_free, ds_ready, dq_desc, kept_ptr, kept_batch,
                          col_ids_ptr, lists, b, kv_h, kv_block, kv_start, first_head, n_heads, q_len, first_block,
                          n_blocks, window, group, scale, c, 0, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, WINDOWED, KEYED,
                          LISTED, ID_EQUAL)),
            (_partition, (dk_ptr, dv_ptr, dk_strides, dv_strides, q_smem, do_smem, k_smem, v_smem, stats_smem,
                          ds_smem, dq_smem, kv_bar, q_ready, q_free, ds_ready, dq_desc, kept_ptr, kept_batch,
                          col_ids_ptr, lists, b, kv_h, kv_block, kv_start, first_head, n_heads, q_len, first_block,
                          n_blocks, window, group, scale, c, 1, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, WINDOWED, KEYED,
                          LISTED, ID_EQUAL)),
            (_loads, (q_desc, do_desc, k_desc, v_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, stats_smem,
                      kv_bar, q_ready, q_free, q_strides, do_strides, b, n_heads, first_head, k_row,
                      (k_base % k_strides[2]).to(gl.int32), v_row, (v_base % v_strides[2]).to(gl.int32), first_block,
                      n_blocks, group, lists, kv_block, BLOCK_M, STAGES, LISTED))],
            [4, 1], [240, 24])


@triton.jit
def _stats_kernel(Out, Residual, DO, Lse, LogSum, Stats, RowIds, out_strides, do_strides, ids_batch, Nq,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, N_STATS: tl.constexpr):
    """Per query row what the backward's steps read of it, as rows of `Stats` ([B · H, N_STATS, Nq]): the weights'
    exponent offset (the whole shift while the row's max stayed tame, its max · log2(e) past that: see `_step`), 1 / l,
    and delta / l (delta `backward.row_delta`'s: O in the inputs' dtype, with its rounding residual); with `RowIds`
    (int64, a batch's `ids_batch` apart), the row's id, its low and high int32 halves as the bits of rows 3 and 4.
    Program (q block, head, batch)."""
    q_block, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = b * tl.num_programs(1) + h
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = rows < Nq
    max_scaled, shift, inverse_l = row_statistics(Lse, LogSum, bh, rows, Nq, True)  # the Triton backward's
    out = load_tile(Out, b, h, q_block * BLOCK_M, Nq, out_strides, HEAD_DIM, BLOCK_M, HEAD_DIM, True, False)
    do = load_tile(DO, b, h, q_block * BLOCK_M, Nq, do_strides, HEAD_DIM, BLOCK_M, HEAD_DIM, True, False)
    residual = load_tile(Residual, b, h, q_block * BLOCK_M, Nq, out_strides, HEAD_DIM, BLOCK_M, HEAD_DIM, True, False)
    stats = Stats + bh * N_STATS * Nq + rows
    tl.store(stats, -(max_scaled * LOG2E + shift), mask=inside)
    tl.store(stats + Nq, inverse_l, mask=inside)
    tl.store(stats + 2 * Nq, row_delta(out, do, residual, True) * inverse_l, mask=inside)
    if RowIds is not None:
        ids = tl.load(RowIds + b * ids_batch + rows, mask=inside, other=0).to(tl.int64)
        tl.store(stats + 3 * Nq, ids.to(tl.int32).to(tl.float32, bitcast=True), mask=inside)
        tl.store(stats + 4 * Nq, (ids >> 32).to(tl.int32).to(tl.float32, bitcast=True), mask=inside)


@dataclass(frozen=True)
class DocumentIds:
    """What the kernel reads of document ids (`attention.document_mask`): the q rows' ids ([B or 1, Nq]) and the
    keys' ([B or 1, Nk]), int64 and contiguous; whether a key is kept where its id equals the row's (else where it
    differs); the block map at (BLOCK_M, BLOCK_N) tiles whose cols lists the kernel walks; per (batch, query head) 1
    where a row keeps no key ([B, H] contiguous int8, the forward's fallback rows' maximum)."""

    rows: torch.Tensor
    cols: torch.Tensor
    equal: bool
    block_map: BlockMap
    dense: torch.Tensor


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device` (as the sm_90 forward)."""
    return gluon is not None and hopper_forward.available(device)


def serves(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           window: int | None = None, keyed: bool = False, documents: bool = False) -> bool:
    """Whether the kernel computes the gradients of softmax(q kᵀ · scale [causal, in a band of `window` keys, where a
    keep of the keys holds with `keyed`, or where document ids say with `documents`]) v for these [B, H, N, D] tensors
    and dO (faster than the Triton backward at head dims 64 and 128: bench/NOTES.md): where the sm_90 forward serves
    them unmasked or causal (its statistics, or the Triton forward's alike, are the ones read) and dO is laid out as
    rows of one matrix in their dtype; a window where `WINDOWS` says so, a keep of the keys (unmasked otherwise) where
    `KEY_MASKS` does, documents (unmasked, or causal: packed documents) in the forms `DOCUMENTS` names."""
    return (gluon is not None and hopper_forward.serves(q, k, v, causal) and (window is None or WINDOWS and causal)
            and (not keyed or KEY_MASKS and not causal and window is None)
            and (not documents or (q.shape[3], causal) in DOCUMENTS and window is None and not keyed)
            and do.dtype == q.dtype and q.shape[2] % BLOCK_M == 0 and k.shape[2] % BLOCK_N == 0
            and hopper_forward._Rows.of(do) is not None)


DESCRIBED = "the backward ran the sm_90 kernel (warp-specialized, Gluon)"  # in the report, per shape


def fp32_described(stats: torch.Tensor, dq_acc: torch.Tensor, n_stats: int = STATS) -> tuple:
    """The kernel's descriptors of its fp32 operands: `_stats_kernel`'s rows ([B · H · n_stats, Nq]) as the ring's
    boxes, unswizzled (the kernel reads them as plain rows; a box of 8 rows would take a 128-byte swizzle by
    default), and dQ's accumulator ([rows, D]) as its partitions' halves of a step's dQ."""
    d = dq_acc.shape[1]
    return (TensorDescriptor(stats, list(stats.shape), [stats.shape[1], 1], [n_stats, BLOCK_M],
                             gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32)),
            TensorDescriptor(dq_acc, list(dq_acc.shape), [d, 1], [BLOCK_M, d // 2],
                             gl.NVMMASharedLayout.get_default_for([BLOCK_M, d // 2], gl.float32)))


def hopper_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, log_sum: torch.Tensor, scale: float, causal: bool, grads: tuple,
                    residual: torch.Tensor, window: int | None = None,
                    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
                    documents: DocumentIds | None = None) -> None:
    """dQ, dK, dV into `grads` (tensors of q's, k's and v's shapes, any strides; dK and dV summed over the query
    heads sharing a kv head), where `serves`, after the sm_90 forward's training form (or the Triton forward's, for a
    `window`, the keys' keep `kept`, `key_mask.kept_keys`'s at blocks of `BLOCK_N`, or `documents`): `lse`, `log_sum`
    its exact weights' statistics ([B, H, N] contiguous fp32), `residual` the output's rounding residual."""
    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    dq, dk, dv = grads
    n_stats = STATS if documents is None else STATS_WITH_IDS
    stats = torch.empty(batch * q_heads * n_stats, q_len, dtype=torch.float32, device=q.device)
    row_ids = None if documents is None else documents.rows
    _stats_kernel[(triton.cdiv(q_len, STATS_BLOCK), q_heads, batch)](
        out, residual, do, lse, log_sum, stats, row_ids, out.stride(), do.stride(),
        0 if row_ids is None or row_ids.shape[0] == 1 else q_len, q_len, HEAD_DIM=d, BLOCK_M=STATS_BLOCK,
        N_STATS=n_stats)
    # a batch's keys apart, in the keys' keep or ids: 0 where one row serves every batch
    by_keys = kept[0] if kept is not None else documents.cols if documents is not None else None
    keys_batch = 0 if by_keys is None or by_keys.shape[0] == 1 else kv_len
    lists = (None,) * 7
    if documents is not None:
        cols = documents.block_map.cols
        lists = (cols.count, cols.index, *documents.block_map.batch_head_strides, cols.index.shape[-1],
                 cols.count.shape[2], documents.dense)
    dq_acc = torch.zeros(batch, q_heads, q_len, d, dtype=torch.float32, device=q.device)
    rows = hopper_forward._Rows
    described = [rows.of(t).described(t, n) for t, n in ((q, BLOCK_M), (do, BLOCK_M), (k, BLOCK_N // 2),
                                                           (v, BLOCK_N // 2))]
    _hopper_backward[(kv_len // BLOCK_N, batch * kv_heads)](
        *described, *fp32_described(stats, dq_acc.view(-1, d), n_stats), dk, dv, *(kept or (None, None)),
        None if documents is None else documents.cols, lists, q.stride()[:3], do.stride()[:3], k.stride()[:3],
        v.stride()[:3], dk.stride(), dv.stride(), keys_batch, q_heads, q_heads // kv_heads, q_len, window or 0, scale,
        scale * LOG2E.value, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=causal, STAGES=STAGES,
        WINDOWED=window is not None, KEYED=kept is not None, LISTED=documents is not None,
        ID_EQUAL=documents is None or documents.equal, num_warps=4)
    dq.copy_(dq_acc)
