"""Tile sizes and launch parameters of the flash-attention kernels.

One `FlashConfig` per kernel (the forward; the backward's dK/dV and dQ kernels, each with a block map at its
tiles). Chosen by the width of the head dims' tiles (`tile_width`), dtype, the device and whether a mask is present.

Under Triton's interpreter (CPU) every tile is 16 × 16: the interpreter's cost grows with the number of
elements a program touches, and 16 is the smallest size `tl.dot` accepts. The GPU numbers are starting
points sized for the H200's 227 KiB of shared memory per block (K and V tiles of `num_stages` pipeline
stages, plus the Q tile), to be tuned with the benchmarks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
from triton.runtime.errors import OutOfResources

from fusepass.flash.blockmap import BlockMap
from fusepass.runtime.launch import compile_ahead, launch
from fusepass.runtime.sizes import next_power_of_2


@dataclass(frozen=True)
class FlashConfig:
    block_m: int  # query rows per tile
    block_n: int  # key columns per tile
    num_warps: int
    num_stages: int
    # Per-tile operands (K and V in the forward and dQ kernels, Q and dO in dK/dV) loaded through TMA tensor
    # descriptors where their layouts allow (see `tiles.tile_operands`): one copy instruction per tile, no address
    # arithmetic, rows past the end filled with zeros by the copy engine.
    descriptors: bool = False
    # Programs of this many (batch, head) pairs take their blocks in turn (tiles.grouped_program); 1: the
    # grid's own order, pair after pair.
    head_group: int = 1


# The interpreter runs descriptor loads too, so CPU tests cover that path.
INTERPRETER_CONFIG = FlashConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, descriptors=True)


@functools.cache
def has_tma(device: torch.device) -> bool:
    """Whether the GPU has the tensor memory accelerator (Hopper, sm_90, and later). False without a GPU (the
    report models the GPU's tiles on any machine)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


def head_block(head_dim: int) -> int:
    """The head dim padded to a power of two (loads and stores past `head_dim` are masked)."""
    return max(16, next_power_of_2(head_dim))


def head_blocks(head_dim: int) -> tuple[int, int]:
    """Q's and K's head dim as the kernels' column blocks (first, second), powers of two of at least 16: two where
    they cover it in fewer columns than one padded block (192 = 128 + 64, 96 = 64 + 32, 80 = 64 + 16), the products
    over it then two into one accumulator; else (`head_block`, 0)."""
    whole = head_block(head_dim)
    first = whole // 2
    second = head_block(head_dim - first) if head_dim > first else 0
    return (first, second) if second and first + second < whole else (whole, 0)


def tile_width(head_dim: int, head_dim_v: int) -> int:
    """The width the tile configs are chosen by, for Q and K of `head_dim` and V of `head_dim_v`: the wider of Q's and
    K's blocks together and V's block. Shared memory holds K's and V's tiles of each pipeline stage, and registers
    Q's tile and the output's accumulator, so the wider side decides which of the configs' widths fits (a first rule:
    the configs were tuned with both sides at one width)."""
    return max(sum(head_blocks(head_dim)), head_block(head_dim_v))


@functools.cache  # asked on every call of the kernels
def forward_config(width: int, dtype: torch.dtype, has_mask: bool, device: torch.device) -> FlashConfig:
    """`width`: the head dims' (`tile_width`)."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return _on_gpu(_forward_tiles(width, dtype, has_mask), device)


# Programs take (batch, head) pairs in groups of this many: at the large causal shape the forward ran faster in
# groups of 4 than in the grid's own order and no faster in groups of 8, and both backward kernels gained a
# little; at the small shape the forward runs alike in groups of 1, 8 and 16.
GPU_HEAD_GROUP = 4


def _on_gpu(config: FlashConfig, device: torch.device) -> FlashConfig:
    return replace(config, descriptors=has_tma(device), head_group=GPU_HEAD_GROUP)


def _forward_tiles(width: int, dtype: torch.dtype, has_mask: bool) -> FlashConfig:
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory
    if width <= 64:
        # At D64 (causal, the small shape) 64 × 64 and 128 × 128 tiles (the latter spilling a little) ran about
        # level, 128 × 64 slower. Masked attentions take 64 × 64, the backward's tiles: a mask that reads tensors
        # is mapped once per call for all three kernels. Unmasked ones take the widest tiles.
        if has_mask:
            return FlashConfig(64, 64, num_warps=4, num_stages=3)
        return FlashConfig(128, 64 if wide else 128, num_warps=4, num_stages=3)
    if width <= 128:
        if wide:
            return FlashConfig(64, 32, num_warps=4, num_stages=3)
        # At the large causal shape, with K and V through descriptors (faster at either width than pointer
        # loads), 128 × 128 ran faster than 128 × 64. Masks whose q blocks list few kv tiles take half-width
        # tiles instead (see `narrow_kv_tiles`).
        return FlashConfig(128, 128, num_warps=8, num_stages=3)
    if wide:
        return FlashConfig(32, 32, num_warps=4, num_stages=2)
    # D256: at 8 warps 128 × 64 ran twice as fast as 64 × 64 (each warpgroup's products 64 rows tall) and ahead of
    # 128 × 32 and of 64 × 64 at 4 warps (bench/NOTES.md, the D256 sweep).
    return FlashConfig(128, 64, num_warps=8, num_stages=2)


# Forward programs of masked attention walking fewer kv tiles than this (on average over the q blocks, at
# 128-wide tiles) run faster at 64-wide ones: a sliding window of 1024 (9 tiles) ran much faster at 128 × 64 than
# at 128 × 128 for the same work, where causal (32 tiles on average) ran a little faster at 128 × 128.
SHORT_ROWS = 16


@dataclass(frozen=True)
class ModeledRows:
    """Row lengths where no block map is at hand: as the report's ledger models the tiles a mask keeps."""

    mean_row_tiles: float


def narrow_kv_tiles(config: FlashConfig, wide_map: BlockMap | ModeledRows | None) -> FlashConfig:
    """The forward's config for a masked attention whose block map at `config`'s tiles is `wide_map` (None: not
    known without evaluating the mask on this call): half-width kv tiles where `config` is 128 wide and the
    rows are short or unknown. The map is asked for its row lengths (a wait on the device) only then."""
    if config.block_n == 128 and (wide_map is None or wide_map.mean_row_tiles < SHORT_ROWS):
        return replace(config, block_n=64)
    return config


@dataclass(frozen=True)
class BackwardConfigs:
    """The backward's two kernels may tile differently: dK/dV walks q chunks past its kv block (its tiles are
    laid out [kv, q]), dQ q blocks past kv chunks. `block_m` is always the q extent of a tile, `block_n` the kv
    extent."""

    dkdv: FlashConfig
    dq: FlashConfig
    # dK and dV in two launches of the dK/dV kernel at `dkdv`'s tiles, each program holding one accumulator: twice
    # the kv rows in the registers one pair would take, so wider products, for a recompute of K·Qᵀ in both.
    apart: bool = False


@functools.cache  # asked on every call of the kernels
def backward_configs(width: int, dtype: torch.dtype, has_mask: bool, device: torch.device) -> BackwardConfigs:
    """`width`: the head dims' (`tile_width`)."""
    if device.type != "cuda":
        return BackwardConfigs(INTERPRETER_CONFIG, INTERPRETER_CONFIG)
    tiles = _backward_tiles(width, dtype, has_mask)
    return replace(tiles, dkdv=_on_gpu(tiles.dkdv, device), dq=_on_gpu(tiles.dq, device))


def _backward_tiles(width: int, dtype: torch.dtype, has_mask: bool) -> BackwardConfigs:
    if dtype == torch.float32:  # fp32 tiles take twice the registers and shared memory
        return BackwardConfigs(FlashConfig(32, 32, num_warps=4, num_stages=2), FlashConfig(32, 32, 4, 2))
    # dK/dV keeps dK and dV (block_n × their widths, fp32) in registers for its whole loop; q chunks of 64 give
    # its sᵀ = K·Qᵀ and dpᵀ = V·dOᵀ products N = 64, where N = 32 reads K or V from shared memory twice as
    # often per FLOP.
    if width <= 64:
        if not has_mask:
            # Without a mask (the small shape) these tiles ran faster than the masks' below: dK/dV 32 × 128 with
            # dQ 64 × 128, the best of the dQ tiles swept.
            return BackwardConfigs(FlashConfig(32, 128, num_warps=4, num_stages=3), FlashConfig(64, 128, 4, 3))
        # Causal, the small shape: dK/dV at 64 × 64 ran level with 32 × 64 and well ahead of 32 × 128 at 8 warps.
        return BackwardConfigs(FlashConfig(64, 64, num_warps=4, num_stages=2), FlashConfig(64, 64, 4, 3))
    if width <= 128:
        # Causal, the large shape, with descriptors: dK/dV at 64 × 64 and 2 stages ran fastest. 32 × 64 at 3
        # stages, the best before dV's product took the weights ahead of dp, has been slower since; 64 × 64 at 3
        # stages spills more under triton 3.6 and runs slower.
        return BackwardConfigs(FlashConfig(64, 64, num_warps=4, num_stages=2), FlashConfig(128, 64, 8, 3))
    # Wider than 128: at 32 × 128 the q·k products are twice as wide as at 32 × 64. Latent attention (q·k 128 + 64,
    # V 128: dK and dV together 160 registers a thread at 8 warps) ran its training step faster so; at D256 dK and dV
    # together take 256 there and spill, and apart (each launch one accumulator) ran the kernels faster than together
    # at 32 × 64 at Gemma 2's shape, causal and capped (bench/NOTES.md). dK/dV's 32 q rows a step ran faster than 16
    # despite a few spilled bytes, dQ's 128 × 32 faster than 64 × 64; 4 warps spilled hundreds of bytes in either.
    apart = width > 192
    return BackwardConfigs(FlashConfig(32, 128, num_warps=8, num_stages=2), FlashConfig(128, 32, 8, 2), apart=apart)


def forward_warps(config: FlashConfig, reads_tables: bool) -> int:
    """The warps the forward at `config` runs: twice its 4 where the score functions read a value per score from a
    table (`ScoreMod.tables`, T5's relative bias), at the same tiles, each thread then holding half the accumulators:
    at 4 warps the forward spills (compiled for sm_90) and runs slower. The backward's kernels stay at their
    config's warps: at 8 they spilled nothing but ran slower still (bench/NOTES.md)."""
    return 8 if reads_tables and config.num_warps == 4 else config.num_warps


def kind_block_m(forward: FlashConfig, width: int, dtype: torch.dtype, device: torch.device) -> int:
    """The q extent of the kinds and cols lists of the block map a forward at `forward`'s tiles builds for a
    mask that reads tensors (mapped on every call, and passed to the backward): the dK/dV kernel's q blocks
    where they divide the forward's and the kv extents agree, so that one map serves the forward and both
    backward kernels (the dQ kernel reads the forward's rows lists); else the forward's."""
    dkdv = backward_configs(width, dtype, True, device).dkdv
    if dkdv.block_n == forward.block_n and forward.block_m % dkdv.block_m == 0:
        return dkdv.block_m
    return forward.block_m


# The pipeline stages that fit, per kernel, constants and dtypes (see launch_fitting).
_fitting_stages: dict[tuple, int] = {}


def _fitting_key(kernel: Any, args: tuple, num_warps: int, num_stages: int, constants: dict) -> tuple:
    return (kernel, num_warps, num_stages, tuple(constants.items()),
            tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))


def _first_stages(kernel: Any, args: tuple, num_warps: int, num_stages: int, constants: dict) -> int:
    # The key is built only once some launch did not fit: hashing the constants (the score functions) costs
    # host time on every call.
    if not _fitting_stages:
        return num_stages
    return _fitting_stages.get(_fitting_key(kernel, args, num_warps, num_stages, constants), num_stages)


def launch_fitting(kernel: Any, grid: tuple, *args: Any, num_warps: int, num_stages: int, **constants: Any) -> None:
    """``kernel[grid](*args, **constants)`` with ``num_stages`` pipeline stages, or as many as fit in shared
    memory: a score function that loads tiles of its own (a gathered bias table) adds buffers the config did
    not count. The stages that fit are remembered, so a call pays for a failed launch only once."""
    def key() -> tuple:
        return _fitting_key(kernel, args, num_warps, num_stages, constants)

    stages = _first_stages(kernel, args, num_warps, num_stages, constants)
    while True:
        try:
            launch(kernel, grid, *args, num_warps=num_warps, num_stages=stages, **constants)
            return
        except OutOfResources:
            if stages == 1:
                raise
            stages = _fitting_stages[key()] = stages - 1


def compile_fitting_ahead(kernel: Any, *args: Any, num_warps: int, num_stages: int, **constants: Any) -> None:
    """`compile_ahead` of the first launch `launch_fitting` would try with these arguments."""
    compile_ahead(kernel, *args, num_warps=num_warps,
                  num_stages=_first_stages(kernel, args, num_warps, num_stages, constants), **constants)
