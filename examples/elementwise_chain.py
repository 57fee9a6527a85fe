"""An elementwise chain, ``gelu(x * 0.5 + b) * sigmoid(x)``: five eager kernels, one fused kernel.

    python examples/elementwise_chain.py
"""
from __future__ import annotations

from common import DEVICE, compare, size

import torch
import torch.nn.functional as F


def chain(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x * 0.5 + b) * torch.sigmoid(x)


if __name__ == "__main__":
    n = size(8192, 96)
    x = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    compare(f"gelu(x*0.5+b)*sigmoid(x), {n}x{n} bf16", chain, torch.compile(chain, backend="fusepass"), x, b,
            backward=True)
