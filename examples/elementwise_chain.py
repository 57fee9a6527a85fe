"""An elementwise chain, ``gelu(x * 0.5 + b) * sigmoid(x)``: five eager kernels, one fused kernel.

    python examples/elementwise_chain.py
"""
from __future__ import annotations

from common import DEVICE, ON_GPU, compare

import torch
import torch.nn.functional as F

import fusepass


def chain(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


def main() -> None:
    n = 8192 if ON_GPU else 96
    x = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    fused = torch.compile(chain, backend="fusepass")
    compare(f"gelu(x*0.5+b)*sigmoid(x), {n}x{n} bf16", chain, fused, x, b)
    print(fusepass.last_report())


if __name__ == "__main__":
    main()
