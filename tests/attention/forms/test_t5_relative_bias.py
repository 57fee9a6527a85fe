"""T5's relative position bias: the distance j - i put in log-spaced buckets (exact below half of a side's
buckets), each bucket a learned per-head bias (an nn.Embedding), added to the unscaled scores. A term of the
distance alone that costs a log, casts and a gather per score: evaluated once per distance into a table the
kernel reads, whose gradient is summed per distance before it reaches the embedding. Self- and cross-attention."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention.forms.common import H, check_declined, check_fused, qkv, random_tensor
from support import SUMMED_GRADIENT_FP32

BUCKETS, MAX_DISTANCE = 16, 32


def relative_position_bucket(relative, buckets=BUCKETS, max_distance=MAX_DISTANCE, hf=False):
    """transformers' T5Attention._relative_position_bucket (bidirectional), its torch.min(x, full_like(x, c))
    written as a clamp (`hf`: as transformers writes it)."""
    buckets //= 2
    bucket = (relative > 0).to(torch.long) * buckets  # keys after the query use the upper half
    relative = torch.abs(relative)
    exact = buckets // 2
    is_small = relative < exact
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact)
                     * (buckets - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, buckets - 1)) if hf else large.clamp(max=buckets - 1)
    return bucket + torch.where(is_small, relative, large)


def t5_attention(q, k, v, table, hf=False):
    context = torch.arange(q.size(-2), device=q.device)[:, None]
    memory = torch.arange(k.size(-2), device=q.device)[None, :]
    buckets = relative_position_bucket(memory - context, hf=hf)
    position_bias = F.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)  # [1, H, Nq, Nk]
    scores = torch.matmul(q, k.transpose(3, 2)) + position_bias  # T5 does not scale the scores
    return F.softmax(scores.float(), dim=-1).type_as(scores) @ v


FEATURES = ("distance_table", "relative_bias")


def contextual_positions(q, k, v, position_logits_weight):
    """CoPE (Golovneva et al.): a key's position counted by the gates sigmoid(score) of the keys between it and
    the query (a reversed cumsum over the row), interpolated between learned position logits."""
    n = q.size(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    gates = torch.sigmoid(scores).masked_fill(~causal, 0.0)
    positions = gates.flip(-1).cumsum(dim=-1).flip(-1).clamp(max=position_logits_weight.size(-1) - 1)
    floor, ceil = positions.floor().long(), positions.ceil().long()
    logits = q @ position_logits_weight
    weight = positions - floor
    scores = scores + logits.gather(-1, ceil) * weight + logits.gather(-1, floor) * (1 - weight)
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


DECLINED = contextual_positions
DECLINED_REASON = "the score chain has aten.flip, which has no per-tile form"
SUMMARY = "T5's log-bucketed relative positions gathered from a learned table"


def table():
    return random_tensor((BUCKETS, H), torch.float32)  # nn.Embedding(BUCKETS, H).weight


@pytest.mark.parametrize("nk", [None, 31], ids=["self", "cross"])
def test_t5_relative_bias(nk):
    check_fused(t5_attention, *qkv(23, nk=nk), table(), expected=FEATURES + (("cross",) if nk else ()),
                **SUMMED_GRADIENT_FP32)  # the table learns


def test_transformers_torch_min_buckets():
    check_fused(lambda q, k, v, table: t5_attention(q, k, v, table, hf=True), *qkv(13), table(), expected=FEATURES,
                **SUMMED_GRADIENT_FP32)


def test_declined_twin():
    check_declined(DECLINED, *qkv(23), random_tensor((16, 8), torch.float32), reason=DECLINED_REASON)
