"""Key padding: a batch of sequences of different lengths, padded to one; no query attends to a padded key. The
mask as nn.MultiheadAttention's key_padding_mask (True at padding, fairseq's lengths_to_padding_mask), as BERT's
additive attention mask (1 at tokens, 0 at padding, turned into 0 / finfo.min), or built in the graph from the
lengths."""
from __future__ import annotations

import math

import pytest
import torch
from attention.forms.common import B, check_declined, check_fused, qkv
from support import DEVICE

N = 23


def lengths_to_padding_mask(lengths, n):
    """True at the padded positions (fairseq)."""
    return torch.arange(n, device=lengths.device)[None, :] >= lengths[:, None]


def key_padding(q, k, v, key_padding_mask):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def bert_attention_mask(q, k, v, attention_mask):
    extended = (1.0 - attention_mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1)) + extended
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def padding_from_lengths(q, k, v, lengths):
    return key_padding(q, k, v, lengths_to_padding_mask(lengths, k.size(-2)))


FEATURES = ("padding_mask",)


def masked_after_the_softmax(q, k, v, key_padding_mask):
    """Padded keys zeroed in the probabilities and the rows renormalised (the same values): the probabilities go
    through a product and a row sum before the matmul with V."""
    probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1)
    probs = probs * ~key_padding_mask[:, None, None, :]
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs @ v


DECLINED = masked_after_the_softmax
DECLINED_REASON = "not to a matmul with V"
SUMMARY = "[B, Nk] key mask: bool, BERT's additive 0/1, or built from lengths"


def lengths():
    return torch.tensor([N, 9][:B], device=DEVICE)


@pytest.mark.parametrize("form", [key_padding, bert_attention_mask])
def test_padding_mask(form):
    padding = lengths_to_padding_mask(lengths(), N)
    check_fused(form, *qkv(N), padding if form is key_padding else (~padding).long(), expected=FEATURES)


def test_padding_from_lengths():
    check_fused(padding_from_lengths, *qkv(N), lengths(), expected=FEATURES)


def test_declined_twin():
    check_declined(DECLINED, *qkv(N), lengths_to_padding_mask(lengths(), N), reason=DECLINED_REASON)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bert_mask_of_a_sequence_that_is_all_padding(dtype):
    """BERT's additive mask in half precision, one sequence all padding: eager's addition rounds every score of its
    rows to finfo.min, so they weigh their keys alike (V's mean); the kernels round the scores as eager does (in fp32
    the scores' differences would survive the addition)."""
    q, k, v = (t.to(dtype) for t in qkv(N))
    tokens = torch.ones(B, N, dtype=torch.long, device=DEVICE)
    tokens[-1] = 0
    check_fused(bert_attention_mask, q, k, v, tokens, expected=FEATURES)
