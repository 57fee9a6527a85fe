"""Grouped-query and multi-query attention: fewer K/V heads than query heads, each K/V head shared by a group of
query heads. Written with Llama's repeat_kv (expand and reshape), with repeat_interleave, or (multi-query) with
one K/V head broadcast by the matmul; the kernel reads the shared heads instead of the repeated copies."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention.forms.common import check_declined, check_fused, qkv

N = 23


def repeat_kv(x, n_rep):
    """Llama's: [B, kv_heads, N, D] to [B, kv_heads · n_rep, N, D]."""
    b, kv_heads, n, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, kv_heads, n_rep, n, d).reshape(b, kv_heads * n_rep, n, d)


def llama_gqa(q, k, v):
    group = q.size(1) // k.size(1)
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def interleaved_gqa(q, k, v):
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, dim=-1) @ v


def multi_query(q, k, v):  # k and v: [B, 1, N, D], broadcast over the heads
    return torch.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, dim=-1) @ v


FEATURES = ("gqa",)


def weights_returned(q, k, v):
    """Llama's output_attentions=True: the probabilities returned with the output."""
    group = q.size(1) // k.size(1)
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v), probs


DECLINED = weights_returned
DECLINED_REASON = "probabilities also used by"
SUMMARY = "repeat_kv, repeat_interleave, or one K/V head broadcast (MQA)"


@pytest.mark.parametrize("form, kv_heads", [(llama_gqa, 2), (interleaved_gqa, 2), (multi_query, 1)])
def test_gqa(form, kv_heads):
    check_fused(form, *qkv(N, heads=4, kv_heads=kv_heads, batch=1), expected=FEATURES)  # B · H kept at 4


def test_declined_twin():
    check_declined(DECLINED, *qkv(N, heads=4, kv_heads=2, batch=1), reason=DECLINED_REASON)
