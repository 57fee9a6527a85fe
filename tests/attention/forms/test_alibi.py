"""ALiBi (Press et al.): no position embeddings, a per-head penalty linear in the distance to each key added to the
scores, here with a causal mask. Written with the distance j - i (fairseq, MPT), or BLOOM's way: the slope times
the key's position alone (equal after the softmax), added by baddbmm with batch and heads folded together. The
slopes may be learned: their gradient sums every score's."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention.forms.common import H, check_declined, check_fused, qkv
from support import DEVICE, SUMMED_GRADIENT_FP32

N = 23


def alibi_slopes(heads):
    """The geometric sequence 2^(-8/heads), 2^(-16/heads), ..."""
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)], device=DEVICE)


def alibi(q, k, v, slopes):
    positions = torch.arange(q.size(-2), device=q.device)
    relative = positions[None, :] - positions[:, None]  # j - i, at most 0 where a query sees a key
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + slopes[:, None, None] * relative
    scores = scores.masked_fill(relative > 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def bloom_alibi(q, k, v, slopes):
    b, h, n, d = q.shape
    positions = torch.arange(n, device=q.device)
    bias = (slopes[:, None] * positions[None, :]).reshape(1, h, 1, n).expand(b, h, 1, n).reshape(b * h, 1, n)
    scores = torch.baddbmm(bias, q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2), beta=1.0,
                           alpha=1 / math.sqrt(d))
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, v.reshape(b * h, n, d)).view(b, h, n, d)


FEATURES = ("alibi", "causal")


def biased_scores_returned(q, k, v, slopes):
    """The biased scores returned too (to plot them): the kernel never writes them."""
    positions = torch.arange(q.size(-2), device=q.device)
    relative = positions[None, :] - positions[:, None]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + slopes[:, None, None] * relative
    scores = scores.masked_fill(relative > 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, scores


DECLINED = biased_scores_returned
DECLINED_REASON = "scores also used by output"
SUMMARY = "slope × (j - i) per head, or BLOOM's slope × j by baddbmm; slopes fixed or learned"


@pytest.mark.parametrize("form", [alibi, bloom_alibi])
def test_alibi(form):
    check_fused(form, *qkv(N), alibi_slopes(H), expected=FEATURES, **SUMMED_GRADIENT_FP32)  # the slopes learn


def test_declined_twin():
    check_declined(DECLINED, *qkv(N), alibi_slopes(H), reason=DECLINED_REASON)
