"""A dense additive bias on the scores, learned: a per-head [H, N, N] parameter sliced to the length, or
AlphaFold's pair bias, a projection of the pair representation [B, N, N, C] to one bias per head. The kernel
reads the bias per tile and writes its gradient (the scores' gradient, summed over what it is broadcast over)."""
from __future__ import annotations

import math

import pytest
import torch
from attention.forms.common import B, H, check_declined, check_fused, qkv, random_tensor

N, MAX_N, PAIR = 23, 32, 8


def learned_bias(q, k, v, bias):  # bias: an nn.Parameter [1, H, MAX_N, MAX_N]
    n = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + bias[:, :, :n, :n]
    return torch.softmax(scores, dim=-1) @ v


def pair_bias(q, k, v, pair, w_bias):
    """AlphaFold's triangle/row attention: the bias a linear map of the pair representation, per head."""
    bias = (pair @ w_bias).permute(0, 3, 1, 2)  # [B, N, N, C] @ [C, H] -> [B, H, N, N]
    scores = torch.einsum("bhqd,bhkd->bhqk", q * q.size(-1) ** -0.5, k) + bias
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), v)


FEATURES = ("bias",)


def max_logit_tracked(q, k, v, bias):
    """QK-Clip (Kimi K2's MuonClip): each head's largest score returned, to rescale W_q and W_k when it grows."""
    n = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + bias[:, :, :n, :n]
    return torch.softmax(scores, dim=-1) @ v, scores.amax(dim=(-2, -1))


DECLINED = max_logit_tracked
DECLINED_REASON = "scores also used by aten.amax"
SUMMARY = "a learned dense [1 or B, H, N, N] bias, with its gradient"


@pytest.mark.parametrize("form", [learned_bias, pair_bias])
def test_additive_bias(form):
    extra = [random_tensor((1, H, MAX_N, MAX_N), torch.float32)] if form is learned_bias else \
        [random_tensor((B, N, N, PAIR), torch.float32), random_tensor((PAIR, H), torch.float32, low=-0.5, high=0.5)]
    check_fused(form, *qkv(N), *extra, expected=FEATURES)


def test_declined_twin():
    check_declined(DECLINED, *qkv(N), random_tensor((1, H, MAX_N, MAX_N), torch.float32), reason=DECLINED_REASON)
