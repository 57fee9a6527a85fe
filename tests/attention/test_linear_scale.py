"""Scores that are the raw products times a positive constant declare it (ScoreMod.linear_scale), so the
forward's full tiles fold it into the exponent; any other score chain declares none."""
from __future__ import annotations

import math

import pytest
import torch
from support import check, last_attention, random_tensor



SHAPE = (2, 3, 37, 24)


def scaled(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def scaled_in_half_then_widened(q, k, v):
    return torch.softmax((q @ k.transpose(-1, -2) * 0.125).float(), dim=-1).to(q.dtype) @ v


def negative_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * -0.5, dim=-1) @ v


def softcap(q, k, v):
    return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) / 20.0) * 20.0, dim=-1) @ v


def biased(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.125 + 1.0, dim=-1) @ v


@pytest.mark.parametrize("fn, dtype, scale", [
    (scaled, torch.float32, float(torch.tensor(1.0) / math.sqrt(24))),  # the reciprocal the code multiplies by
    (scaled_in_half_then_widened, torch.bfloat16, 0.125),
    (negative_scale, torch.float32, None),
    (softcap, torch.float32, None),
    (biased, torch.float32, None),
])
def test_linear_scale(fn, dtype, scale):
    q, k, v = (random_tensor(SHAPE, dtype) for _ in range(3))
    check(fn, q, k, v, backward=True, **({} if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)))
    assert last_attention().mod.linear_scale == scale
