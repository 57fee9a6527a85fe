"""Sliding-window (local) causal attention, as Mistral and Gemma 2's local layers write it: each query sees
itself and the `window - 1` keys before it. The mask from the distance i - j, or as a band of tril and triu;
the kernel visits only the tiles the band crosses."""
from __future__ import annotations

import math

import pytest
import torch
from attention.forms.common import check_declined, check_fused, qkv

WINDOW = 8


def window_from_distance(q, k, v, window=WINDOW):
    i = torch.arange(q.size(-2), device=q.device)
    distance = i[:, None] - i[None, :]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill((distance < 0) | (distance >= window), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def window_as_a_band(q, k, v, window=WINDOW):
    n = q.size(-2)
    ones = torch.ones(n, n, dtype=torch.bool, device=q.device)
    band = torch.tril(ones) & torch.triu(ones, diagonal=1 - window)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = torch.where(band, scores, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


def local_both_ways(q, k, v, window=WINDOW):
    """A bidirectional local window (an encoder's): the keys within `window` positions on either side."""
    i = torch.arange(q.size(-2), device=q.device)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill((i[:, None] - i[None, :]).abs() > window, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def mistral_additive_mask(q, k, v, window=WINDOW):
    """Hugging Face's eager mask for Mistral: 0 where a key is seen, the dtype's minimum elsewhere, made with a
    `torch.tensor(0.0)` (a constant of the trace) and added to the scores."""
    position = torch.arange(q.size(-2), device=q.device)
    q_idx, kv_idx = position[:, None], position[None, :]
    allowed = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    mask = torch.where(allowed, torch.tensor(0.0, device=q.device, dtype=q.dtype), torch.finfo(q.dtype).min)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask[None, None]
    return torch.softmax(scores, dim=-1) @ v


FEATURES = ("window",)


def top_k_in_the_window(q, k, v, window=WINDOW, top=3):
    """Only each row's `top` largest scores of the window kept: the mask depends on the scores' values through a
    top-k over the whole row."""
    i = torch.arange(q.size(-2), device=q.device)
    distance = i[:, None] - i[None, :]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill((distance < 0) | (distance >= window), float("-inf"))
    kth = scores.topk(top, dim=-1).values[..., -1:]
    scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


DECLINED = top_k_in_the_window
DECLINED_REASON = "the score chain has aten.topk, which has no per-tile form"
SUMMARY = "a causal band from i - j, tril & triu, or Hugging Face's additive mask"


@pytest.mark.parametrize("form", [window_from_distance, window_as_a_band, mistral_additive_mask])
def test_sliding_window(form):
    check_fused(form, *qkv(33), expected=FEATURES)


def test_local_both_ways():
    check_fused(local_both_ways, *qkv(23), expected=FEATURES)


def test_declined_twin():
    check_declined(DECLINED, *qkv(23), reason=DECLINED_REASON)
