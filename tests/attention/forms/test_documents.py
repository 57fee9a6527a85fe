"""Packed sequences: several documents concatenated into one row of the batch, each query attending causally
within its own document only. The document ids given per token, or counted in the graph from the tokens that
start a document (a cumsum: index code, computed before the kernel)."""
from __future__ import annotations

import math

import pytest
import torch
from attention.forms.common import B, check_declined, check_fused, qkv
from support import DEVICE

N = 23


def packed_documents(q, k, v, document_ids):
    n = q.size(-2)
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~(same & causal), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def documents_from_starts(q, k, v, starts):
    return packed_documents(q, k, v, starts.cumsum(dim=-1))


FEATURES = ("causal", "document")


def average_weights_returned(q, k, v, document_ids):
    """nn.MultiheadAttention's need_weights=True: the probabilities, averaged over the heads, returned too."""
    n = q.size(-2)
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    probs = torch.softmax(scores.masked_fill(~(same & causal), float("-inf")), dim=-1)
    return probs @ v, probs.mean(dim=1)


DECLINED = average_weights_returned
DECLINED_REASON = "probabilities also used by"
SUMMARY = "per-token document ids (or their cumsum) compared at query and key, with causal"


def starts():
    """Documents of 7, 9 and 7 tokens in the first row, of 14 and 9 in the second."""
    starts = torch.zeros(B, N, dtype=torch.long, device=DEVICE)
    starts[0, [7, 16]] = 1
    starts[-1, 14] = 1
    return starts


@pytest.mark.parametrize("form", [packed_documents, documents_from_starts])
def test_documents(form):
    ids = starts() if form is documents_from_starts else starts().cumsum(dim=-1)
    check_fused(form, *qkv(N), ids, expected=FEATURES)


def test_declined_twin():
    check_declined(DECLINED, *qkv(N), starts().cumsum(dim=-1), reason=DECLINED_REASON)
