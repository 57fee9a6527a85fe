"""Cross-attention: queries from one sequence (a decoder's tokens, a Perceiver's latents), keys and values from
another of a different length (the encoder's memory). Written on [B, H, N, D] tensors, or projected from
[B, N, dim] activations with heads split by view and transpose and merged back."""
from __future__ import annotations

import math

import torch
from attention.forms.common import B, check_declined, check_fused, qkv, random_tensor

NQ, NK, DIM, HEADS = 13, 29, 32, 2


def cross_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def decoder_cross_attention(x, memory, w_q, w_kv):
    b, nq, nk = x.size(0), x.size(1), memory.size(1)
    q = (x @ w_q).view(b, nq, HEADS, -1).transpose(1, 2)
    k, v = (memory @ w_kv).view(b, nk, 2, HEADS, -1).permute(2, 0, 3, 1, 4)
    out = torch.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, dim=-1) @ v
    return out.transpose(1, 2).reshape(b, nq, DIM)


FEATURES = ("cross",)


def slot_attention(slots, k, v):
    """Slot Attention (Locatello et al.): the softmax over the slots (the queries), so that slots compete for
    each input, then each slot's weights renormalised over the inputs."""
    scores = torch.einsum("bid,bjd->bij", slots, k) * slots.size(-1) ** -0.5
    probs = scores.softmax(dim=1) + 1e-8
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.einsum("bjd,bij->bid", v, probs)


DECLINED = slot_attention
DECLINED_REASON = "not the key axis"
SUMMARY = "queries and keys of different lengths"


def test_cross_attention():
    check_fused(cross_attention, *qkv(NQ, nk=NK, d=24), expected=FEATURES)


def test_projected_from_two_sequences():
    x, memory = random_tensor((B, NQ, DIM), torch.float32), random_tensor((B, NK, DIM), torch.float32)
    w_q, w_kv = (random_tensor((DIM, n * DIM), torch.float32, low=-0.3, high=0.3) for n in (1, 2))
    check_fused(decoder_cross_attention, x, memory, w_q, w_kv, expected=FEATURES)


def test_declined_twin():
    slots, k, v = (random_tensor((B, n, 16), torch.float32) for n in (5, NK, NK))
    check_declined(DECLINED, slots, k, v, reason=DECLINED_REASON)
