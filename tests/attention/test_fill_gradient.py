"""A mask's fill contributes a gradient function only where a gradient flows through it: a constant fill has
none (fill_grad=None, so the backward adds no zero tile per masked tile); an additive mask's fill (the scores
plus finfo.min) has one, and both match eager forward and backward."""
from __future__ import annotations

import pytest
import torch
from support import check, last_attention, random_tensor



SHAPE = (2, 3, 37, 24)


def causal_mask(n, device):
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def constant_fill(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.2
    s = torch.where(causal_mask(q.shape[-2], q.device), s, torch.finfo(s.dtype).min)
    return torch.softmax(s, dim=-1) @ v


def additive_mask(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.2
    s = s + torch.where(causal_mask(q.shape[-2], q.device), 0.0, torch.finfo(s.dtype).min)
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("fn, has_fill_grad", [(constant_fill, False), (additive_mask, True)])
def test_fill_gradient(fn, has_fill_grad):
    q, k, v = (random_tensor(SHAPE, torch.float32) for _ in range(3))
    check(fn, q, k, v, backward=True, rtol=1e-4, atol=1e-4)
    mod = last_attention().mod
    assert mod.has_mask
    assert (mod.fill_grad is not None) == has_fill_grad
