"""Device time of mapping a mask that reads tensors (mapped again on every call), by warps per program.

    PYTHONPATH=. python bench/tile_kind_sweep.py [--cases document,padding]

Compiles each case of ``bench/attention.py`` (B2 H16 N8192 D128 bf16) under fusepass, then times the tile-kind
kernel alone and the whole map (kinds and both lists) at the forward's tiles, for each warp count.
"""
from __future__ import annotations

import argparse

import torch
from attention import CASES, SHAPES, fusepass_call
from harness import keep, median_ms

from fusepass.attention import blockmap, op
from fusepass.kernels.flash_config import forward_config, narrow_kv_tiles

WARPS = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="document,padding")
    args = parser.parse_args()
    b, h, n, d, _ = SHAPES["large"]
    rows = []
    chosen = blockmap.TILE_KIND_WARPS
    for name in args.cases.split(","):
        case = CASES[name]
        fusepass_call(case, backward=False)
        spec = list(op._specs.values())[-1]
        aux = tuple(case.extra(b, h, n, "cuda"))
        tiles = narrow_kv_tiles(forward_config(d, torch.bfloat16, True, torch.device("cuda")), None)
        reference = None
        for warps in WARPS:
            blockmap.TILE_KIND_WARPS = warps

            def build():
                return blockmap.build_block_map(spec.mod, aux, b, h, n, n, tiles.block_m, tiles.block_n, "cuda")
            kinds = build().kind
            reference = kinds if reference is None else reference
            assert torch.equal(kinds, reference), f"{name}: {warps} warps map differently"
            kind_only = median_ms(lambda: blockmap.launch(
                blockmap._tile_kind_kernel, kinds.shape[2:] + (kinds.shape[0] * kinds.shape[1],), kinds, n, n,
                kinds.shape[1], aux, KEEP=spec.mod.keep, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                num_warps=warps))
            rows.append({"case": case.name, "tiles": f"{tiles.block_m}x{tiles.block_n}", "warps": warps,
                         "kind kernel us": kind_only * 1e3, "map us": median_ms(build) * 1e3})
        blockmap.TILE_KIND_WARPS = chosen
    print(keep("tile-kind-sweep", ["case", "tiles", "warps", "kind kernel us", "map us"], rows))


if __name__ == "__main__":
    main()
