"""Inputs of the sm_90 kernels' tests (tests/flash/test_hopper_*.py): q, k, v at the layouts they serve, their scores
in float64, and a causal attention as a model writes it."""
from __future__ import annotations

import math

import torch
from support import DEVICE


def laid_out(layout, b, h, kv_h, n, d, dtype):
    """q, k, v as [B, H, N, D] views of the layout named, and an output laid out as `forward_outputs` lays it."""
    if layout == "bhnd":
        q = torch.randn(b, h, n, d, device=DEVICE, dtype=dtype)
        k, v = (torch.randn(b, kv_h, n, d, device=DEVICE, dtype=dtype) for _ in range(2))
    elif layout == "bnhd":
        q = torch.randn(b, n, h, d, device=DEVICE, dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(b, n, kv_h, d, device=DEVICE, dtype=dtype).transpose(1, 2) for _ in range(2))
    else:  # one projection's output [B, N, H + 2 · KV_H, D], sliced
        qkv = torch.randn(b, n, h + 2 * kv_h, d, device=DEVICE, dtype=dtype)
        q, k, v = (x.transpose(1, 2) for x in qkv.split([h, kv_h, kv_h], 2))
    out = torch.empty(b, n, h, d, device=DEVICE, dtype=dtype).transpose(1, 2) if layout != "bhnd" else \
        torch.empty(b, h, n, d, device=DEVICE, dtype=dtype)
    return q, k, v, out


def scores64(q, k, causal):
    """q kᵀ / √D in float64 (q and k as given, in float64), K heads repeated for their groups, -inf above the diagonal
    where causal."""
    group = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def causal_attention(x, wq, wk, wv, heads=4):
    """Causal attention over 256 features in `heads` heads (of 64 by default, of 128 at 2)."""
    b, n, _ = x.shape
    d = 256 // heads
    q, k, v = ((x @ w).view(b, n, heads, d).transpose(1, 2) for w in (wq, wk, wv))
    s = q @ k.transpose(-1, -2) / d ** 0.5
    i = torch.arange(n, device=x.device)
    s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return (torch.softmax(s.float(), -1).to(x.dtype) @ v).transpose(1, 2).reshape(b, n, 256)
