"""Masks built from data: a BERT-style padding mask, a document (segment-id) mask, and documents packed into
one sequence for causal language modelling.

    python examples/padding_and_documents.py

Each is loaded per tile from the small tensors it comes from ([B, N] lengths or segment ids), never as an
N×N mask; fully padded rows give exactly what eager gives. A comparison of segment ids is mapped per call from
each block's range of ids, joined with the causal mask's map.
"""
from __future__ import annotations

import math

from common import DEVICE, compare, qkv, size

import torch


def padded(q, k, v, keep):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    additive = (1.0 - keep[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(scores + additive, dim=-1) @ v


def documents(q, k, v, segments):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    same = segments[:, None, :, None] == segments[:, None, None, :]
    return torch.softmax(scores.masked_fill(~same, float("-inf")), dim=-1) @ v


def packed_causal(q, k, v, segments):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    same = segments[:, None, :, None] == segments[:, None, None, :]
    return torch.softmax(scores.masked_fill(~(same & causal), float("-inf")), dim=-1) @ v


if __name__ == "__main__":
    n = size(4096, 64)
    q, k, v = qkv(batch=4, heads=16, length=n, head_dim=64)
    lengths = torch.randint(n // 2, n + 1, (4,), device=DEVICE)
    keep = torch.arange(n, device=DEVICE)[None, :] < lengths[:, None]
    compare("padding mask", padded, torch.compile(padded, backend="fusepass"), q, k, v, keep, backward=True)
    segments = torch.sort(torch.randint(0, 8, (4, n), device=DEVICE), dim=-1).values
    compare("document mask", documents, torch.compile(documents, backend="fusepass"), q, k, v, segments,
            backward=True)
    compare("packed documents, causal", packed_causal, torch.compile(packed_causal, backend="fusepass"), q, k, v,
            segments, backward=True)
