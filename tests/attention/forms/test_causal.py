"""Causal self-attention: each query sees the keys at and before its position. The mask is built in the graph
from positions (arange, tril), or sliced from a registered tril buffer (GPT-2); either way the kernel skips the
tiles above the diagonal and evaluates the mask only on the tiles it crosses."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention.forms.common import check_declined, check_fused, qkv
from support import DEVICE
from torch import nn


def causal_from_arange(q, k, v):
    i = torch.arange(q.size(-2), device=q.device)
    scores = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def causal_from_tril(q, k, v):
    n = q.size(-2)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class GPT2Attention(nn.Module):
    """GPT-2's: a bool tril buffer of the longest length, sliced to this one; the scale a 0-dim tensor."""

    def __init__(self, max_positions: int = 64):
        super().__init__()
        causal = torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
        self.register_buffer("bias", causal.view(1, 1, max_positions, max_positions), persistent=False)

    def forward(self, q, k, v):
        n = q.size(-2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5, device=q.device)
        scores = torch.where(self.bias[:, :, :n, :n], scores, torch.finfo(scores.dtype).min)
        return torch.matmul(nn.functional.softmax(scores, dim=-1), v)


class NanoGPTAttention(nn.Module):
    """nanoGPT's: a float tril buffer compared with 0."""

    def __init__(self, max_positions: int = 64):
        super().__init__()
        causal = torch.tril(torch.ones(max_positions, max_positions))
        self.register_buffer("bias", causal.view(1, 1, max_positions, max_positions), persistent=False)

    def forward(self, q, k, v):
        n = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        scores = scores.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        return F.softmax(scores, dim=-1) @ v

def causal_additive_mask(q, k, v):
    """Hugging Face's eager mask for Llama: 0 where a key is seen, the dtype's minimum elsewhere, made with a
    `torch.tensor(0.0)` (a constant of the trace) and added to the scores."""
    position = torch.arange(q.size(-2), device=q.device)
    allowed = position[None, :] <= position[:, None]
    mask = torch.where(allowed, torch.tensor(0.0, device=q.device, dtype=q.dtype), torch.finfo(q.dtype).min)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1)) + mask[None, None]
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def causal_subsequent_mask(q, k, v):
    """nn.Transformer's: `generate_square_subsequent_mask`, a triangle of -inf above the diagonal, added."""
    mask = nn.Transformer.generate_square_subsequent_mask(q.size(-2), device=q.device, dtype=q.dtype)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def causal_inverted_mask(q, k, v):
    """Hugging Face's inverted mask: (1 - keep) times the dtype's minimum, from a bool tril, added."""
    n = q.size(-2)
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    mask = (1.0 - keep[None, None].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


FEATURES = ("causal",)
# A buffer's values are not known when the graph is compiled: the mask is read from it, as any mask tensor.
BUFFER_FEATURES = ("causal",)  # the buffer read as the band it holds (known_contents)


def causal_with_8_wide_heads(q, k, v):
    """A tiny model's heads of 8: the kernel's dot products need a head dim of at least 16."""
    return causal_from_arange(q, k, v)


DECLINED = causal_with_8_wide_heads
DECLINED_REASON = "head dim 8 outside 16..256"
SUMMARY = ("from arange or tril, nn.Transformer's added triu of -inf, Hugging Face's additive 0/min mask (alone, or "
           "added to a bias first as T5's decoder does), or a module's tril buffer (GPT-2's, nanoGPT's: computed "
           "from the positions, its contents checked on each call)")


@pytest.mark.parametrize("form", [causal_from_arange, causal_from_tril, causal_additive_mask, causal_subsequent_mask,
                                  causal_inverted_mask])
def test_causal(form):
    check_fused(form, *qkv(23), expected=FEATURES)


def test_registered_buffer():
    check_fused(GPT2Attention().to(DEVICE), *qkv(23, d=24), expected=BUFFER_FEATURES)


def test_float_buffer_compared_with_zero():
    check_fused(NanoGPTAttention().to(DEVICE), *qkv(13), expected=BUFFER_FEATURES)


def test_declined_twin():
    check_declined(DECLINED, *qkv(23, d=8), reason=DECLINED_REASON)


def test_an_additive_mask_that_keeps_an_offset_is_no_mask():
    """`where(allowed, tensor(1.0), min)` adds 1 where a key is seen: not a mask alone; computed per score."""
    def offset_mask(q, k, v):
        position = torch.arange(q.size(-2), device=q.device)
        allowed = position[None, :] <= position[:, None]
        mask = torch.where(allowed, torch.tensor(1.0, device=q.device), torch.finfo(q.dtype).min)
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v

    check_fused(offset_mask, *qkv(23), expected=())  # fused, no tile skipped
