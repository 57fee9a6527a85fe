"""An attention's flash kernels compiled ahead of their first launch.

The first call of a masked attention compiles the kernels of its block map (the mask evaluated per tile, its
lists compacted), runs them, and only then compiles the forward kernel; its first backward compiles the dQ and
dK/dV kernels, one after the other, each a long compile. `compile_attention_ahead` starts compiling, on
background threads (`launch.compile_ahead`), the forward kernel (at the tiles the rewrite's density model
expects, else at each tile width it may take) and, where a gradient will flow, both backward kernels, from meta
stand-ins of everything their launches will read: each launch then waits for its kernel's compile instead of
starting its own. The rewrite starts it from stand-ins of the graph's values, the kernels of the forward's block
maps included, so that they compile while AOTAutograd traces and partitions the graph (a forward+backward's first
call comes long after the rewrite, a forward's sooner); the first call again from its own inputs, which starts
nothing where their signatures agree, and builds the backward's cached maps. A stand-in that differs from what a
launch reads in its signature (a gradient of the output in another layout) only costs a compile that is not used.
"""
from __future__ import annotations

import torch

from fusepass.flash.backward import backward_launches
from fusepass.flash.blockmap import BlockMap, block_map_for, build_block_map, empty_block_map
from fusepass.flash.config import (FlashConfig, backward_configs, compile_fitting_ahead, forward_config, kind_block_m,
                                    tile_width)
from fusepass.flash.distance_table import distance_gradients, meta_distance_tables
from fusepass.flash.forward import forward_launch, forward_outputs, forward_tile_configs
from fusepass.flash.score_mod import ScoreMod


def compile_attention_ahead(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod: ScoreMod, aux: tuple, *,
                            dropout_p: float, out_dtype: torch.dtype | None,
                            forward_tiles: FlashConfig | None = None,
                            grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            aux_grad: tuple | None = None, device: torch.device | None = None) -> None:
    """Start compiling what `flash_attention_forward(q, k, v, mod, aux, ...)` will launch (at `forward_tiles`
    where the caller knows them, else at each tile width it may take) and, given `grads` (meta tensors laid
    out as the backward will write dq, dk, dv), what its backward will launch; `aux_grad`: stand-ins of the
    backward's aux gradients where `mod.has_aux_grad`. `device`: where the kernels will run, where q, k, v
    and `aux` are meta stand-ins too (q's device otherwise)."""
    device = device or q.device
    batch, q_heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    width = tile_width(head_dim, v.shape[3])
    aux = aux + meta_distance_tables(mod)
    out, lse, log_sum, fallback_rows, residual = forward_outputs(q, mod, out_dtype, "meta", backward=grads is not None,
                                                                 head_dim_v=v.shape[3])

    def map_at(config: FlashConfig) -> BlockMap:
        return empty_block_map(mod, batch, q_heads, q_len, kv_len, config.block_m, config.block_n, "meta")

    forward_configs = (forward_tiles,) if forward_tiles else forward_tile_configs(mod, width, q.dtype, device)
    seed = torch.empty(1, dtype=torch.int64, device=q.device)  # dropout's, as the call draws it
    for config in forward_configs:
        kernel, _, args, keywords = forward_launch(q, k, v, mod, aux, config,
                                                   map_at(config) if mod.has_mask else None, out, lse, log_sum,
                                                   fallback_rows, seed, dropout_p, residual)
        compile_fitting_ahead(kernel, *args, **keywords)
    # The maps cached per shape, on q's device: their kernels only start compiling on meta stand-ins (the
    # rewrite's); a first call builds the backward's while the flash kernels compile (its first backward would
    # otherwise compile and run their kernels before its own launches), its forward its own.
    cached_maps = mod.has_mask and not mod.keep_reads_aux
    passed_map = None  # the forward's map, mapped in each call and passed to the backward
    if cached_maps and q.is_meta:
        # The forward maps the mask at its widest tiles first, to see whether its rows are short.
        widest = forward_config(width, q.dtype, True, device)
        for block_m, block_n in dict.fromkeys((c.block_m, c.block_n) for c in (widest, *forward_configs)):
            block_map_for(mod, (), batch, q_heads, q_len, kv_len, block_m, block_n, q.device)
    elif mod.has_mask and q.is_meta:  # mapped in each call, at the forward's tiles, its kinds at dK/dV's rows
        config, = forward_configs
        passed_map = build_block_map(mod, aux, batch, q_heads, q_len, kv_len, config.block_m, config.block_n,
                                     q.device, kind_block_m=kind_block_m(config, width, q.dtype, device))
    if grads is None:
        return

    def backward_map_at(config: FlashConfig, cols: bool) -> BlockMap:
        # On stand-ins, the maps the backward builds (cached, or in each call where the forward's does not
        # serve its tiles) start their kernels' compiles, as `flash_bwd.backward_map` asks for them.
        if not (q.is_meta and mod.has_mask):
            return map_at(config)
        if passed_map is not None and passed_map.serves(config.block_m, config.block_n, cols):
            return passed_map
        return block_map_for(mod, aux, batch, q_heads, q_len, kv_len, config.block_m, config.block_n, q.device)

    aux_grad = aux_grad + distance_gradients(mod, torch.device("meta")) if mod.has_aux_grad else None
    do = torch.empty(out.shape, dtype=out.dtype, device="meta")
    for kernel, _, args, keywords in backward_launches(
            do, q, k, v, out, lse, log_sum, fallback_rows, mod, aux, aux_grad, torch.empty_like(lse), grads,
            dropout_p, seed, backward_map_at, device, residual):
        compile_fitting_ahead(kernel, *args, **keywords)
    if cached_maps and not q.is_meta:
        configs = backward_configs(width, q.dtype, True, device)
        for config in (configs.dq, configs.dkdv):
            block_map_for(mod, (), batch, q_heads, q_len, kv_len, config.block_m, config.block_n, q.device)
