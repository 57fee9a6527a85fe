"""BLOOM-style ALiBi: per-head slopes times the key-query distance, added through ``baddbmm``.

    python examples/alibi.py

The bias is never materialized: the kernel computes slope[h] · (k − q) for each tile.
"""
from __future__ import annotations

import math

from common import DEVICE, compare, qkv, size

import torch
import torch.nn.functional as F


def alibi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    b, h, n, d = q.shape
    positions = torch.arange(n, device=q.device)
    alibi = (slopes[:, None] * positions[None, :]).reshape(1, h, 1, n).expand(b, h, 1, n).reshape(b * h, 1, n)
    scores = torch.baddbmm(alibi.to(q.dtype), q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2),
                           beta=1.0, alpha=1 / math.sqrt(d))
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
    probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probabilities, v.reshape(b * h, n, d)).view(b, h, n, d)


if __name__ == "__main__":
    heads = 16
    q, k, v = qkv(batch=2, heads=heads, length=size(8192, 64), head_dim=128)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device=DEVICE)
    compare("ALiBi + causal", alibi_attention, torch.compile(alibi_attention, backend="fusepass"), q, k, v, slopes,
            backward=True)
