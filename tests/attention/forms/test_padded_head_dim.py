"""Values of another head dim than the queries' and keys' (multi-head latent attention: q·k over 192 = 128 + 64
rotary dims, values 128 wide; or wider values than keys): fused with the narrower side padded by zeros
(attention/head_dims.py), forward and backward."""
from __future__ import annotations

import math

import torch
from attention.forms.common import B, H, check_declined, check_fused, random_tensor
from support import rewrites

import fusepass

N = 29
FEATURES = ("padded_head_dim",)


def latent_attention(q, k, v):
    """DeepSeek's eager attention: causal, the scale of the q·k head dim, values narrower."""
    scores = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5
    n = q.size(-2)
    scores = scores + torch.full((n, n), float("-inf"), device=q.device).triu(1)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def wide_values(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def folded_heads(q, k, v):
    """bmm with the heads folded into the batch."""
    s = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)) * 0.25
    return torch.bmm(torch.softmax(s, dim=-1), v.flatten(0, 1)).view(*q.shape[:2], q.size(2), v.size(-1))


def einsum_attention(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), v)


DECLINED = einsum_attention
DECLINED_REASON = "head dims differ: q 24, k 24, v 16"
SUMMARY = "values of another head dim than the queries and keys, the narrower side padded with zeros"


def _qkv(qk_dim: int, v_dim: int, n: int = N) -> list[torch.Tensor]:
    return [random_tensor((B, H, n, d), torch.float32) for d in (qk_dim, qk_dim, v_dim)]


def test_narrower_values_causal():
    check_fused(latent_attention, *_qkv(24, 16), expected=("causal", *FEATURES))


def test_wider_values():
    check_fused(wide_values, *_qkv(16, 40), expected=FEATURES)


def test_heads_folded_into_a_bmm():
    check_fused(folded_heads, *_qkv(32, 16), expected=FEATURES)


def test_a_second_call_at_another_length_keeps_every_gradient():
    compiled = torch.compile(latent_attention, backend=fusepass.backend(strict=True))
    fusepass.reset()
    for n in (N, 41):
        inputs = [x.requires_grad_() for x in _qkv(24, 16, n)]
        twins = [x.detach().clone().requires_grad_() for x in inputs]
        out, expected = compiled(*inputs), latent_attention(*twins)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        for x, twin in zip(inputs, twins):
            torch.testing.assert_close(x.grad, twin.grad, rtol=1e-4, atol=1e-4)
    assert rewrites(fusepass.last_report(), kind="attention")


def test_pads_come_out_again_where_the_attention_is_not_rewritten():
    """One V head broadcast to K's heads: declined after the pad went in, which comes out again."""
    q, k, _ = _qkv(24, 16)
    v = random_tensor((B, 1, N, 16), torch.float32)
    report = check_declined(wide_values, q, k, v, reason="K and V have different head layouts")
    graph = report.graphs["forward"].graph
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.constant_pad_nd.default)
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)


def test_declined_twin():
    check_declined(DECLINED, *_qkv(24, 16), reason=DECLINED_REASON)
