"""Long rows' walks: the chunk a walk takes at once (`row_kernel.LOOP_BLOCK`) and the warps of a program, swept on
the losses and log-sum-exp of bench/reductions.py beside Inductor's kernels for the same code, bf16, device time
per call, forward and forward+backward.

    PYTHONPATH=. python bench/row_walks.py [--walks 4096:8,1024:4,...] [--cases cross-entropy,logsumexp-by-hand]

Each walk is `elements a chunk:warps`; the product's rule is the first column ("as is"). Writes
bench/results/row-walks-<date>.md and .json.
"""
from __future__ import annotations

import argparse

import torch
from harness import device_ms, keep
from reductions import CASES

import fusepass
from fusepass.elementwise import row_kernel


def _step(fn, inputs, grads):
    outs = fn(*inputs)
    torch.autograd.backward(outs if isinstance(outs, tuple) else (outs,), grads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--walks", default="1024:4,2048:4,2048:16,4096:8,4096:16,8192:16")
    parser.add_argument("--cases", default="cross-entropy,logsumexp-by-hand")
    args = parser.parse_args()
    walks = [None] + [tuple(map(int, w.split(":"))) for w in args.walks.split(",")]
    chosen = set(args.cases.split(","))
    rule = row_kernel.LOOP_BLOCK, row_kernel.row_warps
    rows = []
    for case in CASES:
        if case.name.split()[0] not in chosen:
            continue
        torch.manual_seed(0)
        inputs = case.inputs()
        row = {"case": case.name}
        torch._dynamo.reset()
        inductor = torch.compile(case.fn)
        expected = inductor(*inputs)
        grads = [torch.randn_like(o) for o in (expected if isinstance(expected, tuple) else (expected,))]
        row["inductor fwd ms"] = device_ms(lambda: inductor(*inputs))
        row["inductor fwd+bwd ms"] = device_ms(lambda: _step(inductor, inputs, grads))
        read = sum(x.numel() * x.element_size() for x in inputs)
        for walk in walks:
            row_kernel.LOOP_BLOCK, row_kernel.row_warps = rule
            if walk is not None:
                row_kernel.LOOP_BLOCK = walk[0]
                row_kernel.row_warps = lambda xblock, rblock, warps=walk[1]: warps
            torch._dynamo.reset()
            fused = torch.compile(case.fn, backend=fusepass.backend(strict=True, graphs=False))
            got = fused(*inputs)
            for a, b in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple)
                            else (expected,)):
                assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2), (case.name, walk)
            label = "as is" if walk is None else ":".join(map(str, walk))
            row[f"{label} fwd ms"] = ms = device_ms(lambda: fused(*inputs))
            row[f"{label} fwd TB/s"] = read / ms / 1e9
            row[f"{label} fwd+bwd ms"] = device_ms(lambda: _step(fused, inputs, grads))
        row_kernel.LOOP_BLOCK, row_kernel.row_warps = rule
        rows.append(row)
        print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else str(v) for k, v in row.items()), flush=True)
    print(keep("row-walks", list(rows[0]), rows,
               notes="bf16, device ms per call (torch.profiler); fwd TB/s counts the inputs read once; walks "
                     "`elements a chunk:warps`, \"as is\" the product's rule"))


if __name__ == "__main__":
    main()
