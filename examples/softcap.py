"""Gemma-2-style soft-capping of the scores, ``tanh(s / c) · c``, with a causal mask.

    python examples/softcap.py
"""
from __future__ import annotations

import math

from common import compare, qkv, size

import torch

CAP = 50.0


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = torch.tanh(scores / CAP) * CAP
    scores = scores + torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


if __name__ == "__main__":
    q, k, v = qkv(batch=2, heads=16, length=size(8192, 64), head_dim=128)
    compare("softcap + causal", softcap_attention, torch.compile(softcap_attention, backend="fusepass"), q, k, v,
            backward=True)
