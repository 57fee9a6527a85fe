"""The block map: which tiles of the score matrix a mask keeps fully, partly or not at all.

The flash kernels walk the score matrix in BLOCK_M × BLOCK_N tiles. A tile is FULL when KEEP holds on every
element (the kernel evaluates SCORE only), PARTIAL when it holds on some (KEEP, SCORE and FILL), EMPTY when
on none (skipped: see the fallback rule in docs/flash-kernel-interface.md). A Triton kernel evaluates KEEP
over every tile on the device (or, for a KEEP that compares a value of the query position with one of the key
position, such as document ids, compares each tile's two ranges of values: `ScoreMod.separable_keep`, where a
tile whose elements it cannot tell apart is PARTIAL); a second kernel turns the tile kinds into compact,
ascending lists, both kinds of lists in one launch (two launches in all: a mask that reads tensors is mapped
again on every call, and torch's sort and friends took ~20 launches, which left the GPU waiting on the host):

- `rows`: per (b, h, q block) the FULL and the PARTIAL kv blocks (forward and dQ kernels);
- `cols`: per (b, h, kv block) the FULL and the PARTIAL q blocks (dK/dV kernel).

The kinds and the cols lists may take q blocks of `kind_block_m` rows, a divisor of the rows lists' BLOCK_M: a
rows-list tile is then FULL where all its kind tiles are, EMPTY where all are. So one map serves kernels that
tile the q axis differently (at D128 the forward and dQ kernels at 128 rows, dK/dV at 64), for a mask mapped on
every call.

Key columns past `kv_len` count as masked, so the last kv block is never FULL when `kv_len` is not a multiple
of BLOCK_N: the kernels' PARTIAL path is the one that masks out-of-range keys.

The batch and head axes of the map have size 1 when KEEP does not read `b` / `h`; kernels index them with
`map_bh = b * map_batch_stride + h * map_head_stride`, strides 0 along a broadcast axis. Maps that depend
only on indices are cached per (mask functions, shape, block sizes), shared by the attentions that lift to the
same functions; a KEEP that reads aux tensors (padding masks,
segment ids) is re-evaluated on every call. A cached map is derived from the cached map at base tiles (of at
most MAP_BASE_TILE each way, `_coarser_kinds`), so the kernels of one mask, each at its own tiles, share one
tile-kind kernel (one compile on a first call).
"""
from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusepass.flash.score_mod import ScoreMod, SeparableKeep
from fusepass.runtime.launch import compile_ahead, launch
from fusepass.runtime.sizes import cdiv, next_power_of_2

# Warps and kv tiles per `_tile_kind_kernel` program: at the large shape one warp and one kv tile per program
# mapped the document mask fastest (in programs of 128 rows a little faster than of 64), more kv tiles or more
# warps per program slower. A padding mask maps faster with more kv tiles per program, but is cheaper than the
# document mask either way.
TILE_KIND_WARPS = 1
TILE_KIND_GROUP = 1

# Tile kinds, as stored in `BlockMap.kind`.
EMPTY = tl.constexpr(0)
PARTIAL = tl.constexpr(1)
FULL = tl.constexpr(2)

# Which list of a block `block_list` reads (the second-to-last axis of `TileLists.count` / `.index`).
FULL_LIST = tl.constexpr(0)
PARTIAL_LIST = tl.constexpr(1)


@triton.jit
def block_list(count, index, map_bh, block, n_blocks, n_other_blocks, WHICH: tl.constexpr):
    """Length of, and pointer to, the WHICH list (FULL_LIST / PARTIAL_LIST) of `block` in a TileLists."""
    slot = (map_bh * n_blocks + block) * 2 + WHICH
    return tl.load(count + slot), index + slot.to(tl.int64) * n_other_blocks


@triton.jit
def list_entry(blocks, count, i):
    """Entry i of a block list of `count` entries, 0 past its end.

    A loop over a list reads entry i + 1 while it works on entry i and carries it to the next iteration:
    then no load of the same iteration sits between a tile's operands and their addresses, and Triton's
    pipeliner prefetches them `num_stages - 1` tiles ahead (with the entry loaded in the same iteration, the
    entry's load took one of the stages)."""
    return tl.load(blocks + i, mask=i < count, other=0)


@triton.jit
def walk_start(blocks, count, LISTED: tl.constexpr):
    """What a walk (`walk_step`) carries into its first iteration."""
    if LISTED:
        return list_entry(blocks, count, 0)
    else:
        return 0


@triton.jit
def walk_step(blocks, count, i, ahead, first, LISTED: tl.constexpr):
    """(block, ahead): the i-th block of a walk, and what it carries to the next iteration. With LISTED, entry i
    of the list `blocks` of `count` entries, carried in as `ahead`, and entry i + 1 read now (`list_entry` says
    why one ahead); without a list, the blocks from `first` on."""
    if LISTED:
        return ahead, list_entry(blocks, count, i + 1)
    else:
        return first + i, ahead


@triton.jit
def row_lists(lists, b, h, block, n_blocks, n_other_blocks):
    """(n_full, full, n_partial, partial): both lists of `block` of (b, h) in the row lists `lists`
    (count, index, batch stride, head stride)."""
    count, index, map_batch_stride, map_head_stride = lists
    map_bh = b * map_batch_stride + h * map_head_stride
    n_full, full = block_list(count, index, map_bh, block, n_blocks, n_other_blocks, FULL_LIST)
    n_partial, partial = block_list(count, index, map_bh, block, n_blocks, n_other_blocks, PARTIAL_LIST)
    return n_full, full, n_partial, partial


@triton.jit
def _kind_of(n_kept, n_elements):
    """A tile's kind from how many of its `n_elements` are kept."""
    return tl.where(n_kept == n_elements, FULL, tl.where(n_kept > 0, PARTIAL, EMPTY)).to(tl.int8)


# A map kernel's lengths and block counts bound its loops and masks only, no load's alignment: Triton does not
# specialize on them, so one compiled kernel serves every length (a new length whose block count changed its
# divisibility by 16 compiled the kernel again: bench/NOTES.md, the new-lengths runs).
BY_LENGTH = ["q_len", "kv_len", "n_q_blocks", "n_kv_blocks"]


@triton.jit(do_not_specialize=BY_LENGTH)
def _tile_kind_kernel(Kind, q_len, kv_len, n_q_blocks, n_kv_blocks, map_heads, aux, KEEP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUBTILES: tl.constexpr, GROUP: tl.constexpr):
    """Program (q group, kv group, bh): the kinds of SUBTILES q blocks × GROUP kv blocks, each tile of the
    program's SUBTILES · BLOCK_M rows evaluated at once. Kind is [bh, n_q_blocks, n_kv_blocks]."""
    bh = tl.program_id(2)
    rows = tl.program_id(0) * (SUBTILES * BLOCK_M) + tl.arange(0, SUBTILES * BLOCK_M)
    # Indices past the end are clamped (KEEP may load aux tensors by position); clamped rows repeat the last
    # row, which leaves a tile's count of kept elements FULL or EMPTY as it was, and clamped columns are then
    # counted as masked.
    q_idx = tl.minimum(rows, q_len - 1)[:, None]
    subtile_of_row = tl.arange(0, SUBTILES * BLOCK_M) // BLOCK_M
    for t in tl.static_range(GROUP):
        kv_block = tl.program_id(1) * GROUP + t
        cols = kv_block * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_idx = tl.minimum(cols, kv_len - 1)[None, :]
        kept = (KEEP(bh // map_heads, bh % map_heads, q_idx, kv_idx, aux) & (cols < kv_len)[None, :]).to(tl.int32)
        # Counts of kept elements (one reduction, not a min and a max). KEEP's result may be one row of the
        # tile (a mask of the keys alone), counted as it is: it stands for every row.
        if kept.shape[0] == 1:
            n_kept = tl.sum(kept)
        else:
            n_kept_per_row = tl.sum(kept, 1)
        for sub in tl.static_range(SUBTILES):
            q_block = tl.program_id(0) * SUBTILES + sub
            if kept.shape[0] == 1:
                kind = _kind_of(n_kept, BLOCK_N)
            else:
                kind = _kind_of(tl.sum(tl.where(subtile_of_row == sub, n_kept_per_row, 0)), BLOCK_M * BLOCK_N)
            tl.store(Kind + (bh * n_q_blocks + q_block).to(tl.int64) * n_kv_blocks + kv_block, kind,
                     mask=(q_block < n_q_blocks) & (kv_block < n_kv_blocks))


def _launch_map_kernel(kernel, grid: tuple[int, ...], kind: torch.Tensor, *args, **keywords) -> None:
    """`launch`, or where the map's kinds are a meta stand-in, `compile_ahead`: the kernel starts compiling on a
    thread and nothing is evaluated (the rewrite starts the compiles of the maps a first call builds)."""
    if kind.is_meta:
        compile_ahead(kernel, kind, *args, **keywords)
    else:
        launch(kernel, grid, kind, *args, **keywords)


def launch_tile_kinds(kind: torch.Tensor, keep, aux: tuple, q_len: int, kv_len: int, block_m: int, block_n: int,
                      subtiles: int, num_warps: int, group: int) -> None:
    """Write `kind` ([map batch, map heads, q blocks, kv blocks] int8, tiles of block_m × block_n) by evaluating
    `keep` over every tile: `subtiles` q blocks × `group` kv blocks per program of `num_warps` warps."""
    map_batch, map_heads, n_q_blocks, n_kv_blocks = kind.shape
    grid = (cdiv(n_q_blocks, subtiles), cdiv(n_kv_blocks, group), map_batch * map_heads)
    _launch_map_kernel(_tile_kind_kernel, grid, kind, q_len, kv_len, n_q_blocks, n_kv_blocks, map_heads, aux,
                       KEEP=keep, BLOCK_M=block_m, BLOCK_N=block_n, SUBTILES=subtiles, GROUP=group,
                       num_warps=num_warps)


# Each `_separable_kind_kernel` program maps SEPARABLE_TILES[0] q blocks × SEPARABLE_TILES[1] kv blocks with
# SEPARABLE_TILES[2] warps, from one load of their q and one of their kv positions' values. For the document mask
# at the large shape (64 × 64 kind tiles) 8 × 8 blocks per 1-warp program ran fastest; 1 × 8, with many more
# programs, ran much slower whether its blocks were loaded as one tile or block by block (the programs' number,
# not the loads' latency, was the cost), and larger groups or more warps a little slower.
SEPARABLE_TILES = (8, 8, 1)


@triton.jit(do_not_specialize=BY_LENGTH)
def _separable_kind_kernel(Kind, Others, others_b_stride, others_h_stride, q_len, kv_len, n_q_blocks, n_kv_blocks,
                           map_heads, aux, ROWS: tl.constexpr, COLS: tl.constexpr, EQUAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_BLOCKS: tl.constexpr,
                           KV_BLOCKS: tl.constexpr):
    """Program (q group, kv group, bh): the kinds of KEEP = ``ROWS(q) == COLS(kv)`` (``!=`` where not EQUAL) over
    Q_BLOCKS q blocks × KV_BLOCKS kv blocks, from each block's least and greatest value. Where both ranges are
    one and the same value, == holds on every element and != on none; where the ranges do not meet, == holds on
    none and != on every one; any other tile is PARTIAL, which the flash kernels evaluate element by element,
    so that only FULL and EMPTY need be exact (they are). Kind is [bh, n_q_blocks, n_kv_blocks]. With Others
    (the kinds of masks KEEP joins, at the same tiles, batch and head at those strides), the lesser of the two
    kinds: EMPTY where either is, FULL where both are, else PARTIAL."""
    bh = tl.program_id(2)
    b, h = bh // map_heads, bh % map_heads
    q_block = tl.program_id(0) * Q_BLOCKS + tl.arange(0, Q_BLOCKS)
    kv_block = tl.program_id(1) * KV_BLOCKS + tl.arange(0, KV_BLOCKS)
    # Indices past the end are clamped: a repeated value leaves a block's range as it was.
    q_idx = tl.minimum(q_block[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], q_len - 1)
    kv_idx = tl.minimum(kv_block[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], kv_len - 1)
    rows = ROWS(b, h, q_idx, aux).to(tl.int64)
    cols = COLS(b, h, kv_idx, aux).to(tl.int64)
    rows_min, rows_max = tl.min(rows, 1)[:, None], tl.max(rows, 1)[:, None]
    cols_min, cols_max = tl.min(cols, 1)[None, :], tl.max(cols, 1)[None, :]
    one_value = (rows_min == rows_max) & (cols_min == cols_max) & (rows_min == cols_min)
    apart = (rows_max < cols_min) | (cols_max < rows_min)
    # Keys past the end count as masked: a tile holding some is never FULL.
    all_kept = (one_value if EQUAL else apart) & ((kv_block + 1) * BLOCK_N <= kv_len)[None, :]
    none_kept = apart if EQUAL else one_value
    kind = tl.where(all_kept, FULL, tl.where(none_kept, EMPTY, PARTIAL)).to(tl.int8)
    in_map = (q_block < n_q_blocks)[:, None] & (kv_block < n_kv_blocks)[None, :]
    at = q_block.to(tl.int64)[:, None] * n_kv_blocks + kv_block[None, :]
    if Others is not None:
        others = tl.load(Others + b * others_b_stride + h * others_h_stride + at, mask=in_map, other=EMPTY)
        kind = tl.minimum(kind, others)
    tl.store(Kind + bh.to(tl.int64) * n_q_blocks * n_kv_blocks + at, kind, mask=in_map)


def launch_separable_kinds(kind: torch.Tensor, keep: SeparableKeep, aux: tuple, q_len: int, kv_len: int,
                           block_m: int, block_n: int, others: torch.Tensor | None = None,
                           tiles: tuple[int, int, int] = SEPARABLE_TILES) -> None:
    """Write `kind` (as `launch_tile_kinds` does) for a keep that compares a value of the query position with
    one of the key position (`ScoreMod.separable_keep`): O(block_m + block_n) loads per tile instead of
    block_m · block_n evaluations. `others`: the kinds of the masks it joins, at the same tiles (a batch or
    head extent of 1 broadcast). `tiles`: q blocks, kv blocks and warps per program."""
    map_batch, map_heads, n_q_blocks, n_kv_blocks = kind.shape
    assert others is None or others.shape[2:] == kind.shape[2:] and others.stride()[2:] == (n_kv_blocks, 1)
    strides = (0, 0) if others is None else \
        tuple(stride if size > 1 else 0 for stride, size in zip(others.stride()[:2], others.shape[:2]))
    q_blocks, kv_blocks, num_warps = tiles
    grid = (cdiv(n_q_blocks, q_blocks), cdiv(n_kv_blocks, kv_blocks), map_batch * map_heads)
    _launch_map_kernel(_separable_kind_kernel, grid, kind, others, *strides, q_len, kv_len, n_q_blocks, n_kv_blocks,
                       map_heads, aux, ROWS=keep.rows, COLS=keep.cols, EQUAL=keep.equal, BLOCK_M=block_m,
                       BLOCK_N=block_n, Q_BLOCKS=q_blocks, KV_BLOCKS=kv_blocks, num_warps=num_warps)


@dataclass(frozen=True)
class TileLists:
    """For each (b, h, block) of one axis, the FULL and the PARTIAL blocks of the other axis, ascending.

    `count`: [Bm, Hm, n_blocks, 2] int32, `index`: [Bm, Hm, n_blocks, 2, n_other_blocks] int32, whose first
    `count` entries along the last axis are the list (the rest is padding). Read with `block_list`.
    """

    count: torch.Tensor
    index: torch.Tensor


@dataclass(frozen=True)
class BlockMap:
    block_m: int  # q extent of the rows lists' tiles
    block_n: int
    kind_block_m: int  # q extent of the kinds' and the cols lists' tiles, a divisor of block_m
    kind: torch.Tensor  # [Bm, Hm, n_kind_q_blocks, n_kv_blocks] int8: EMPTY / PARTIAL / FULL
    rows: TileLists  # per q block, its kv blocks
    cols: TileLists  # per kv block, its kind q blocks (all five views of one buffer: `from_packed`)

    @functools.cached_property
    def mean_row_tiles(self) -> float:
        """The kv tiles a q block lists (FULL and PARTIAL), on average over the map (waits for the device)."""
        return self.rows.count.sum(-1, dtype=torch.float64).mean().item()

    @classmethod
    def from_packed(cls, block_m: int, block_n: int, kind_block_m: int, packed: torch.Tensor,
                    extent: tuple[int, int, int, int, int]) -> BlockMap:
        """The map of `extent` (see `map_shapes`) whose tensors `packed` holds."""
        kind_shape, *list_shapes = map_shapes(*extent)
        offsets = _part_offsets(extent)
        # Slices and views: as_strided on a meta tensor (compile_ahead's maps) is slow on its first call
        kind_numel = math.prod(kind_shape)
        kind = packed[offsets[0]:offsets[1]].view(torch.int8)[:kind_numel].view(kind_shape)
        rows_count, rows_index, cols_count, cols_index = (
            packed[offset:offset + math.prod(shape)].view(shape) for shape, offset in zip(list_shapes, offsets[1:]))
        return cls(block_m, block_n, kind_block_m, kind, TileLists(rows_count, rows_index),
                   TileLists(cols_count, cols_index))

    def serves(self, block_m: int, block_n: int, cols: bool) -> bool:
        """Whether a kernel at block_m × block_n tiles can read this map's cols lists and kinds (`cols`) or its
        rows lists."""
        return ((self.kind_block_m if cols else self.block_m), self.block_n) == (block_m, block_n)

    @property
    def batch_head_strides(self) -> tuple[int, int]:
        """(map_batch_stride, map_head_stride): `b * .. + h * ..` is the map's flattened (b, h) index."""
        map_batch, map_heads = self.kind.shape[:2]
        return (map_heads if map_batch > 1 else 0), (1 if map_heads > 1 else 0)


def map_shapes(map_batch: int, map_heads: int, n_q_blocks: int, n_kv_blocks: int, n_kind_q_blocks: int
               ) -> list[tuple[int, ...]]:
    """The shapes of the tensors of a map of that extent (q blocks of the rows lists, kv blocks, q blocks of the
    kinds and cols lists): kind (int8), rows count and index, cols count and index (int32; see `TileLists`)."""
    outer = (map_batch, map_heads)
    return [outer + (n_kind_q_blocks, n_kv_blocks), outer + (n_q_blocks, 2), outer + (n_q_blocks, 2, n_kv_blocks),
            outer + (n_kv_blocks, 2), outer + (n_kv_blocks, 2, n_kind_q_blocks)]


# A map's tensors are views of one int32 buffer: one allocation, and one tensor where the attention op returns,
# saves and keys the forward's map (five, each of them a cost on the host path of every call). Each starts at a
# multiple of 16 bytes, as an allocation of its own would: Triton specializes a pointer on that alignment.
_PART_ALIGN = 4  # int32 elements


@functools.cache
def _part_offsets(extent: tuple[int, int, int, int, int]) -> tuple[int, ...]:
    """The int32 offsets of a map's tensors in its buffer, and the buffer's length last."""
    offsets, end = [], 0
    for i, shape in enumerate(map_shapes(*extent)):
        offsets.append(end)
        numel = math.prod(shape)
        words = cdiv(numel, 4) if i == 0 else numel  # the int8 tile kinds, four to a word
        end += cdiv(words, _PART_ALIGN) * _PART_ALIGN
    return (*offsets, end)


def packed_map_numel(extent: tuple[int, int, int, int, int]) -> int:
    """The int32 elements of the buffer of a map of `extent` (see `map_shapes`)."""
    return _part_offsets(extent)[-1]


@triton.jit
def _compact(kinds, tiles, n, slot, Count, Index):
    """The ascending positions of the FULL tiles among `kinds` (one row or column of a map, `n` tiles), then of
    its PARTIAL tiles, and how many of each, at list `slot`."""
    _list_of(kinds == FULL, tiles, n, Count + slot + FULL_LIST, Index + (slot + FULL_LIST).to(tl.int64) * n)
    _list_of(kinds == PARTIAL, tiles, n, Count + slot + PARTIAL_LIST,
             Index + (slot + PARTIAL_LIST).to(tl.int64) * n)


@triton.jit
def _list_of(selected, tiles, n, count, index):
    """Store the selected tiles' positions at `index`, ascending, and how many at `count`."""
    selected = selected & (tiles < n)
    tl.store(index + tl.cumsum(selected.to(tl.int32), 0) - 1, tiles, mask=selected)
    tl.store(count, tl.sum(selected.to(tl.int32), 0))


# The lists kernel holds a map's row (or column) of tiles in one block of at least this many: maps up to it, at any
# length, share one compile (the block counts are not specialised on either), where a block sized to each map
# compiled the kernel again at almost every new sequence length (bench/new_lengths.py).
LIST_BLOCK_MIN = 128


@triton.jit(do_not_specialize=["n_q_blocks", "n_kind_q_blocks", "n_kv_blocks"])
def _tile_lists_kernel(Kind, RowsCount, RowsIndex, ColsCount, ColsIndex, n_q_blocks, n_kind_q_blocks, n_kv_blocks,
                       ROW_GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Program (block, bh, 0): the FULL and the PARTIAL kv blocks of q block `block` of the rows lists, whose
    tiles each join ROW_GROUP rows of kinds; (block, bh, 1): the kind q blocks of kv block `block`. Kind is
    [bh, n_kind_q_blocks, n_kv_blocks], contiguous."""
    block = tl.program_id(0)
    bh = tl.program_id(1)
    tiles = tl.arange(0, BLOCK)
    Kind_bh = Kind + bh.to(tl.int64) * n_kind_q_blocks * n_kv_blocks
    if tl.program_id(2) == 0:
        if block < n_q_blocks:
            # A row's tile is FULL where the kinds of its rows that exist all are, EMPTY where all are.
            kind_rows = block * ROW_GROUP + tl.arange(0, ROW_GROUP)
            exists = kind_rows < n_kind_q_blocks
            kinds = tl.load(Kind_bh + kind_rows[:, None] * n_kv_blocks + tiles[None, :],
                            mask=exists[:, None] & (tiles < n_kv_blocks)[None, :], other=EMPTY)
            n_rows = tl.sum(exists.to(tl.int32))
            n_full = tl.sum((kinds == FULL).to(tl.int32), 0)
            n_empty = tl.sum(((kinds == EMPTY) & exists[:, None]).to(tl.int32), 0)
            row = tl.where(n_full == n_rows, FULL, tl.where(n_empty == n_rows, EMPTY, PARTIAL))
            _compact(row, tiles, n_kv_blocks, (bh * n_q_blocks + block) * 2, RowsCount, RowsIndex)
    elif block < n_kv_blocks:
        column = tl.load(Kind_bh + tiles * n_kv_blocks + block, mask=tiles < n_kind_q_blocks, other=EMPTY)
        _compact(column, tiles, n_kind_q_blocks, (bh * n_kv_blocks + block) * 2, ColsCount, ColsIndex)


def _write_tile_lists(block_map: BlockMap) -> None:
    """The rows and the cols lists of a map from its tile kinds, in one launch (a map that reads tensors is
    built on every call, where each launch costs host time)."""
    n_kind_q_blocks, n_kv_blocks = block_map.kind.shape[2:]
    n_q_blocks = block_map.rows.count.shape[2]
    grid = (max(n_q_blocks, n_kv_blocks), block_map.kind[..., 0, 0].numel(), 2)
    _launch_map_kernel(_tile_lists_kernel, grid, block_map.kind, block_map.rows.count, block_map.rows.index,
                       block_map.cols.count, block_map.cols.index, n_q_blocks, n_kind_q_blocks, n_kv_blocks,
                       ROW_GROUP=block_map.block_m // block_map.kind_block_m,
                       BLOCK=max(LIST_BLOCK_MIN, next_power_of_2(max(n_kind_q_blocks, n_kv_blocks))))


def _batch_head_extent(mod: ScoreMod, batch: int, heads: int) -> tuple[int, int]:
    """The batch and head extents of `mod`'s map: 1 where KEEP does not read that index."""
    return (batch if mod.keep_uses_batch else 1), (heads if mod.keep_uses_head else 1)


def map_extent(map_batch: int, map_heads: int, q_len: int, kv_len: int, block_m: int, block_n: int,
               kind_block_m: int) -> tuple[int, int, int, int, int]:
    """The extent of a map (see `map_shapes`) of these batch and head extents, lengths and tiles."""
    assert block_m % kind_block_m == 0, f"kind tiles of {kind_block_m} rows do not divide tiles of {block_m}"
    return map_batch, map_heads, cdiv(q_len, block_m), cdiv(kv_len, block_n), cdiv(q_len, kind_block_m)


def empty_block_map(mod: ScoreMod, batch: int, heads: int, q_len: int, kv_len: int, block_m: int, block_n: int,
                    device: torch.device | str, kind_block_m: int | None = None) -> BlockMap:
    """`mod`'s map at this shape, unwritten: for `build_block_map` to write, or on "meta" what a kernel launch
    reads of a map for its signature (dtypes and strides) without evaluating the mask (for `compile_ahead`).
    `kind_block_m`: the q extent of its kinds and cols lists, block_m unless given."""
    kind_block_m = kind_block_m or block_m
    extent = map_extent(*_batch_head_extent(mod, batch, heads), q_len, kv_len, block_m, block_n, kind_block_m)
    packed = torch.empty(packed_map_numel(extent), dtype=torch.int32, device=device)
    return BlockMap.from_packed(block_m, block_n, kind_block_m, packed, extent)


def build_block_map(mod: ScoreMod, aux: tuple, batch: int, heads: int, q_len: int, kv_len: int,
                    block_m: int, block_n: int, device: torch.device, into: BlockMap | None = None,
                    kind_block_m: int | None = None) -> BlockMap:
    """Classify every tile (no cache), into `into` (the `empty_block_map` of these arguments) or new tensors:
    `mod.keep` evaluated on every element, or, where it is separable, each tile's two ranges compared.
    `heads` counts query heads."""
    assert mod.has_mask, "an attention without a mask has no block map: every tile is full"
    kind_block_m = kind_block_m or block_m
    block_map = into or empty_block_map(mod, batch, heads, q_len, kv_len, block_m, block_n, device, kind_block_m)
    assert (block_map.block_m, block_map.block_n, block_map.kind_block_m, *block_map.kind.shape[2:]) == \
        (block_m, block_n, kind_block_m, cdiv(q_len, kind_block_m), cdiv(kv_len, block_n)), "a map of other tiles"
    separable = mod.separable_keep
    if separable is not None:
        others = None if separable.others is None else block_map_for(
            separable.others, aux, batch, heads, q_len, kv_len, block_m, block_n, device,
            kind_block_m=kind_block_m).kind
        launch_separable_kinds(block_map.kind, separable, aux, q_len, kv_len, kind_block_m, block_n, others)
    else:
        # Each program evaluates tiles of the rows lists' height (a count per kind tile within): 64-row kinds
        # under 128-row lists mapped the document mask as fast as 128-row kinds alone, and faster than 64-row
        # kinds in programs of their own.
        launch_tile_kinds(block_map.kind, mod.keep, aux, q_len, kv_len, kind_block_m, block_n,
                          block_m // kind_block_m, TILE_KIND_WARPS, TILE_KIND_GROUP)
    _write_tile_lists(block_map)
    return block_map


_CACHE_SIZE = 64
_cache: OrderedDict[tuple, BlockMap] = OrderedDict()

# The largest kind tile of the maps that cached maps at larger tiles are derived from: the finest tiles the
# flash kernels take at D128 (dK/dV's 64 × 64), so the forward's 128 × 128 and dQ's 128 × 64 come from it.
# Each kernel's map took a tile-kind kernel of its own, each a slow compile on a first call with an empty Triton
# cache.
MAP_BASE_TILE = 64


def _coarser_kinds(kind: torch.Tensor, q_factor: int, kv_factor: int, n_q_blocks: int, n_kv_blocks: int,
                   kv_len: int, block_n: int) -> torch.Tensor:
    """The kinds of tiles `q_factor` × `kv_factor` times those of `kind` (which covers the same lengths): FULL
    where every finer tile is, EMPTY where every one is, PARTIAL otherwise. Finer tiles past the lengths do not
    exist; a last kv tile reaching past `kv_len` is never FULL (its keys past the end count as masked, as
    `_tile_kind_kernel` counts them)."""
    map_batch, map_heads, fine_q, fine_kv = kind.shape
    pad = (0, n_kv_blocks * kv_factor - fine_kv, 0, n_q_blocks * q_factor - fine_q)
    shape = (map_batch, map_heads, n_q_blocks, q_factor, n_kv_blocks, kv_factor)
    least = torch.nn.functional.pad(kind, pad, value=FULL.value).view(shape).amin((3, 5))
    most = torch.nn.functional.pad(kind, pad, value=EMPTY.value).view(shape).amax((3, 5))
    coarse = torch.where(least == most, least, PARTIAL.value)
    if n_kv_blocks * block_n > kv_len:
        coarse[..., -1].clamp_(max=PARTIAL.value)
    return coarse


class _Identity:
    """A value keyed by identity, and held, so that its id is not reused while a key names it (hashing a jit
    function reads its cache key, which Triton computes once dependencies' keys are settled: not here)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


def capturing(device: torch.device | str) -> bool:
    """Whether the current stream of `device` captures a CUDA graph (nothing may wait on the device)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def block_map_for(mod: ScoreMod, aux: tuple, batch: int, heads: int, q_len: int, kv_len: int,
                  block_m: int, block_n: int, device: torch.device, into: BlockMap | None = None,
                  kind_block_m: int | None = None) -> BlockMap:
    """The block map of `mod` at this shape: cached unless KEEP reads aux tensors, in which case it is built
    into `into` where given (see `build_block_map`). A cached map whose tiles are not the base tiles (of at
    most MAP_BASE_TILE each way) is derived from the cached map at those. A cached map is built without `aux`
    (its KEEP reads none). On "meta" nothing is evaluated or cached: the kernels that build the map start
    compiling (`compile_ahead`; `fusepass.flash.ahead` at the rewrite). A map built while the stream
    captures a CUDA graph (`fusepass.runtime.replay`) is not cached: it is written only when the graph
    replays, and not at all if the capture fails."""
    if mod.keep_reads_aux:
        return build_block_map(mod, aux, batch, heads, q_len, kv_len, block_m, block_n, device, into, kind_block_m)
    key = (*map(_Identity, mod.mask_functions), *_batch_head_extent(mod, batch, heads), q_len, kv_len, block_m,
           block_n, kind_block_m, torch.device(device))
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    kind_m = kind_block_m or block_m
    base_m, base_n = min(kind_m, MAP_BASE_TILE), min(block_n, MAP_BASE_TILE)
    if (base_m, base_n) == (block_m, block_n) and kind_m == block_m:
        block_map = build_block_map(mod, (), batch, heads, q_len, kv_len, block_m, block_n, device,
                                    kind_block_m=kind_block_m)
    else:
        assert kind_m % base_m == 0 and block_n % base_n == 0, "tiles are powers of two"
        base = block_map_for(mod, (), batch, heads, q_len, kv_len, base_m, base_n, device)
        block_map = empty_block_map(mod, batch, heads, q_len, kv_len, block_m, block_n, device, kind_block_m)
        block_map.kind.copy_(_coarser_kinds(base.kind, kind_m // base_m, block_n // base_n,
                                            *block_map.kind.shape[2:], kv_len, block_n))
        _write_tile_lists(block_map)
    if capturing(device) or torch.device(device).type == "meta":
        return block_map
    _cache[key] = block_map
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return block_map
