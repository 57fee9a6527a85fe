"""Elementwise chains: eager, Inductor and fusepass side by side, with a device copy as the ceiling.

    PYTHONPATH=. python bench/elementwise.py [--quick]

GB/s counts the fewest bytes the chain must move: each input read once, each output written once.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from harness import keep, median_ms, relative_error

import fusepass


@dataclass
class Case:
    name: str
    fn: Callable[..., torch.Tensor]
    make: Callable[[int], tuple[torch.Tensor, ...]]  # inputs for a problem of n elements
    backward: bool = False


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def square(n: int) -> int:
    return int(n ** 0.5)


def chain12(x):
    for k in range(6):
        x = x * (1.0 + 0.1 * k) + 0.5
    return x


CASES = [
    Case("gelu(x*0.5+b)*sigmoid(x)", lambda x, b: F.gelu(x * 0.5 + b) * torch.sigmoid(x),
         lambda n: (bf16(square(n), square(n)), bf16(square(n)))),
    Case("chain of 2: x*2+1", lambda x: x * 2 + 1, lambda n: (bf16(n),)),
    Case("chain of 5: relu(x*a+b)-c", lambda x: torch.relu(x * 1.5 + 0.25) - 0.125 + x, lambda n: (bf16(n),)),
    Case("chain of 12", chain12, lambda n: (bf16(n),)),
    Case("broadcast: x*row+col", lambda x, r, c: torch.where(x > 0, x * r + c, c),
         lambda n: (bf16(square(n), square(n)), bf16(square(n)), bf16(square(n), 1))),
    Case("mixed: bf16*fp32 -> fp32", lambda x, y: x * y + 1.0,
         lambda n: (bf16(n), torch.randn(n, device="cuda"))),
    Case("gelu-bias fwd+bwd", lambda x, b: F.gelu(x + b),
         lambda n: (bf16(square(n), square(n)).requires_grad_(), bf16(square(n)).requires_grad_()), True),
    Case("swiglu fwd+bwd", lambda g, u: F.silu(g) * u,
         lambda n: (bf16(n).requires_grad_(), bf16(n).requires_grad_()), True),
    # Special functions from CUDA's math library (fusepass.codegen.mathlib), and digamma as eager's CUDA kernel
    # computes it (with a float64 tangent for negative inputs): how far from the copy.
    Case("CUDA math: atan(x*2)+x", lambda x: torch.atan(x * 2) + x, lambda n: (bf16(n),)),
    Case("CUDA math: lgamma(x*x+0.5)*2", lambda x: torch.lgamma(x * x + 0.5) * 2, lambda n: (bf16(n),)),
    Case("digamma(|x|*3+0.5)+x", lambda x: torch.digamma(x.abs() * 3 + 0.5) + x, lambda n: (bf16(n),)),
    Case("lgamma fwd+bwd (digamma)", torch.lgamma, lambda n: ((bf16(n).abs() * 3 + 0.5).requires_grad_(),), True),
]


def run_case(case: Case, n: int) -> dict:
    inputs = case.make(n)
    compiled = {
        "eager": case.fn,
        "inductor": torch.compile(case.fn, backend="inductor"),
        # strict: a kernel that fails raises instead of quietly timing the unfused fallback
        "fusepass": torch.compile(case.fn, backend=fusepass.backend(strict=True, graphs=False)),
    }
    expected = case.fn(*inputs)
    for name in ("inductor", "fusepass"):
        out = compiled[name](*inputs)
        error = relative_error(out, expected)
        assert error < 1e-2, f"{case.name}: {name} differs from eager by {error:.2e}"
    grad = torch.randn_like(expected)

    def step(fn):
        if not case.backward:
            return lambda: fn(*inputs)
        return lambda: torch.autograd.grad(fn(*inputs), inputs, grad)

    moved = sum(t.numel() * t.element_size() for t in inputs) + expected.numel() * expected.element_size()
    if case.backward:  # and the backward: read grad (and the inputs again), write one grad per input
        moved += grad.numel() * grad.element_size() + 2 * sum(t.numel() * t.element_size() for t in inputs)
    row = {"case": case.name, "MiB": round(moved / 2**20, 1)}
    source = inputs[0].detach()
    copy_ms = median_ms(lambda: source.clone())
    copy_gbps = 2 * source.numel() * source.element_size() / copy_ms / 1e6
    row["copy GB/s"] = copy_gbps
    for name, fn in compiled.items():
        ms = median_ms(step(fn))
        row[f"{name} ms"] = ms
        row[f"{name} GB/s"] = moved / ms / 1e6
    row["fusepass/copy"] = row["fusepass GB/s"] / copy_gbps
    row["fusepass/inductor"] = row["inductor ms"] / row["fusepass ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the peer's case at 8192x8192 only")
    parser.add_argument("--sizes", default="19,25,29", help="log2 of the element counts")
    args = parser.parse_args()
    sizes = [1 << 26] if args.quick else [1 << int(e) for e in args.sizes.split(",")]
    cases = CASES[:1] if args.quick else CASES
    rows = []
    for case in cases:
        for n in sizes:
            fusepass.reset()
            torch._dynamo.reset()
            try:
                rows.append(run_case(case, n))
            except Exception as error:  # one failing case is reported in its row, the suite goes on
                rows.append({"case": case.name, "MiB": n, "error": f"{type(error).__name__}: {str(error)[-300:]}"})
            print(rows[-1], flush=True)
    columns = ["case", "MiB", "copy GB/s", "eager GB/s", "inductor GB/s", "fusepass GB/s", "fusepass ms",
               "fusepass/copy", "fusepass/inductor", "error"]
    print(keep("elementwise", columns, rows))


if __name__ == "__main__":
    main()
