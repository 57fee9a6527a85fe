"""Hand-written attention under autocast (the mixed-precision training step): the matmuls take bf16 operands,
the softmax runs in fp32, and the rewrite computes what eager computes, forward and backward, at least as
close to float64 as eager is."""
from __future__ import annotations

import torch
from support import DEVICE, relative_error, random_tensor

import fusepass


def causal(q, k, v):
    n = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * 0.25
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).tril().logical_not(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _run(fn, inputs, grad):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, grad.to(out.dtype))


def test_attention_under_autocast_is_rewritten_and_matches_eager():
    fusepass.reset()
    inputs = [random_tensor((2, 3, 37, 16), torch.float32) for _ in range(3)]
    grad = torch.randn(2, 3, 37, 16, device=DEVICE)
    out, grads = _run(torch.compile(causal, backend=fusepass.backend(strict=True)), inputs, grad)
    eager, eager_grads = _run(causal, inputs, grad)
    wide = [x.detach().double().requires_grad_() for x in inputs]
    reference = causal(*wide)
    reference_grads = torch.autograd.grad(reference, wide, grad.double())
    assert out.dtype == eager.dtype == torch.bfloat16
    for ours, theirs, exact in zip((out, *grads), (eager, *eager_grads), (reference, *reference_grads)):
        assert ours.dtype == theirs.dtype
        assert relative_error(ours, exact) <= 2 * relative_error(theirs, exact) + 2e-3
    assert [r.kind for r in fusepass.last_report().rewrites] == ["attention", "attention"]
