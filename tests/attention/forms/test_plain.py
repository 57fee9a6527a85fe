"""Plain scaled dot-product attention: softmax(Q Kᵀ / √d) V, with no mask or bias, written on [B, H, N, D] tensors
or on Q, K and V split from one packed projection (as GPT-2, ViT and most encoders compute them)."""
from __future__ import annotations

import math

import torch
from attention.forms.common import B, check_declined, check_fused, qkv, random_tensor


def scaled_dot_product(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return scores.softmax(dim=-1) @ v


def packed_self_attention(x, w_qkv, heads=2):
    """Q, K and V as three thirds of one projection, split into heads and merged back."""
    b, n, _ = x.shape
    q, k, v = (x @ w_qkv).view(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
    out = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5, dim=-1) @ v
    return out.transpose(1, 2).reshape(b, n, -1)


FEATURES = ()


def minus_the_row_max(q, k, v):
    """Each row's max taken out "for stability" before the softmax: a reduction over all keys of a row, which a
    kernel that sees one tile of keys at a time cannot compute (the softmax does it anyway)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores - scores.max(dim=-1, keepdim=True).values
    return scores.softmax(dim=-1) @ v


DECLINED = minus_the_row_max
DECLINED_REASON = "the score chain has aten.max, which has no per-tile form"
SUMMARY = "softmax(Q Kᵀ / √d) V, heads split or from one packed QKV projection"


def test_scaled_dot_product():
    check_fused(scaled_dot_product, *qkv(23, d=24), expected=FEATURES)


def test_packed_projection():
    x, w_qkv = random_tensor((B, 23, 16), torch.float32), random_tensor((16, 3 * 32), torch.float32, low=-0.4, high=0.4)
    check_fused(packed_self_attention, x, w_qkv, expected=FEATURES)


def test_declined_twin():
    check_declined(DECLINED, *qkv(23, d=24), reason=DECLINED_REASON)
