"""On a GPU: the rewritten attention at the sizes models use, forward and backward, against float64."""
from __future__ import annotations

import math

import pytest
import torch
from support import check, rewrites

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="realistic sizes need the GPU")


def causal(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def window_alibi(q, k, v):
    n, h = q.shape[-2], q.shape[1]
    i = torch.arange(n, device=q.device)
    slopes = torch.pow(2.0, -8.0 * torch.arange(1, h + 1, device=q.device) / h)
    distance = i[:, None] - i[None, :]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) - slopes[:, None, None] * distance.abs()
    s = s.masked_fill((distance < 0) | (distance >= 512), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("fn", [causal, window_alibi])
@pytest.mark.parametrize("n, d", [(2048, 64), (4096, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_realistic_sizes(fn, n, d, dtype):
    q, k, v = (torch.randn(1, 4, n, d, device="cuda", dtype=dtype) for _ in range(3))
    report = check(fn, q, k, v, backward=True)
    assert len(rewrites(report, kind="attention", phase="forward")) == 1
