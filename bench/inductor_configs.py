"""Inductor's kernels for bench/reductions.py's cases, forward, with the config its autotuner kept for each (rows a
program takes, warps, registers), beside the tile fusepass's row kernel takes: where a short-row norm or softmax
trails Inductor's (bench/NOTES.md), what Inductor's launch does otherwise.

    PYTHONPATH=.:bench python bench/inductor_configs.py [--cases layernorm,softmax-by-hand]

Printed only (each kernel's source and configs).
"""
from __future__ import annotations

import argparse

import torch
import torch._inductor.codecache as codecache
from reductions import CASES

from fusepass.elementwise import row_kernel


def fusepass_tile(rows: int, length: int) -> str:
    """The row kernel's tile and warps for rows of `length` (`RowLauncher._plan`, without column sums)."""
    rblock = row_kernel.row_block(length)
    xblock = row_kernel._row_grid(rows, length, False, torch.device("cuda"))[0]
    return f"XBLOCK {xblock}, RBLOCK {rblock}, {row_kernel._warps(xblock, rblock, False)} warps"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="layernorm,softmax-by-hand")
    args = parser.parse_args()
    chosen = set(args.cases.split(","))
    for case in CASES:
        if case.name.split()[0] not in chosen:
            continue
        m, n = case.shape
        inputs = case.inputs()
        torch._dynamo.reset()
        known = set(map(id, codecache.PyCodeCache.modules))
        compiled = torch.compile(case.fn)
        with torch.no_grad():  # the forward's kernels
            for _ in range(3):  # the autotuner's benchmarks, then its kept config
                compiled(*inputs)
        torch.cuda.synchronize()
        print(f"== {case.name}: fusepass {fusepass_tile(m, n)}")
        for module in codecache.PyCodeCache.modules:
            if id(module) in known:
                continue
            for name in dir(module):
                kernel = getattr(module, name)
                launchers = getattr(kernel, "launchers", None)
                if not launchers:
                    continue
                for launcher in launchers:
                    print(f"-- {name}: {launcher.config}, registers {getattr(launcher, 'n_regs', '?')}, "
                          f"spills {getattr(launcher, 'n_spills', '?')}, shared {getattr(launcher, 'shared', '?')}")
                print(getattr(kernel.fn, "src", ""))


if __name__ == "__main__":
    main()
