"""Dropout on the attention probabilities, as nn.Dropout in the attention module (BERT, GPT-2, ViT): in training
each probability is zeroed with chance p and the rest scaled by 1 / (1 - p); the kernel draws the mask per tile
from a seed, and its backward draws the same. Its draws are not eager's, so the values are checked as
test_attention.py checks them: with V = I the output is the dropped probabilities themselves, whose zeros must
be a fraction p, whose other entries P / (1 - p), and whose gradients follow from that same mask. In eval mode
the dropout is the identity and the attention plain, compared with eager as the other families are."""
from __future__ import annotations

import math

import torch
from attention.forms.common import B, H, check_declined, check_fused, features, qkv, random_tensor
from support import DEVICE
from torch import nn

import fusepass

P = 0.25


class DropoutAttention(nn.Module):
    def __init__(self, p: float = P):
        super().__init__()
        self.dropout = nn.Dropout(p)

    def forward(self, q, k, v):
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1)
        return self.dropout(probs) @ v


FEATURES = ("dropout",)


def dropkey(q, k, v, p=P):
    """DropKey (Li et al.): keys dropped from the scores before the softmax, by a Bernoulli draw per score."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores + torch.bernoulli(torch.full_like(scores, p)) * -1e12
    return torch.softmax(scores, dim=-1) @ v


DECLINED = dropkey
DECLINED_REASON = "the score chain has aten.bernoulli, which has no per-tile form"
SUMMARY = "dropout on the probabilities, drawn per tile from a seed"


def test_dropout_drops_a_fraction_p_and_scales_the_rest():
    n = 24  # V = I: the output is the dropped probabilities
    q, k = (random_tensor((B, H, n, n), torch.float32).requires_grad_() for _ in range(2))
    eye = torch.eye(n, device=DEVICE).expand(B, H, n, n).contiguous().requires_grad_()
    fusepass.reset()
    out = torch.compile(DropoutAttention().train(), backend="fusepass", fullgraph=True)(q, k, eye)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, eye), grad)
    report = fusepass.last_report()
    assert features(report, "forward") == features(report, "backward") == [sorted(FEATURES)]

    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(n), dim=-1).detach()
    dropped = out == 0
    assert abs(dropped.float().mean().item() - P) < 0.05
    torch.testing.assert_close(out[~dropped], (probs / (1 - P))[~dropped], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dv, out.transpose(-1, -2) @ grad, rtol=1e-5, atol=1e-5)
    d_probs = grad * out / probs  # the gradient reaching P through the kept, rescaled entries
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) / math.sqrt(n)
    torch.testing.assert_close(dq, d_scores @ k.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk, d_scores.transpose(-1, -2) @ q.detach(), rtol=1e-4, atol=1e-5)


def test_eval_mode_is_plain_attention():
    check_fused(DropoutAttention().eval(), *qkv(23), expected=())


def test_declined_twin():
    check_declined(DECLINED, *qkv(23), reason=DECLINED_REASON, exact=False)
