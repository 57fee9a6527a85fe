"""The headline: causal self-attention as people write it by hand, rewritten into one flash kernel.

    python examples/causal_attention.py

Eager materializes the N×N scores and probabilities (and keeps them for backward); fusepass finds the
matmul → mask → softmax → matmul, computes the mask inside the kernel and skips the tiles it empties.
"""
from __future__ import annotations

import math

from common import compare, qkv, size

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


if __name__ == "__main__":
    q, k, v = qkv(batch=2, heads=16, length=size(8192, 64), head_dim=128)
    compare("causal attention, B2 H16 D128", causal_attention, torch.compile(causal_attention, backend="fusepass"),
            q, k, v, backward=True)
