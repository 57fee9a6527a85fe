"""Groups with column sums (a bias's gradient alone, a norm's weight and bias gradients, a bias's beside the GELU's
backward), forward and backward, swept over the programs a multiprocessor runs (`row_kernel.COLUMN_PROGRAMS_PER_SM`),
the elements a program holds (`row_kernel.PROGRAM_TILE`), the row walk's pipeline stages
(`row_kernel.COLUMN_STAGES`) and the warps of a program holding one row of 4096 or more
(`row_kernel.COLUMN_WIDE_ROW_WARPS`) beside eager and Inductor, bf16, device ms per forward+backward.

    PYTHONPATH=. python bench/column_sums.py [--programs 2,4,8] [--tiles 2048,4096] [--stages 1,2,3] [--warps 8,16]
        [--cases bias+gelu,rmsnorm,rmsnorm-gemma]

Beside the product's setting ("as is"), "ATen's lone sums": a column sum with no pointwise op beside it (the bias
alone's gradient) left to ATen's sum (`partition.LONE_COLUMN_SUMS` off). Kernels only: fusepass without whole-graph
replays, as Inductor's default runs.

Writes bench/results/column-sums-<date>.md and .json; the product's setting is the "as is" column.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from harness import device_ms, keep

import fusepass
from fusepass.elementwise import partition, row_kernel


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


def add_bias(x, b):
    return x + b


def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def gemma_rmsnorm(x, w):
    # Gemma's: normed in float32, times (1 + weight), cast back
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(x.dtype)


CASES = [("bias 8x512x768", add_bias, (8, 512, 768), 1),  # its gradient a sum alone (BERT's q, k, v biases)
         ("layernorm 8x1024x768", layer_norm, (8, 1024, 768), 2),
         ("bias+gelu 8x1024x3072", bias_gelu, (8, 1024, 3072), 1),
         ("rmsnorm 16384x4096", rmsnorm, (16384, 4096), 1),
         # a width no power of two (Gemma 2's 2304: held in a 4096-wide tile) and its rows (T8192)
         ("rmsnorm-gemma 8192x2304", gemma_rmsnorm, (8192, 2304), 1),
         # rows too long to hold whole: the sums are ATen's (a block of columns a program was slower: NOTES)
         ("bias+gelu 8x1024x5120", bias_gelu, (8, 1024, 5120), 1),
         ("rmsnorm 8192x5120", rmsnorm, (8192, 5120), 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", default="2,4,8")
    parser.add_argument("--tiles", default="2048,4096")
    parser.add_argument("--stages", default="1", help="the row walk's pipeline stages (row_kernel.COLUMN_STAGES)")
    parser.add_argument("--warps", default=str(row_kernel.COLUMN_WIDE_ROW_WARPS),
                        help="warps of a walk holding one row of 4096 or more (row_kernel.COLUMN_WIDE_ROW_WARPS)")
    parser.add_argument("--cases", help="the cases whose names start so (all by default)")
    args = parser.parse_args()
    settings = [(p, t, s, w) for w in map(int, args.warps.split(",")) for s in map(int, args.stages.split(","))
                for t in map(int, args.tiles.split(",")) for p in map(int, args.programs.split(","))]
    kernels = fusepass.backend(strict=True, graphs=False)
    rule = (row_kernel.COLUMN_PROGRAMS_PER_SM, row_kernel.PROGRAM_TILE, row_kernel.COLUMN_STAGES,
            row_kernel.COLUMN_WIDE_ROW_WARPS)
    rows = []
    for name, fn, shape, weights in CASES:
        if args.cases and not name.startswith(tuple(args.cases.split(","))):
            continue
        torch.manual_seed(0)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        extra = [torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
                 for _ in range(weights)]
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        row = {"case": name}
        for label, backend, setting in [("eager", None, rule), ("inductor", "inductor", rule),
                                        ("as is", kernels, rule), ("ATen's lone sums", kernels, rule)] + \
                [(f"{p}/SM {t} x{s} w{w}", kernels, (p, t, s, w)) for p, t, s, w in settings]:
            (row_kernel.COLUMN_PROGRAMS_PER_SM, row_kernel.PROGRAM_TILE, row_kernel.COLUMN_STAGES,
             row_kernel.COLUMN_WIDE_ROW_WARPS) = setting
            partition.LONE_COLUMN_SUMS = label != "ATen's lone sums"
            torch._dynamo.reset()
            compiled = fn if backend is None else torch.compile(fn, backend=backend)

            def step():
                compiled(x, *extra).backward(grad)

            step()
            row[f"{label} ms"] = device_ms(step)
        (row_kernel.COLUMN_PROGRAMS_PER_SM, row_kernel.PROGRAM_TILE, row_kernel.COLUMN_STAGES,
         row_kernel.COLUMN_WIDE_ROW_WARPS) = rule
        partition.LONE_COLUMN_SUMS = True
        rows.append(row)
        print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else str(v) for k, v in row.items()), flush=True)
    print(keep("column-sums", list(rows[0]), rows, "bf16 forward+backward, device ms per call (torch.profiler); "
                                                   "fusepass columns: column programs a multiprocessor, elements a "
                                                   "program holds, x the row walk's pipeline stages, w the warps of "
                                                   "a walk holding one row of 4096 or more"))


if __name__ == "__main__":
    main()
