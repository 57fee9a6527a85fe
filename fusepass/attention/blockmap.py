"""The block map: which tiles of the score matrix a mask keeps fully, partly or not at all.

The flash kernels walk the score matrix in BLOCK_M × BLOCK_N tiles. A tile is FULL when KEEP holds on every
element (the kernel evaluates SCORE only), PARTIAL when it holds on some (KEEP, SCORE and FILL), EMPTY when
on none (skipped: see the fallback rule in docs/flash-kernel-interface.md). A Triton kernel evaluates KEEP
over every tile on the device; a second kernel turns the tile kinds into compact, ascending lists, both
kinds of lists in one launch (two launches in all: a mask that reads tensors is mapped again on every call,
and torch's sort and friends took ~20 launches, which left the GPU waiting on the host):

- `rows`: per (b, h, q block) the FULL and the PARTIAL kv blocks (forward and dQ kernels);
- `cols`: per (b, h, kv block) the FULL and the PARTIAL q blocks (dK/dV kernel).

Key columns past `kv_len` count as masked, so the last kv block is never FULL when `kv_len` is not a multiple
of BLOCK_N: the kernels' PARTIAL path is the one that masks out-of-range keys.

The batch and head axes of the map have size 1 when KEEP does not read `b` / `h`; kernels index them with
`map_bh = b * map_batch_stride + h * map_head_stride`, strides 0 along a broadcast axis. Maps that depend
only on indices are cached per (mod.name, shape, block sizes); a KEEP that reads aux tensors (padding masks,
segment ids) is re-evaluated on every call.
"""
from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusepass.attention.score_mod import ScoreMod
from fusepass.kernels.launch import launch
from fusepass.kernels.sizes import cdiv, next_power_of_2

# Warps of a `_tile_kind_kernel` program: the document mask mapped in 40 µs at 2, 120 at 4 and 123 at 1
# (bench/results/tile-kind-sweep-2026-11-30-0521; a padding mask 14–16 µs at any).
TILE_KIND_WARPS = 2

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
def row_lists(lists, b, h, block, n_blocks, n_other_blocks):
    """(n_full, full, n_partial, partial): both lists of `block` of (b, h) in the row lists `lists`
    (count, index, batch stride, head stride)."""
    count, index, map_batch_stride, map_head_stride = lists
    map_bh = b * map_batch_stride + h * map_head_stride
    n_full, full = block_list(count, index, map_bh, block, n_blocks, n_other_blocks, FULL_LIST)
    n_partial, partial = block_list(count, index, map_bh, block, n_blocks, n_other_blocks, PARTIAL_LIST)
    return n_full, full, n_partial, partial


@triton.jit
def _tile_kind_kernel(Kind, q_len, kv_len, map_heads, aux, KEEP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    q_block = tl.program_id(0)
    kv_block = tl.program_id(1)
    bh = tl.program_id(2)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kv_block * BLOCK_N + tl.arange(0, BLOCK_N)
    # Indices past the end are clamped (KEEP may load aux tensors by position); clamped rows repeat the last
    # row, which leaves any/all unchanged, and clamped columns are then counted as masked.
    q_idx = tl.minimum(rows, q_len - 1)[:, None]
    kv_idx = tl.minimum(cols, kv_len - 1)[None, :]
    kept = KEEP(bh // map_heads, bh % map_heads, q_idx, kv_idx, aux) & (cols < kv_len)[None, :]
    kept = kept.to(tl.int32)
    kind = tl.where(tl.min(kept) == 1, FULL, tl.where(tl.max(kept) == 1, PARTIAL, EMPTY))
    n_q_blocks = tl.num_programs(0)
    n_kv_blocks = tl.num_programs(1)
    tl.store(Kind + (bh * n_q_blocks + q_block).to(tl.int64) * n_kv_blocks + kv_block, kind.to(tl.int8))


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
    block_m: int
    block_n: int
    kind: torch.Tensor  # [Bm, Hm, n_q_blocks, n_kv_blocks] int8: EMPTY / PARTIAL / FULL
    rows: TileLists  # per q block, its kv blocks
    cols: TileLists  # per kv block, its q blocks (all five views of one buffer: `from_packed`)

    @functools.cached_property
    def mean_row_tiles(self) -> float:
        """The kv tiles a q block lists (FULL and PARTIAL), on average over the map (waits for the device)."""
        return self.rows.count.sum(-1, dtype=torch.float64).mean().item()

    @classmethod
    def from_packed(cls, block_m: int, block_n: int, packed: torch.Tensor, extent: tuple[int, int, int, int]
                    ) -> BlockMap:
        """The map of `extent` (map batch, map heads, q blocks, kv blocks) whose tensors `packed` holds."""
        kind_shape, *list_shapes = map_shapes(*extent)
        offsets = _part_offsets(extent)
        # Slices and views: as_strided on a meta tensor (compile_ahead's maps) took 0.14 s on its first call
        kind_numel = math.prod(kind_shape)
        kind = packed[offsets[0]:offsets[1]].view(torch.int8)[:kind_numel].view(kind_shape)
        rows_count, rows_index, cols_count, cols_index = (
            packed[offset:offset + math.prod(shape)].view(shape) for shape, offset in zip(list_shapes, offsets[1:]))
        return cls(block_m, block_n, kind, TileLists(rows_count, rows_index), TileLists(cols_count, cols_index))

    @property
    def batch_head_strides(self) -> tuple[int, int]:
        """(map_batch_stride, map_head_stride): `b * .. + h * ..` is the map's flattened (b, h) index."""
        map_batch, map_heads = self.kind.shape[:2]
        return (map_heads if map_batch > 1 else 0), (1 if map_heads > 1 else 0)


def map_shapes(map_batch: int, map_heads: int, n_q_blocks: int, n_kv_blocks: int) -> list[tuple[int, ...]]:
    """The shapes of a map's tensors: kind (int8), rows count and index, cols count and index (int32; see
    `TileLists`)."""
    outer = (map_batch, map_heads)
    return [outer + (n_q_blocks, n_kv_blocks), outer + (n_q_blocks, 2), outer + (n_q_blocks, 2, n_kv_blocks),
            outer + (n_kv_blocks, 2), outer + (n_kv_blocks, 2, n_q_blocks)]


# A map's tensors are views of one int32 buffer: one allocation, and one tensor where the attention op returns,
# saves and keys the forward's map (five, each of them a cost on the host path of every call). Each starts at a
# multiple of 16 bytes, as an allocation of its own would: Triton specializes a pointer on that alignment.
_PART_ALIGN = 4  # int32 elements


@functools.cache
def _part_offsets(extent: tuple[int, int, int, int]) -> tuple[int, ...]:
    """The int32 offsets of a map's tensors in its buffer, and the buffer's length last."""
    offsets, end = [], 0
    for i, shape in enumerate(map_shapes(*extent)):
        offsets.append(end)
        numel = math.prod(shape)
        words = cdiv(numel, 4) if i == 0 else numel  # the int8 tile kinds, four to a word
        end += cdiv(words, _PART_ALIGN) * _PART_ALIGN
    return (*offsets, end)


def packed_map_numel(extent: tuple[int, int, int, int]) -> int:
    """The int32 elements of the buffer of a map of `extent` (map batch, map heads, q blocks, kv blocks)."""
    return _part_offsets(extent)[-1]


@triton.jit
def _compact_row(Kind, Count, Index, row, bh, rows, n, row_stride, col_stride, BLOCK: tl.constexpr):
    """For one row of a tile-kind map (`rows` rows of `n` tiles per (b, h), strides in tiles): the ascending
    positions of its FULL tiles, then of its PARTIAL tiles, and how many of each."""
    tiles = tl.arange(0, BLOCK)
    kinds = tl.load(Kind + bh.to(tl.int64) * rows * n + row * row_stride + tiles * col_stride, mask=tiles < n,
                    other=EMPTY)
    slot = (bh * rows + row) * 2
    _list_of(kinds == FULL, tiles, n, Count + slot + FULL_LIST, Index + (slot + FULL_LIST).to(tl.int64) * n)
    _list_of(kinds == PARTIAL, tiles, n, Count + slot + PARTIAL_LIST,
             Index + (slot + PARTIAL_LIST).to(tl.int64) * n)


@triton.jit
def _list_of(selected, tiles, n, count, index):
    """Store the selected tiles' positions at `index`, ascending, and how many at `count`."""
    selected = selected & (tiles < n)
    tl.store(index + tl.cumsum(selected.to(tl.int32), 0) - 1, tiles, mask=selected)
    tl.store(count, tl.sum(selected.to(tl.int32), 0))


@triton.jit
def _tile_lists_kernel(Kind, RowsCount, RowsIndex, ColsCount, ColsIndex, n_q_blocks, n_kv_blocks,
                       BLOCK: tl.constexpr):
    """Program (block, bh, 0): the FULL and the PARTIAL kv blocks of q block `block`; (block, bh, 1): the q
    blocks of kv block `block`. Kind is [bh, n_q_blocks, n_kv_blocks], contiguous."""
    block = tl.program_id(0)
    bh = tl.program_id(1)
    if tl.program_id(2) == 0:
        if block < n_q_blocks:
            _compact_row(Kind, RowsCount, RowsIndex, block, bh, n_q_blocks, n_kv_blocks, n_kv_blocks, 1, BLOCK)
    elif block < n_kv_blocks:
        _compact_row(Kind, ColsCount, ColsIndex, block, bh, n_kv_blocks, n_q_blocks, 1, n_kv_blocks, BLOCK)


def _write_tile_lists(block_map: BlockMap) -> None:
    """The rows and the cols lists of a map from its tile kinds, in one launch (a map that reads tensors is
    built on every call, where each launch costs host time)."""
    kind = block_map.kind
    n_q_blocks, n_kv_blocks = kind.shape[2:]
    launch(_tile_lists_kernel, (max(n_q_blocks, n_kv_blocks), kind[..., 0, 0].numel(), 2), kind,
           block_map.rows.count, block_map.rows.index, block_map.cols.count, block_map.cols.index, n_q_blocks,
           n_kv_blocks, BLOCK=next_power_of_2(max(n_q_blocks, n_kv_blocks)))


def _map_extent(mod: ScoreMod, batch: int, heads: int) -> tuple[int, int]:
    """The batch and head extents of `mod`'s map: 1 where KEEP does not read that index."""
    return (batch if mod.keep_uses_batch else 1), (heads if mod.keep_uses_head else 1)


def empty_block_map(mod: ScoreMod, batch: int, heads: int, q_len: int, kv_len: int, block_m: int, block_n: int,
                    device: torch.device | str) -> BlockMap:
    """`mod`'s map at this shape, unwritten: for `build_block_map` to write, or on "meta" what a kernel launch
    reads of a map for its signature (dtypes and strides) without evaluating the mask (for `compile_ahead`)."""
    extent = (*_map_extent(mod, batch, heads), cdiv(q_len, block_m), cdiv(kv_len, block_n))
    packed = torch.empty(packed_map_numel(extent), dtype=torch.int32, device=device)
    return BlockMap.from_packed(block_m, block_n, packed, extent)


def build_block_map(mod: ScoreMod, aux: tuple, batch: int, heads: int, q_len: int, kv_len: int,
                    block_m: int, block_n: int, device: torch.device, into: BlockMap | None = None) -> BlockMap:
    """Evaluate `mod.keep` over every tile (no cache), into `into` (the `empty_block_map` of these arguments)
    or new tensors. `heads` counts query heads."""
    assert mod.has_mask, "an attention without a mask has no block map: every tile is full"
    block_map = into or empty_block_map(mod, batch, heads, q_len, kv_len, block_m, block_n, device)
    map_batch, map_heads, n_q_blocks, n_kv_blocks = block_map.kind.shape
    assert (block_map.block_m, block_map.block_n, n_q_blocks, n_kv_blocks) == \
        (block_m, block_n, cdiv(q_len, block_m), cdiv(kv_len, block_n)), "a map of other tiles"
    grid = (n_q_blocks, n_kv_blocks, map_batch * map_heads)
    launch(_tile_kind_kernel, grid, block_map.kind, q_len, kv_len, map_heads, aux, KEEP=mod.keep, BLOCK_M=block_m,
           BLOCK_N=block_n, num_warps=TILE_KIND_WARPS)
    _write_tile_lists(block_map)
    return block_map


_CACHE_SIZE = 64
_cache: OrderedDict[tuple, BlockMap] = OrderedDict()


def _capturing(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def block_map_for(mod: ScoreMod, aux: tuple, batch: int, heads: int, q_len: int, kv_len: int,
                  block_m: int, block_n: int, device: torch.device, into: BlockMap | None = None) -> BlockMap:
    """The block map of `mod` at this shape: cached unless KEEP reads aux tensors, in which case it is built
    into `into` where given (see `build_block_map`). A map built while the stream captures a CUDA graph
    (`fusepass.kernels.replay`) is not cached: it is written only when the graph replays, and not at all if
    the capture fails."""
    if mod.keep_reads_aux:
        return build_block_map(mod, aux, batch, heads, q_len, kv_len, block_m, block_n, device, into)
    key = (mod.name, batch if mod.keep_uses_batch else 1, heads if mod.keep_uses_head else 1,
           q_len, kv_len, block_m, block_n, torch.device(device))
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    block_map = build_block_map(mod, aux, batch, heads, q_len, kv_len, block_m, block_n, device)
    if _capturing(device):
        return block_map
    _cache[key] = block_map
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return block_map
