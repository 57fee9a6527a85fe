"""Multi-head latent attention as DeepSeek's eager code writes it (q·k over 192 = 128 + 64 rotary dims, values 128
wide, causal, the softmax in fp32), under fusepass (V at its own head dim, q·k's 192 as products of 128 and 64)
beside SDPA, which takes the two head dims as they are, eager and Inductor; bf16.

    PYTHONPATH=. python bench/latent_attention.py [--shapes B,H,N ...] [--dims 192,128]

Forward and forward+backward median ms, TFLOP/s of the unmasked work (2·B·H·N²·(Dqk + Dv) per forward, × 2.5 with
the backward, × (N + 1) / 2N for the causal half), and fusepass's output and gradients' distance from SDPA's.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from harness import keep, median_ms, relative_error

import fusepass

COLUMNS = ["shape", "pass", "rewritten", "error vs sdpa", "fusepass ms", "fusepass TFLOP/s", "sdpa ms", "eager ms",
           "inductor ms", "vs sdpa", "vs inductor"]


def latent_attention(q, k, v):
    scores = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5
    n = q.size(-2)
    causal = torch.full((n, n), float("-inf"), device=q.device).triu(1)
    weights = torch.softmax(scores + causal, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def measure(b: int, h: int, n: int, qk_dim: int, v_dim: int, backward: bool) -> dict:
    q, k = (torch.randn(b, h, n, qk_dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
            for _ in range(2))
    v = torch.randn(b, h, n, v_dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    grad = torch.randn(b, h, n, v_dim, device="cuda", dtype=torch.bfloat16)
    fusepass.reset()
    variants = {"fusepass": torch.compile(latent_attention, backend=fusepass.backend(strict=True, sdpa=False, graphs=False)),
                "sdpa": sdpa, "eager": latent_attention, "inductor": torch.compile(latent_attention)}

    def step(fn):
        if not backward:
            return lambda: (fn(q, k, v),)
        return lambda: (out := fn(q, k, v), *torch.autograd.grad(out, (q, k, v), grad))

    fused, peer = step(variants["fusepass"])(), step(sdpa)()
    report = fusepass.last_report()
    row = {"shape": f"B{b} H{h} N{n} Dqk{qk_dim} Dv{v_dim}", "pass": "fwd+bwd" if backward else "fwd",
           "rewritten": any(r.kind == "attention" for r in report.rewrites) if report else False,
           "error vs sdpa": max(relative_error(a, e) for a, e in zip(fused, peer))}
    flops = 2 * b * h * n * n * (qk_dim + v_dim) * (n + 1) / (2 * n) * (2.5 if backward else 1.0)
    for name, fn in variants.items():
        row[f"{name} ms"] = median_ms(step(fn))
    row["fusepass TFLOP/s"] = flops / row["fusepass ms"] / 1e9
    row["vs sdpa"] = row["sdpa ms"] / row["fusepass ms"]
    row["vs inductor"] = row["inductor ms"] / row["fusepass ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["2,16,4096", "8,16,1024"], help="B,H,N")
    parser.add_argument("--dims", default="192,128", help="the q·k head dim and V's")
    args = parser.parse_args()
    qk_dim, v_dim = map(int, args.dims.split(","))
    rows = []
    for shape in args.shapes:
        b, h, n = map(int, shape.split(","))
        for backward in (False, True):
            rows.append(measure(b, h, n, qk_dim, v_dim, backward))
            print(rows[-1], flush=True)
    print(keep("latent-attention", COLUMNS, rows, "bf16, causal; fusepass pads V to the q·k head dim"))


if __name__ == "__main__":
    main()
