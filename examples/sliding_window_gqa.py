"""Mistral-style attention: grouped-query heads repeated with ``repeat_kv`` and a sliding window mask.

    python examples/sliding_window_gqa.py

fusepass reads the shared K/V heads directly (no repeated copy) and visits only the tiles inside the band.
"""
from __future__ import annotations

import math

from common import compare, qkv, size

import torch
import torch.nn.functional as F

WINDOW = 1024


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, group, n, d).reshape(b, h * group, n, d)


def sliding_window_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    distance = i[:, None] - i[None, :]
    mask = torch.where((distance >= 0) & (distance < WINDOW), 0.0, torch.finfo(q.dtype).min)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1]) + mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


if __name__ == "__main__":
    q, k, v = qkv(batch=2, heads=16, length=size(8192, 64), head_dim=128, kv_heads=4)
    compare("sliding window 1024 + GQA 16:4", sliding_window_gqa,
            torch.compile(sliding_window_gqa, backend="fusepass"), q, k, v, backward=True)
