"""T5-style relative position bias: a learnable table gathered by bucketed key-query distance.

    python examples/t5_relative_bias.py

The bias depends on the key-query distance alone: fusepass gathers the table entry of each distance once per
call into a table the kernel reads, and in the backward sums the table's gradient per distance before adding
it to the table.
"""
from __future__ import annotations

import math

from common import DEVICE, compare, qkv, size

import torch
import torch.nn.functional as F


def bucket(relative: torch.Tensor, buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    half = buckets // 2
    result = (relative > 0).to(torch.long) * half
    distance = relative.abs()
    exact = half // 2
    large = exact + (torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (half - exact)).to(torch.long)
    return result + torch.where(distance < exact, distance, large.clamp(max=half - 1))


def t5_attention(q, k, v, table):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    bias = F.embedding(bucket(i[None, :] - i[:, None]), table).permute(2, 0, 1).unsqueeze(0)
    scores = q @ k.transpose(-1, -2) + bias
    return torch.softmax(scores.float(), dim=-1).type_as(scores) @ v


if __name__ == "__main__":
    q, k, v = qkv(batch=2, heads=16, length=size(4096, 64), head_dim=64)
    table = torch.randn(32, 16, device=DEVICE, dtype=q.dtype, requires_grad=True)
    compare("T5 relative bias (learnable table)", t5_attention, torch.compile(t5_attention, backend="fusepass"),
            q, k, v, table, backward=True)
