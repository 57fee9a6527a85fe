"""The backward's row term in half precision: delta = dO · O from the output as the forward computed it (its rounded
value and the residual rounding left out), with the weights as the backward recomputes them (the forward's rounded
ones: whole-power-of-two shifts, l summed from them), so that each row's score gradients sum to zero as eager's do. Taken from
the rounded output alone, they sum to dO · (O - round(O)): what adds them all up shows it (a key projection's bias
gradient, 0 in float64), and so do rows whose weight is nearly all on one key (the others' share of O rounded
away: tests/attention/test_random_attention.py's examples)."""
from __future__ import annotations

import pytest
import torch
from support import check, last_attention

B, T, H, D = 2, 37, 4, 16


def key_bias_attention(x, wq, wk, bk, wv):  # BERT: a key projection with a bias
    q, k, v = ((x @ w + b).view(B, T, H, D).transpose(1, 2) for w, b in ((wq, 0), (wk, bk), (wv, 0)))
    return (torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5, -1) @ v).transpose(1, 2).reshape(B, T, H * D)


def gradients(fn, inputs, dtype, grad):
    inputs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    return torch.autograd.grad(fn(*inputs), inputs, grad.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_key_bias_gradient_is_as_near_zero_as_eagers(dtype):
    inputs = [torch.randn(B, T, H * D)] + [torch.randn(H * D, H * D) * 0.2 for _ in range(2)] + \
        [torch.randn(H * D), torch.randn(H * D, H * D) * 0.2]
    inputs = [x.to(last_device()) for x in inputs]
    grad = torch.randn(B, T, H * D, device=inputs[0].device)
    wide = gradients(key_bias_attention, inputs, torch.float64, grad)
    eager = gradients(key_bias_attention, inputs, dtype, grad)
    fused = gradients(torch.compile(key_bias_attention, backend="fusepass"), inputs, dtype, grad)
    assert last_attention().keeps_residual()
    scale = max(g.norm() for g in wide)  # the key bias's own is a rounding
    ours, eagers = ((g[3].double() - wide[3]).norm() / scale for g in (fused, eager))
    # With the forward's weights but without the residual: 1.2-1.7x eager's in fp16, 1.8-2.6x in bf16; with the
    # residual but weights the backward does not recompute exactly: 1.9-2.0x in bf16 (BERT's two tiny layers: 7x).
    # With both, 0.68-1.00x (three draws of each dtype).
    assert ours <= 1.25 * eagers, (ours, eagers)


def last_device() -> str:
    from support import DEVICE

    return DEVICE
