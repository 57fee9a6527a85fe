"""Device time of mapping a mask that reads tensors (mapped again on every call), by warps and kv tiles per
program of the tile-kind kernel.

    PYTHONPATH=. python bench/tile_kind_sweep.py [--cases document,padding] [--warps 1,2,4] [--groups 1,2,4,8]
        [--separable 1,8,1 8,8,2 ...]

Compiles each case of ``bench/attention.py`` (B2 H16 N8192 D128 bf16) under fusepass, then times the tile-kind
kernel alone, for each warp count and group (kv tiles per program), at the tiles of the map a forward builds
for a mask read per call (its kinds at the dK/dV kernel's q blocks, each program evaluating the forward's
taller tiles) and at one kind tile per program; for a separable keep (document ids), its ranges kernel too
(`blockmap.launch_separable_kinds`, joined with the map of the masks beside it, as the product takes it), for
each of its programs' shapes given (q blocks, kv blocks, warps).
Every variant's kinds are checked against the map the product builds (on sorted document ids the two kernels'
kinds agree).
"""
from __future__ import annotations

import argparse

import torch
from attention import CASES, SHAPES, fusepass_call
from harness import keep, median_ms

from fusepass.attention import call as attention_call
from fusepass.flash import blockmap
from fusepass.flash.config import forward_config, kind_block_m, narrow_kv_tiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="document,padding")
    parser.add_argument("--warps", default="1,2,4")
    parser.add_argument("--groups", default="1,2,4,8")
    parser.add_argument("--separable", nargs="*", default=[",".join(map(str, blockmap.SEPARABLE_TILES))],
                        help="q blocks,kv blocks,warps per program of the ranges kernel")
    args = parser.parse_args()
    b, h, n, d, _ = SHAPES["large"]
    device = torch.device("cuda")
    forward = narrow_kv_tiles(forward_config(d, torch.bfloat16, True, device), None)
    kind_m = kind_block_m(forward, d, torch.bfloat16, device)
    # (kind tile rows, columns, kind tiles per program along q)
    variants = {(kind_m, forward.block_n, forward.block_m // kind_m), (kind_m, forward.block_n, 1)}
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        fusepass_call(case, backward=False)
        spec = list(attention_call._calls.values())[-1]
        aux = tuple(case.extra(b, h, n, "cuda"))
        for kind_rows, block_n, subtiles in sorted(variants):
            kinds = blockmap.build_block_map(spec.mod, aux, b, h, n, n, kind_rows, block_n, device).kind
            reference = kinds.clone()
            separable = spec.mod.separable_keep
            if separable is not None and subtiles == 1:  # its programs span no taller tiles
                others = None if separable.others is None else blockmap.block_map_for(
                    separable.others, aux, b, h, n, n, kind_rows, block_n, device).kind
                for tiles in [tuple(map(int, t.split(","))) for t in args.separable]:
                    def separable_only():
                        blockmap.launch_separable_kinds(kinds, separable, aux, n, n, kind_rows, block_n, others, tiles)

                    kinds.fill_(-1)
                    separable_only()
                    assert torch.equal(kinds, reference), f"{name}: the ranges kernel at {tiles} maps differently"
                    rows.append({"case": case.name, "kernel": "separable", "kind tiles": f"{kind_rows}x{block_n}",
                                 "program rows": kind_rows * tiles[0], "warps": tiles[2], "group": tiles[1],
                                 "kind kernel us": median_ms(separable_only) * 1e3})
                    print(rows[-1], flush=True)
            for warps in map(int, args.warps.split(",")):
                for group in map(int, args.groups.split(",")):
                    def kind_only():
                        blockmap.launch_tile_kinds(kinds, spec.mod.keep, aux, n, n, kind_rows, block_n, subtiles,
                                                   warps, group)

                    kinds.fill_(-1)
                    kind_only()
                    assert torch.equal(kinds, reference), f"{name}: {warps} warps, group {group} map differently"
                    rows.append({"case": case.name, "kernel": "every element", "kind tiles": f"{kind_rows}x{block_n}",
                                 "program rows": kind_rows * subtiles, "warps": warps, "group": group,
                                 "kind kernel us": median_ms(kind_only) * 1e3})
                    print(rows[-1], flush=True)
    print(keep("tile-kind-sweep", ["case", "kernel", "kind tiles", "program rows", "warps", "group", "kind kernel us"],
               rows))


if __name__ == "__main__":
    main()
