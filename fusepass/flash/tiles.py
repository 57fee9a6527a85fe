"""The tiles the flash kernels read and write, and where their programs are: jit helpers the forward and backward
kernels share (loads of row tiles, through TMA descriptors where the layout allows, the positions of a tile, the
scores under a mask, dropout's kept elements, the programs' order over (batch, head) pairs), and the host side of
the descriptors."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusepass.runtime.device import INTERPRETED


@triton.jit
def dot(a, b, acc=None):
    """acc + a @ b, accumulated in fp32 (in `acc` itself when given); fp32 operands in full precision (no TF32)
    so results match eager fp32."""
    if INTERPRETED:
        # Each element's products summed in one order, wherever it lies in the tile, as the GPU's MMA sums them:
        # numpy's matmul (OpenBLAS's Haswell and Zen kernels) sums edge elements in another order than the rest,
        # and the backward's delta, a dot beside dp's, must round as dp does (a saturated row's gradient is their
        # difference). bf16 bit patterns are multiplied as fp32 (the interpreter multiplies the raw bits).
        products = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        return products if acc is None else acc + products
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def truncated(x, like):
    """float32 `x` cut to the mantissa of `like`'s dtype (fp16 or bf16): the value that dtype holds, rounded toward
    zero, by one bitwise and (for weights in [2^-14, 1], fp16's normal range, where it holds every such value). The
    forward's weights for their product with V, and the backward's same weights, without a conversion each way."""
    if like.dtype == tl.bfloat16:
        kept = 0xFFFF0000
    else:
        kept = 0xFFFFE000
    return (x.to(tl.uint32, bitcast=True) & kept).to(tl.float32, bitcast=True)


@triton.jit
def load_rows(base, rows, n_rows, row_stride, d_stride, HEAD_DIM: tl.constexpr, FIRST_COL: tl.constexpr,
              BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Columns FIRST_COL .. FIRST_COL + BLOCK_D of rows `rows` of an [n_rows, HEAD_DIM] matrix: zeros past HEAD_DIM
    and, when CHECK_ROWS, past the last row."""
    offs_d = FIRST_COL + tl.arange(0, BLOCK_D)
    ptrs = base + rows.to(tl.int64)[:, None] * row_stride + offs_d[None, :] * d_stride
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif FIRST_COL + BLOCK_D <= HEAD_DIM:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _load_columns(src, b, head, row0, n_rows, strides, HEAD_DIM: tl.constexpr, FIRST_COL: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr,
                  DESCRIPTOR: tl.constexpr):
    """Columns FIRST_COL .. FIRST_COL + BLOCK_D of `load_tile`'s rows; `src` a descriptor of [1, 1, BLOCK_ROWS,
    BLOCK_D] tiles when DESCRIPTOR."""
    if DESCRIPTOR:
        tile = src.load([b, head, row0, FIRST_COL]).reshape(BLOCK_ROWS, BLOCK_D)
    else:
        base = src + b.to(tl.int64) * strides[0] + head.to(tl.int64) * strides[1]
        tile = load_rows(base, row0 + tl.arange(0, BLOCK_ROWS), n_rows, strides[2], strides[3], HEAD_DIM, FIRST_COL,
                         BLOCK_D, CHECK_ROWS)
    return tile


@triton.jit
def load_tile(src, b, head, row0, n_rows, strides, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
              BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, DESCRIPTOR: tl.constexpr):
    """Rows row0 .. row0 + BLOCK_ROWS of one (batch, head) of a [B, H, n_rows, HEAD_DIM] tensor, zeros past
    HEAD_DIM (and past n_rows, where CHECK_ROWS; a descriptor's copy always fills them with zeros). `src` is
    the tensor's descriptor of [1, 1, BLOCK_ROWS, BLOCK_D] tiles when DESCRIPTOR (see `tile_operands`), else
    the tensor, with `strides`."""
    return _load_columns(src, b, head, row0, n_rows, strides, HEAD_DIM, 0, BLOCK_ROWS, BLOCK_D, CHECK_ROWS,
                         DESCRIPTOR)


@triton.jit
def load_parts(src, src2, b, head, row0, n_rows, strides, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, CHECK_ROWS: tl.constexpr, DESCRIPTOR: tl.constexpr):
    """`load_tile`'s rows of Q or K in the parts of its head dim (`config.head_blocks`): a tuple of one tile
    (columns 0 .. BLOCK_D) or, where BLOCK_D2 > 0, two (and columns BLOCK_D .. BLOCK_D + BLOCK_D2). `src` reads the
    first part and `src2` the second (`tile_operands`: their descriptors, or the tensor twice; `src2` None where
    BLOCK_D2 is 0). A tuple of parts, never one holding None: Triton 3.6 takes no None inside a tuple."""
    first = _load_columns(src, b, head, row0, n_rows, strides, HEAD_DIM, 0, BLOCK_ROWS, BLOCK_D, CHECK_ROWS,
                          DESCRIPTOR)
    parts = (first,)
    if BLOCK_D2 > 0:
        second = _load_columns(src2, b, head, row0, n_rows, strides, HEAD_DIM, BLOCK_D, BLOCK_ROWS, BLOCK_D2,
                               CHECK_ROWS, DESCRIPTOR)
        parts = (first, second)
    return parts


@triton.jit
def parts_scores(a, b):
    """a · bᵀ of two tiles in parts (`load_parts`): one product per part, summed in one fp32 accumulator (q · kᵀ
    at 192 = 128 + 64 columns instead of one product over 256, a quarter of them zeros)."""
    s = dot(a[0], tl.trans(b[0]))
    if len(a) > 1:
        s = dot(a[1], tl.trans(b[1]), s)
    return s


@triton.jit
def parts_product(a, b, acc):
    """acc + a @ b for `b` and `acc` in parts (`load_parts`), part by part: dQ's ds · K, dK's dsᵀ · Q."""
    first = dot(a, b[0], acc[0])
    product = (first,)
    if len(b) > 1:
        product = (first, dot(a, b[1], acc[1]))
    return product


@triton.jit
def zero_parts(BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """fp32 accumulators of BLOCK_ROWS rows in the parts of a head dim (`load_parts`)."""
    first = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
    parts = (first,)
    if BLOCK_D2 > 0:
        parts = (first, tl.zeros([BLOCK_ROWS, BLOCK_D2], tl.float32))
    return parts


@triton.jit
def store_rows(base, tile, rows, n_rows, row_stride, offs_d, d_stride, HEAD_DIM: tl.constexpr):
    ptrs = base + rows.to(tl.int64)[:, None] * row_stride + offs_d[None, :] * d_stride
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def store_parts(base, parts, rows, n_rows, row_stride, d_stride, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_D2: tl.constexpr):
    """`store_rows` of a tile in the parts of its head dim (`load_parts`)."""
    store_rows(base, parts[0], rows, n_rows, row_stride, tl.arange(0, BLOCK_D), d_stride, HEAD_DIM)
    if BLOCK_D2 > 0:
        store_rows(base, parts[1], rows, n_rows, row_stride, BLOCK_D + tl.arange(0, BLOCK_D2), d_stride, HEAD_DIM)


# Where the last tile along a walked axis lies (`tail_placement`): the axis's length a multiple of the tile
# (WHOLE), the last tile moved back to end at the length (SHIFTED), or its positions clamped (CLAMPED).
WHOLE = tl.constexpr(0)
SHIFTED = tl.constexpr(1)
CLAMPED = tl.constexpr(2)


def tail_placement(n: int, block: int, shift: bool) -> int:
    """How the kernels place the last of an axis's tiles of `block` positions (`tile_positions`): SHIFTED only
    where `shift` (the axis's tiles past the last position are never FULL, so that loop takes no shifted tile)
    and one tile fits."""
    if n % block == 0:
        return WHOLE.value
    return SHIFTED.value if shift and n > block else CLAMPED.value


@triton.jit
def tile_positions(block, n, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """(first row, positions, in range) of tile `block` along an axis of `n` positions, placed by TAIL
    (`tail_placement`): the row its K and V are loaded from, the positions its score functions see (they may
    read aux tensors by position: never past n), and which of them are the tile's own and before n (the kv
    axis's others score -inf).

    WHOLE: no tile reaches past n and every position is in range; a block past the end (the dK/dV walk takes
    one: its rows, loaded past n, weigh nothing) sees the last block's positions. SHIFTED: the last tile starts at n - BLOCK, its positions before the block's own
    first out of range (the tile before holds them). CLAMPED: positions past n read position n - 1. A clamp per
    element hid the positions' contiguity from Triton: its loads by position (the document ids of a PARTIAL
    tile) then took a copy and a 64-bit address per element and thread (16 LDGSTS.E.64 a tile in the dQ
    kernel, sm_90, triton 3.6); shifted, they stay one run (aligned where n is a multiple of 16)."""
    if TAIL == WHOLE:
        positions = tl.minimum(block, n // BLOCK - 1) * BLOCK + tl.arange(0, BLOCK)
        return block * BLOCK, positions, tl.full([BLOCK], 1, tl.int1)
    elif TAIL == SHIFTED:
        first = tl.minimum(block * BLOCK, n - BLOCK)
        positions = first + tl.arange(0, BLOCK)
        return first, positions, positions >= block * BLOCK
    else:
        positions = block * BLOCK + tl.arange(0, BLOCK)
        return block * BLOCK, tl.minimum(positions, n - 1), positions < n


@triton.jit
def load_kv_tile(K, K2, V, b, kv_head, kv_block, Nk, k_strides, v_strides, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                 BLOCK_DV: tl.constexpr, PARTIAL: tl.constexpr, DESCRIPTORS: tl.constexpr, KV_TAIL: tl.constexpr):
    """(columns, K tile in the parts of its head dim (`load_parts`), V tile) of kv tile `kv_block` where it lies
    (`tile_positions`): only PARTIAL tiles may be the last."""
    if PARTIAL:
        first, _, _ = tile_positions(kv_block, Nk, BLOCK_N, KV_TAIL)
    else:
        first = kv_block * BLOCK_N
    k = load_parts(K, K2, b, kv_head, first, Nk, k_strides, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_D2, PARTIAL,
                   DESCRIPTORS)
    v = load_tile(V, b, kv_head, first, Nk, v_strides, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PARTIAL, DESCRIPTORS)
    return first + tl.arange(0, BLOCK_N), k, v


@triton.jit
def masked_scores(s, b, h, q_idx, kv_idx, kv_in, aux, SCORE: tl.constexpr, KEEP: tl.constexpr,
                  FILL: tl.constexpr):
    """Final scores of a PARTIAL tile, and where they are kept: `where(KEEP, SCORE, FILL)` inside the key
    range, -inf past it (out-of-range keys never contribute, not even to a fully masked row)."""
    if KEEP is None:
        kept = kv_in
        x = SCORE(s, b, h, q_idx, kv_idx, aux)
    else:
        kept = KEEP(b, h, q_idx, kv_idx, aux) & kv_in
        x = tl.where(kept, SCORE(s, b, h, q_idx, kv_idx, aux), FILL(s, b, h, q_idx, kv_idx, aux))
    return tl.where(kv_in, x, float("-inf")), kept


@triton.jit
def dropout_seed(Seed, DROPOUT: tl.constexpr):
    """Dropout's seed, read from the one-element tensor `Seed` the call draws it into on the attention's device (so
    that a CUDA graph's replay, which draws it again, drops other weights each time); 0 without dropout."""
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    return seed


@triton.jit
def dropout_kept(seed, dropout_p, row_offsets, cols):
    """The dropout mask of a tile (True: weight kept), from a counter-based RNG keyed by the element's
    (b, h, q, kv) position, so the backward regenerates it exactly. `row_offsets` and `cols` broadcast to
    the tile: ``(b · H + h) · Nq · Nk + q · Nk`` and ``kv``."""
    return tl.rand(seed, row_offsets + cols) >= dropout_p


@triton.jit
def grouped_program(HEAD_GROUP: tl.constexpr):
    """(block rank, head, batch) of this program of a (blocks, heads, batch) grid, the programs taken in launch
    order: the (batch, head) pairs in groups of HEAD_GROUP, each group's programs block rank by block rank
    with its pairs in turn (a last group may hold fewer pairs). With HEAD_GROUP 1, the grid's own order.

    The GPU starts programs in launch order as others finish. In the grid's own order each pair's programs
    run longest first but pair after pair, so the last pairs' long programs start late and end after the
    others; taking the pairs in groups starts long programs of every group early, while the programs running
    at once still read the tensors of a few heads only (bench/program_order.py models the tail)."""
    if HEAD_GROUP == 1:
        rank, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        n_blocks, n_heads = tl.num_programs(0), tl.num_programs(1)
        linear = tl.program_id(0) + n_blocks * (tl.program_id(1) + n_heads * tl.program_id(2))
        group = linear // (n_blocks * HEAD_GROUP)
        in_group = linear - group * (n_blocks * HEAD_GROUP)
        pairs = tl.minimum(HEAD_GROUP, n_heads * tl.num_programs(2) - group * HEAD_GROUP)
        rank = in_group // pairs
        pair = group * HEAD_GROUP + in_group % pairs
        h, b = pair % n_heads, pair // n_heads
    return rank, h, b


@triton.jit
def q_block_program(HEAD_GROUP: tl.constexpr):
    """(q block, head, batch, batch · heads + head) of a forward or dQ program (`grouped_program`): the last q
    blocks first, which under a causal mask hold the most tiles, so the long programs start early and the
    short ones fill the tail."""
    rank, h, b = grouped_program(HEAD_GROUP)
    return tl.num_programs(0) - 1 - rank, h, b, b.to(tl.int64) * tl.num_programs(1) + h


def _descriptor_strides(t: torch.Tensor) -> list[int] | None:
    """The strides a TMA descriptor of `t` takes, or None where its layout rules one out: the copy engine needs
    16-byte aligned strides and unit stride along the last dim (and a 16-byte aligned base, checked per call).
    A dim of extent 1 is never stepped along; it takes the stride a contiguous tensor would have there."""
    if t.stride(-1) != 1:
        return None
    strides = list(t.stride())
    for dim in range(t.dim() - 2, -1, -1):
        if t.shape[dim] == 1:
            strides[dim] = strides[dim + 1] * t.shape[dim + 1]
        if strides[dim] <= 0 or strides[dim] * t.element_size() % 16:
            return None
    return strides


# Triton's TensorDescriptor checks its fields on every construction, and an attention forward+backward constructs
# several descriptors per call: a noticeable part of its host path. Each layout (shape, strides, dtype, tile) is
# checked once, by Triton's constructor; later descriptors of the layout take its checked fields and their own
# base, whose alignment is checked per call. None: no descriptor.
_DESCRIPTOR_LAYOUTS = 256


_descriptor_fields: dict[tuple, dict[str, Any] | None] = {}


def _descriptor(t: torch.Tensor, block_rows: int, block_d: int) -> TensorDescriptor | None:
    """A TMA descriptor of `t`'s [1, 1, block_rows, block_d] tiles, or None where `t` allows none."""
    key = (t.shape, t.stride(), t.dtype, block_rows, block_d)
    if key not in _descriptor_fields:
        if len(_descriptor_fields) >= _DESCRIPTOR_LAYOUTS:
            _descriptor_fields.clear()
        strides = _descriptor_strides(t)
        checked = None if strides is None else TensorDescriptor(t, list(t.shape), strides,
                                                                [1, 1, block_rows, block_d])
        # The checked fields without the base: a cached tensor would stay alive.
        _descriptor_fields[key] = None if checked is None else {
            name: value for name, value in vars(checked).items() if name != "base"}
    fields = _descriptor_fields[key]
    if fields is None or t.data_ptr() % 16:
        return None
    descriptor = TensorDescriptor.__new__(TensorDescriptor)
    descriptor.__dict__.update(fields, base=t)
    return descriptor


def tile_operands(tiles: Sequence[tuple[torch.Tensor, int, int | tuple[int, int]]], use: bool) -> tuple[tuple, bool]:
    """The kernel arguments of a kernel's tiled operands ((tensor, block_rows, column blocks) triples: [B, H, N, D]
    tensors read block_rows rows at a time, in one block of columns or, Q and K, in the (first, second) parts of
    their head dim, `config.head_blocks`) and whether they are descriptors: TMA descriptors of [1, 1, block_rows,
    block] tiles when `use` and every tensor's layout allows one, else the tensors. A tensor in parts gives two
    arguments, its first part's and its second's (`load_parts`): the second part's descriptor, or the tensor
    again without descriptors, None where the second part is 0. Each argument stands alone: Triton 3.6's compiler
    takes no None inside a tuple argument, and its launcher counts no descriptor inside one.

    The tiles a program loads once (its Q rows in the forward) go through descriptors too: the copy fills what
    lies past the head dim with zeros, where a masked load's predicates (head dims below block_d) were held
    across the kernel's loops: 35 more registers in the forward at D96 (231 against 196, sm_90, triton 3.6)."""
    blocks = [(t, block_rows, block) for t, block_rows, column_blocks in tiles
              for block in ((column_blocks,) if isinstance(column_blocks, int) else column_blocks)]
    if use:
        descriptors = tuple(_descriptor(t, block_rows, block) if block else None for t, block_rows, block in blocks)
        if all(descriptor is not None for descriptor, (_, _, block) in zip(descriptors, blocks) if block):
            return descriptors, True
    return tuple(t if block else None for t, _, block in blocks), False


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    assert q.dim() == k.dim() == v.dim() == 4, "q, k, v must be [B, H, N, D]"
    assert k.shape[:3] == v.shape[:3], f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3], f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert q.shape[1] % k.shape[1] == 0, f"{q.shape[1]} query heads do not group over {k.shape[1]} kv heads"
    assert 16 <= q.shape[3] <= 256 and 16 <= v.shape[3] <= 256, \
        f"head dims {q.shape[3]} (q, k) and {v.shape[3]} (v) outside 16..256"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), \
        f"unsupported dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.device == k.device == v.device
    assert q.shape[2] > 0 and k.shape[2] > 0, "empty sequence"
