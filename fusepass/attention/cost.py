"""The flash-attention kernels' HBM bytes and flops: a model of their tiles.

Tile sizes are the CUDA configs of fusepass/flash/config.py, also when the graph runs on the
CPU: HBM traffic is a GPU's. A GPU runs a kernel's programs in waves of about one per SM, in grid order
(the first grid axis fastest). The programs of one wave that read the same tensor share it through L2
(they walk it in the same order at about the same pace), so a tensor read by `n` consecutive programs
comes from HBM about 1 + (n - 1)/SMs times (its waves, averaged over where the wave boundaries fall).

Forward, grid (q block, query head, batch): each program reads its Q rows once, the K and V tiles of
each kv block its block map lists, and writes its output rows and two fp32 row statistics (lse,
log_sum; with a mask also one int8 fallback flag per row). The `group · ⌈Nq/BLOCK_M⌉` programs of the
query heads sharing a kv head read its K and V: once per wave.

Backward: a preprocessing kernel reads O and dO and writes delta (fp32 per row). The dK/dV kernel, grid
(kv block, kv head, batch), reads its K and V tiles once, and for each query head sharing its kv head
the Q and dO rows and row statistics (lse, log_sum, delta) of the q blocks listed for its kv block —
once per wave of the ⌈Nk/BLOCK_N⌉ programs of a kv head — and writes dK and dV. The dQ kernel, grid
(q block, query head, batch), reads Q, dO and the statistics once, K and V as the forward does, and
writes dQ. Each kernel at its own tiles (and density); dQ, dK, dV are written straight into the layouts
of the tensors they are gradients of. Each tensor counts at its own head dim: Q, K, dQ and dK at q·k's, V, the
output, dO and dV at V's (multi-head latent attention's are 192 and 128).

Aux tensors (masks, biases, tables the score functions read): one with at least Nq·Nk elements (a
dense mask or bias) is loaded tile by tile by every query head's programs, for each visited tile; a
smaller one (padding mask, ALiBi slopes, bias table) is read once per kernel. The backward reads them
in both kernels; an aux gradient accumulates atomically in fp32 (each visited tile read and written)
into a zero-filled buffer, then is converted to the tensor's dtype.

Density: the fraction of score tiles the block map lists (it scales the flops and the aux tiles).
Known for a causal mask over a square score matrix (the tiles on or below the diagonal); 1 for any
other mask (its density is only known at run time) and without one.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx

from fusepass.flash.config import (FlashConfig, ModeledRows, backward_configs, forward_config, narrow_kv_tiles,
                                    tile_width)
from fusepass.fx_util import op_name, val
from fusepass.report.ledger import (backward_ops, is_matmul, moves_no_bytes, op_flops, saved_for_backward, storage_root,
                                    unfused_bytes, unfused_flops, value_bytes)
from fusepass.report.records import Rewrite

if TYPE_CHECKING:
    from fusepass.attention.plan import AttentionSpec

STAT_BYTES = 4  # one fp32 per query row: lse, log_sum, delta


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int  # query heads
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int  # of Q and K (and dQ, dK)
    head_dim_v: int  # of V (and the output, dO, dV): multi-head latent attention's differs
    itemsize: int  # of Q, K and V
    out_itemsize: int
    masked: bool  # the score chain has a mask (the forward writes per-row fallback flags)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def rows(self) -> int:
        """Query rows over every batch and head."""
        return self.batch * self.heads * self.q_len

    @property
    def kv_rows(self) -> int:
        return self.batch * self.kv_heads * self.kv_len

    @property
    def scores(self) -> int:
        """Score elements over every batch and head."""
        return self.batch * self.heads * self.q_len * self.kv_len


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    density: float  # fraction of score tiles the kernel visits
    model: str  # how the density was found
    concurrent: int  # programs in flight (one per SM)
    known: bool = True  # False: the density is a stand-in, the mask's tiles are only known at run time

    def q_blocks(self, shape: AttentionShape) -> int:
        return -(-shape.q_len // self.block_m)

    def kv_blocks(self, shape: AttentionShape) -> int:
        return -(-shape.kv_len // self.block_n)

    def waves(self, programs: int) -> float:
        """How many times a tensor that ``programs`` consecutive programs read comes from HBM."""
        return 1 + (programs - 1) / self.concurrent


@dataclass(frozen=True)
class AuxRead:
    """A tensor the score functions read."""

    bytes: int  # the elements it holds
    itemsize: int
    per_tile: bool  # a dense mask or bias: loaded tile by tile
    needs_grad: bool


def causal_tile_fraction(n: int, block_m: int, block_n: int) -> float:
    """The fraction of BLOCK_M × BLOCK_N tiles of an n × n score matrix that hold a kept element of a
    causal mask (key ≤ query): q block i reaches the kv block of its last row."""
    q_blocks, kv_blocks = -(-n // block_m), -(-n // block_n)
    visited = sum((min((i + 1) * block_m, n) - 1) // block_n + 1 for i in range(q_blocks))
    return visited / (q_blocks * kv_blocks)


def tile_density(features: Sequence[str], skips_tiles: bool, q_len: int, kv_len: int, block_m: int,
                 block_n: int, concurrent: int) -> Tiles:
    """``skips_tiles``: the kernels may skip masked tiles (there is a mask, and its fill is bounded)."""
    if not skips_tiles:
        return Tiles(block_m, block_n, 1.0, "every tile: none can be skipped", concurrent)
    if "causal" in features and "window" not in features and q_len == kv_len:
        return Tiles(block_m, block_n, causal_tile_fraction(q_len, block_m, block_n), "causal tiles", concurrent)
    return Tiles(block_m, block_n, 1.0, "mask density unknown before run time: every tile counted", concurrent,
                 known=False)


def _aux_tiles(shape: AttentionShape, tiles: Tiles, aux: Sequence[AuxRead]) -> float:
    """Bytes one kernel reads of the aux tensors."""
    return sum(shape.scores * tiles.density * a.itemsize if a.per_tile else a.bytes for a in aux)


def _kv_reads(shape: AttentionShape, tiles: Tiles) -> float:
    """K and V as the forward and the dQ kernel read them: once per wave of a kv head's programs."""
    return shape.kv_rows * (shape.head_dim + shape.head_dim_v) * shape.itemsize \
        * tiles.waves(shape.group * tiles.q_blocks(shape))


FORWARD_KERNEL = "_flash_forward_kernel"
DKDV_KERNEL, DQ_KERNEL = "_flash_backward_dkdv_kernel", "_flash_backward_dq_kernel"
TORCH_OPS = "torch ops around the kernels"  # aux gradient buffers: zero-filled fp32, then cast


def attention_forward_bytes(shape: AttentionShape, tiles: Tiles, aux: Sequence[AuxRead], residual: bool = False
                            ) -> tuple[dict[str, float], int]:
    """(bytes the forward moves, by kernel; ideal bytes: Q, K, V and aux read once, O written once). `residual`:
    whether it writes its output's rounding residual too (`forward.keeps_residual`)."""
    d, dv, es, oes = shape.head_dim, shape.head_dim_v, shape.itemsize, shape.out_itemsize
    q_and_out = shape.rows * (d * es + dv * oes * (2 if residual else 1))
    stats = shape.rows * (2 * STAT_BYTES + (1 if shape.masked else 0))
    kernel = q_and_out + _kv_reads(shape, tiles) + stats + _aux_tiles(shape, tiles, aux)
    ideal = q_and_out + shape.kv_rows * (d + dv) * es + sum(a.bytes for a in aux)
    return {FORWARD_KERNEL: kernel}, ideal


def attention_backward_bytes(shape: AttentionShape, dkdv_tiles: Tiles, dq_tiles: Tiles, aux: Sequence[AuxRead],
                             residual: bool = False, apart: bool = False) -> tuple[dict[str, float], int]:
    """(bytes the backward moves, by kernel; ideal bytes: Q, K, V, O, dO and aux read once, dQ, dK, dV and
    aux gradients written once). Each kernel at its own tiles; `residual`: whether dQ reads the output's rounding
    residual for its row term; `apart`: whether the dK/dV kernel runs as two launches (`BackwardConfigs.apart`:
    dV's reads K, the q rows but their delta, and the aux tiles; dK's everything one launch reads but dV's tiles),
    counted together under its name."""
    d, dv, es, oes = shape.head_dim, shape.head_dim_v, shape.itemsize, shape.out_itemsize
    q_rows, kv_rows = shape.rows, shape.kv_rows
    row = d * es + dv * oes + 3 * STAT_BYTES  # a query row of Q and dO, and its lse, log_sum, delta
    with_grad = [a for a in aux if a.needs_grad]
    # Aux gradients: atomic fp32 updates of each visited tile in the dK/dV kernel (read and written), a
    # zero-filled fp32 buffer before it, a conversion to the tensor's dtype after it.
    atomics = sum((shape.scores * dkdv_tiles.density if a.per_tile else a.bytes // a.itemsize) * 2 * 4
                  for a in with_grad)
    buffers = sum(a.bytes // a.itemsize * (4 + 4 + a.itemsize) for a in with_grad)
    q_reads = dkdv_tiles.waves(dkdv_tiles.kv_blocks(shape))
    dkdv_aux = _aux_tiles(shape, dkdv_tiles, aux)
    dkdv = 2 * kv_rows * (d + dv) * es + q_rows * row * q_reads + dkdv_aux + atomics
    if apart:
        dkdv += kv_rows * d * es + q_rows * (row - STAT_BYTES) * q_reads + dkdv_aux
    parts = {
        DKDV_KERNEL: dkdv,
        # dQ also reads O, for delta = rowsum(dO · O), which it writes for dK/dV (in `row`, read there).
        DQ_KERNEL: q_rows * (row + dv * oes * (2 if residual else 1)) + _kv_reads(shape, dq_tiles) + q_rows * d * es
        + _aux_tiles(shape, dq_tiles, aux),
    }
    if buffers:
        parts[TORCH_OPS] = buffers
    ideal = 2 * (q_rows * d + kv_rows * (d + dv)) * es + 2 * q_rows * dv * oes \
        + sum(a.bytes * (2 if a.needs_grad else 1) for a in aux)
    return parts, ideal


def _saved_bytes(nodes: Iterable[torch.fx.Node], kept_by_kernel: set[torch.fx.Node]) -> int:
    """Bytes of the values ``nodes`` keep for the backward, each storage once, beyond what stays alive
    anyway (graph inputs) or what the fused op keeps too (its operands and aux tensors)."""
    roots: dict[torch.fx.Node, int] = {}
    extra = 0
    for node in nodes:
        saved, unnamed = saved_for_backward(node)
        extra += unnamed
        for value in saved:
            root = storage_root(value)
            if root.op == "call_function" and root not in kept_by_kernel:
                roots[root] = value_bytes(root)
    return sum(roots.values()) + extra


def attention_rewrites(location: str, replaced: Sequence[torch.fx.Node], kept_by_kernel: Sequence[torch.fx.Node],
                       shape: AttentionShape, forward_tiles: Tiles, backward_tiles: tuple[Tiles, Tiles],
                       aux: Sequence[AuxRead], features: tuple[str, ...], detail: dict,
                       gradient_flows: bool, apart: bool = False) -> list[Rewrite]:
    """The forward record of one attention rewrite and, when a gradient flows, its backward record.

    ``replaced``: the ops the rewrite removes, in graph order (the matched ones and those only they used,
    such as a mask's construction); ``kept_by_kernel``: the tensors the fused op reads; ``backward_tiles``:
    the dK/dV kernel's and the dQ kernel's; ``apart``: dK and dV in two launches (`BackwardConfigs.apart`)."""
    compute = [n for n in replaced if not moves_no_bytes(n)]
    flops = unfused_flops(compute)
    elementwise_flops = flops - sum(op_flops(n) for n in compute if is_matmul(n))
    # A half-precision output's rounding residual, kept for the backward's row term (`forward.keeps_residual`: fp16
    # and bf16, the 2-byte outputs).
    residual = gradient_flows and shape.out_itemsize == 2
    parts, ideal = attention_forward_bytes(shape, forward_tiles, aux, residual)
    row_stats = shape.rows * (2 * STAT_BYTES + (1 if shape.masked else 0))
    activation = 0
    if gradient_flows:
        # The fused op keeps its output (and its residual) and row statistics instead.
        kept_instead = shape.rows * shape.head_dim_v * shape.out_itemsize * (2 if residual else 1) + row_stats
        activation = _saved_bytes(compute, set(kept_by_kernel)) - kept_instead
    forward = Rewrite(
        kind="attention", phase="forward", location=location, ops=tuple(op_name(n) for n in compute),
        bytes_unfused=unfused_bytes(compute), bytes_fused=round(sum(parts.values())), bytes_ideal=ideal,
        flops=flops, flops_fused=round(flops * forward_tiles.density), activation_bytes_saved=activation,
        features=features, detail={**detail, **_model_detail(forward_tiles, parts)})
    if not gradient_flows:
        return [forward]
    backward = [op for n in reversed(compute) for op in backward_ops(n)]
    backward_elementwise = sum(op.flops for op in backward if not op.matmul)
    dkdv_tiles, dq_tiles = backward_tiles
    parts, ideal = attention_backward_bytes(shape, dkdv_tiles, dq_tiles, aux, residual, apart)
    # Both backward kernels recompute the scores (2 flops per score per element of Q's and K's head dim) and weights
    # of each tile they visit; dK/dV adds dK (2 at Q's and K's) and dP, dV (2 each at V's), dQ adds dQ and dP. Apart,
    # dK/dV's two launches each recompute the scores and weights.
    per_kernel = elementwise_flops + backward_elementwise
    d, dv = shape.head_dim, shape.head_dim_v
    dkdv_flops = 2 * (shape.scores * (3 * d + 2 * dv) + per_kernel) if apart else 4 * shape.scores * (d + dv) \
        + per_kernel
    recomputed = dkdv_flops * dkdv_tiles.density + (2 * shape.scores * (2 * d + dv) + per_kernel) * dq_tiles.density
    tiles = {"tiles": {"dk_dv": {**_tiles_detail(dkdv_tiles), "apart": apart}, "dq": _tiles_detail(dq_tiles)}}
    return [forward, Rewrite(
        kind="attention", phase="backward", location=location, ops=tuple(op.name for op in backward),
        bytes_unfused=sum(op.bytes for op in backward), bytes_fused=round(sum(parts.values())), bytes_ideal=ideal,
        flops=sum(op.flops for op in backward), flops_fused=round(recomputed),
        features=features, detail={**detail, **_model_detail(forward_tiles, parts), **tiles})]


def _tiles_detail(tiles: Tiles) -> dict:
    return {"block_m": tiles.block_m, "block_n": tiles.block_n, "density": round(tiles.density, 4),
            "density_model": tiles.model, "concurrent_programs": tiles.concurrent}


def _model_detail(tiles: Tiles, parts: dict[str, float]) -> dict:
    return {"tiles": _tiles_detail(tiles), "bytes_fused_by_kernel": {name: round(b) for name, b in parts.items()}}


def attention_records(replaced: list[torch.fx.Node], spec: AttentionSpec, sources: list[torch.fx.Node],
             features: list[str], where: str, sms: int) -> tuple[list[Rewrite], FlashConfig | None]:
    """The records of a rewrite (forward, and backward when a gradient flows to an input), and the forward's tiles on
    the GPU where the density model knows the mask's rows (None where it does not)."""
    kept = sources + spec.lifted.aux
    batch, heads, q_len, head_dim_v = spec.out_shape
    head_dim = spec.q.size[3]
    dtype = val(sources[0]).dtype
    masked = "keep" in spec.lifted.functions
    shape = AttentionShape(batch=batch, heads=heads, kv_heads=spec.k.size[1], q_len=q_len, kv_len=spec.k.size[2],
                           head_dim=head_dim, head_dim_v=head_dim_v, itemsize=dtype.itemsize,
                           out_itemsize=spec.out_dtype.itemsize, masked=masked)
    width = tile_width(head_dim, head_dim_v)
    # Tiles are skipped only where the fill contributes nothing (docs/flash-kernel-interface.md).
    skips = masked and spec.lifted.fill_bound != math.inf
    cuda = torch.device("cuda")  # the ledger models the GPU's tiles, wherever the graph runs

    def tiles(config: FlashConfig) -> Tiles:
        return tile_density(features, skips, q_len, shape.kv_len, config.block_m, config.block_n, sms)

    backward = backward_configs(width, dtype, masked, cuda)
    aux = [AuxRead(bytes=value_bytes(a), itemsize=val(a).element_size(),
                   per_tile=value_bytes(a) // val(a).element_size() >= q_len * shape.kv_len,
                   needs_grad=bool(a.meta.get("requires_grad"))) for a in spec.lifted.aux]
    gradient_flows = any(n.meta.get("requires_grad") for n in kept)
    forward = forward_config(width, dtype, masked, cuda)
    known = True
    if masked:  # the width the kernel takes for the mask's rows, as far as the density model knows them
        wide = tiles(forward)
        known = wide.known and not spec.lifted.keep_reads_aux
        forward = narrow_kv_tiles(forward, ModeledRows(wide.density * wide.kv_blocks(shape)) if known else None)
    records = attention_rewrites(where, replaced, kept, shape, tiles(forward),
                                 (tiles(backward.dkdv), tiles(backward.dq)), aux,
                                 tuple(features), {"shape": [batch, heads, q_len, shape.kv_len, head_dim],
                                                   "kv_heads": shape.kv_heads, "head_dim_v": head_dim_v},
                                 gradient_flows, backward.apart)
    return records, forward if known else None
