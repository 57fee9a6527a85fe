"""The row kernel's tile for short rows: rows a program holds (PROGRAM_TILE / the row's length) and its warps,
swept beside Inductor's kernel for the same row, forward, bf16, device time per call.

    PYTHONPATH=. python bench/row_tiles.py [--tiles 4096:8,1024:8,...]

Each tile is `elements a program holds:warps` (warps for every tile of the run, `row_kernel.SHORT_ROWS` set
aside); the product's rule is the first column ("as is": `SHORT_ROWS`; before 2026-12-07 2048:4 for every short
row). Writes bench/results/row-tiles-<date>.md and .json.
"""
from __future__ import annotations

import argparse

import torch
from harness import device_ms, keep
from reductions import layer_norm, layer_norm_by_hand, rmsnorm, softmax_by_hand

import fusepass
from fusepass.elementwise import row_kernel

CASES = [("layernorm 16384x1024", layer_norm, (16384, 1024), 2),
         ("softmax-by-hand 16384x1024", softmax_by_hand, (16384, 1024), 0),
         ("layernorm 8192x768", layer_norm, (8192, 768), 2),
         ("rmsnorm 16384x4096", rmsnorm, (16384, 4096), 1),
         ("layernorm 32768x256", layer_norm, (32768, 256), 2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiles", default="2048:4,1024:1,2048:1,1024:2,2048:2,4096:4")
    args = parser.parse_args()
    tiles = [None] + [tuple(map(int, t.split(":"))) for t in args.tiles.split(",")]
    rule = row_kernel.PROGRAM_TILE, row_kernel.row_warps, row_kernel.SHORT_ROWS
    rows = []
    for name, fn, shape, weights in CASES:
        torch.manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        extra = [torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16) for _ in range(weights)]
        torch._dynamo.reset()
        inductor = torch.compile(fn)
        expected = inductor(x, *extra)
        row = {"case": name, "inductor ms": device_ms(lambda: inductor(x, *extra))}
        bytes_moved = 2 * x.numel() * x.element_size()
        for tile in tiles:
            row_kernel.PROGRAM_TILE, row_kernel.row_warps, row_kernel.SHORT_ROWS = rule
            if tile is not None:
                row_kernel.PROGRAM_TILE, row_kernel.SHORT_ROWS = tile[0], {}
                row_kernel.row_warps = lambda xblock, rblock, warps=tile[1]: warps
            torch._dynamo.reset()
            fused = torch.compile(fn, backend=fusepass.backend(graphs=False))
            got = fused(x, *extra)
            got = got[-1] if isinstance(got, tuple) else got
            want = expected[-1] if isinstance(expected, tuple) else expected
            assert torch.allclose(got.float(), want.float(), atol=3e-2, rtol=3e-2), (name, tile)
            label = "as is" if tile is None else f"{tile[0]}:{tile[1]}"
            ms = device_ms(lambda: fused(x, *extra))
            row[f"{label} ms"] = ms
            row[f"{label} TB/s"] = bytes_moved / ms / 1e9
        row_kernel.PROGRAM_TILE, row_kernel.row_warps, row_kernel.SHORT_ROWS = rule
        rows.append(row)
        print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else str(v) for k, v in row.items()), flush=True)
    columns = list(rows[0])
    print(keep("row-tiles", columns, rows,
               "bf16 forward, device ms per call (torch.profiler); TB/s counts x read and y written once"))


if __name__ == "__main__":
    main()
