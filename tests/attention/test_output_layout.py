"""The attention's output laid out for its reader: read only with heads and positions swapped (the
``.transpose(1, 2).contiguous()`` before an output projection), it is written [B, N, H, D], so that neither the
forward's copy nor its gradient's in the backward remains. Read otherwise, it is laid out as the matmul lays it."""
from __future__ import annotations

import math

import pytest
import torch
from support import check, fused_kernel_count, random_tensor, rewrites

B, H, T, D = 2, 3, 19, 16


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1) @ v


def transposed(q, k, v):  # nanoGPT, T5, Llama
    return attention(q, k, v).transpose(1, 2).contiguous().view(B, T, H * D)


def permuted(q, k, v):  # BERT
    return attention(q, k, v).permute(0, 2, 1, 3).contiguous().view(B, T, H * D)


def reshaped(q, k, v):  # timm's ViT
    return attention(q, k, v).transpose(1, 2).reshape(B, T, H * D)


def read_twice(q, k, v):
    y = attention(q, k, v)
    return y.transpose(1, 2).reshape(B, T, H * D) * y.sum()


def heads_merged(q, k, v):  # a view that needs the matmul's own layout
    return attention(q, k, v).view(B * H, T, D).sum(0)


def copies(report, phase: str) -> list[str]:
    return [str(n.target) for n in report.graphs[phase].graph.nodes
            if n.op == "call_function" and "clone" in str(n.target)]


@pytest.mark.parametrize("fn", [transposed, permuted, reshaped], ids=lambda f: f.__name__)
def test_an_output_read_with_heads_and_positions_swapped_is_written_so(fn):
    report = check(fn, *(random_tensor((B, H, T, D), torch.float32) for _ in range(3)), backward=True)
    assert rewrites(report, "attention", "forward") and rewrites(report, "attention", "backward")
    for phase in ("forward", "backward"):
        assert not copies(report, phase) and not fused_kernel_count(report, phase), phase


@pytest.mark.parametrize("fn", [read_twice, heads_merged], ids=lambda f: f.__name__)
def test_an_output_read_otherwise_keeps_the_matmuls_layout(fn):
    report = check(fn, *(random_tensor((B, H, T, D), torch.float32) for _ in range(3)), backward=True)
    (op,) = [n for n in report.graphs["forward"].graph.nodes if "fusepass.attention" in str(n.target)]
    assert op.meta["val"][0].is_contiguous()


def bmm_merged(q, k, v):  # BLOOM: heads folded into the batch for bmm, merged back through a view
    q, k, v = (t.transpose(1, 2).reshape(B * H, T, D) for t in (q, k, v))  # q, k, v: [B, T, H, D]
    y = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D), dim=-1), v)
    return y.view(B, H, T, D).permute(0, 2, 1, 3).reshape(B, T, H * D)


def test_bmms_output_viewed_back_to_heads_is_written_by_position_too():
    report = check(bmm_merged, *(random_tensor((B, T, H, D), torch.float32) for _ in range(3)), backward=True)
    assert rewrites(report, "attention", "backward")
    for phase in ("forward", "backward"):
        assert not copies(report, phase) and not fused_kernel_count(report, phase), phase
