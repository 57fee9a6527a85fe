"""Every parameter gets its gradient, and eager's, on every call: after a recompile at another length, under
``dynamic=True``, with Q, K and V taken from one projection by ``split``, ``chunk`` or ``unbind``."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from support import DEVICE, random_tensor, rewrites

import fusepass
from fusepass.capture import carries_gradient

C, HEADS, MAX_T = 32, 2, 48


class NanoGPTBlock(nn.Module):
    """nanoGPT's attention block as it is written: ``c_attn(x).split``, a registered ``tril`` buffer."""

    def __init__(self, take: str = "split") -> None:
        super().__init__()
        self.ln = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.take = take
        self.register_buffer("bias", torch.tril(torch.ones(MAX_T, MAX_T)).view(1, 1, MAX_T, MAX_T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.c_attn(self.ln(x))
        if self.take == "split":
            q, k, v = qkv.split(C, dim=2)
        elif self.take == "chunk":
            q, k, v = qkv.chunk(3, dim=-1)
        else:
            q, k, v = qkv.view(B, T, 3, C).unbind(2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _gradients_match(compiled: nn.Module, eager: nn.Module, T: int) -> None:
    x = torch.randn(2, T, C, device=DEVICE)
    for model in (compiled, eager):
        model.zero_grad(set_to_none=True)
    out = compiled(x)
    expected = eager(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for (name, p), (_, e) in zip(compiled.named_parameters(), eager.named_parameters()):
        assert p.grad is not None, f"{name} got no gradient at T={T}"
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-4, atol=1e-4, msg=f"{name} at T={T}")


@pytest.mark.parametrize("take", ["split", "chunk", "unbind"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_every_parameter_learns_across_lengths(take, dynamic):
    torch.manual_seed(0)
    fused = NanoGPTBlock(take).to(DEVICE)
    eager = NanoGPTBlock(take).to(DEVICE)
    eager.load_state_dict(fused.state_dict())
    fusepass.reset()
    compiled = torch.compile(fused, backend="fusepass", dynamic=dynamic)
    for T in (32, 24, 40):  # the second length recompiles with symbolic sizes
        _gradients_match(compiled, eager, T)
    for report in fusepass.reports():
        assert rewrites(report, "attention", "forward") and rewrites(report, "attention", "backward"), report
        assert not [h for h in report.hotspots if h.kind in ("attention", "fallback")], report


def test_a_list_of_float_tensors_carries_a_gradient():
    x = torch.empty(4, 6)
    assert carries_gradient(list(x.split(2, dim=1)))
    assert carries_gradient((x[0], torch.arange(3)))
    assert not carries_gradient([torch.arange(3), torch.zeros(2, dtype=torch.bool)])
    assert not carries_gradient(torch.arange(3))
    assert carries_gradient(None)  # unknown: a gradient may flow


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_tensor_the_score_chain_only_compares_gets_no_gradient(dynamic):
    """A float mask that requires a gradient but enters the scores through a comparison: eager gives it none (None,
    which an optimizer skips), and so does the fused attention, not a zero tensor; under symbolic sizes too, at
    each length."""
    def attention(q, k, v, causal):
        scores = (q @ k.transpose(-2, -1)).masked_fill(causal == 0, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    fusepass.reset()
    compiled = torch.compile(attention, backend=fusepass.backend(strict=True), dynamic=dynamic)
    for n in (23, 29):
        q, k, v = (random_tensor((2, 2, n, 16), torch.float32).requires_grad_() for _ in range(3))
        causal = torch.tril(torch.ones(n, n, device=DEVICE)).requires_grad_()
        out = compiled(q, k, v, causal)
        out.sum().backward()
        assert causal.grad is None and all(x.grad is not None for x in (q, k, v)), n
    assert all(rewrites(report, "attention", "backward") for report in fusepass.reports())
