"""Values of another head dim than the queries and keys (multi-head latent attention: q·k over 192 = 128 + 64 rotary
dims, values 128 wide; or wider values than keys): each product at its operands' own width, nothing padded, forward
and backward."""
from __future__ import annotations

import math

import pytest
import torch
from attention.forms.common import B, H, check_declined, check_fused, random_tensor
from support import DEVICE, relative_error, rewrites

import fusepass

N = 37
FEATURES = ("value_head_dim",)


def latent_attention(q, k, v):
    """DeepSeek's eager attention: causal, the scale of the q·k head dim, values narrower."""
    scores = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5
    n = q.size(-2)
    scores = scores + torch.full((n, n), float("-inf"), device=q.device).triu(1)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def plain_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def grouped_latent_attention(q, k, v):
    """K and V heads shared by pairs of query heads (GQA), repeated as Llama repeats them."""
    group = q.size(1) // k.size(1)
    return latent_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def folded_heads(q, k, v):
    """bmm with the heads folded into the batch."""
    s = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)) * 0.25
    return torch.bmm(torch.softmax(s, dim=-1), v.flatten(0, 1)).view(*q.shape[:2], q.size(2), v.size(-1))


def einsum_attention(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), v)


def one_value_head(q, k, v):
    """One V head broadcast to K's heads: K and V laid out otherwise."""
    return plain_attention(q, k, v[:, :1])


DECLINED = one_value_head
DECLINED_REASON = "K and V have different head layouts"
SUMMARY = "values of another head dim than the queries and keys (multi-head latent attention), each at its own width"


def _qkv(qk_dim: int, v_dim: int, n: int = N, heads: int = H, kv_heads: int | None = None,
         dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    kv = kv_heads or heads
    shapes = ((B, heads, n, qk_dim), (B, kv, n, qk_dim), (B, kv, n, v_dim))
    return [random_tensor(shape, dtype) for shape in shapes]


@pytest.mark.parametrize("qk_dim, v_dim", [(192, 128), (96, 64), (64, 96)])
def test_causal_latent_attention(qk_dim, v_dim):
    check_fused(latent_attention, *_qkv(qk_dim, v_dim), expected=("causal", *FEATURES))


@pytest.mark.parametrize("qk_dim, v_dim", [(96, 64), (64, 96)])
def test_plain_at_a_length_of_no_whole_tiles(qk_dim, v_dim):
    check_fused(plain_attention, *_qkv(qk_dim, v_dim, n=70), expected=FEATURES)


def test_grouped_query_heads():
    check_fused(grouped_latent_attention, *_qkv(96, 64, heads=4, kv_heads=2), expected=("causal", "gqa", *FEATURES))


def test_heads_folded_into_a_bmm():
    check_fused(folded_heads, *_qkv(32, 16), expected=FEATURES)


def test_einsum():
    check_fused(einsum_attention, *_qkv(24, 16), expected=FEATURES)


def test_nothing_is_padded_and_the_op_reads_v_at_its_width():
    report = check_fused(latent_attention, *_qkv(96, 64), expected=("causal", *FEATURES))
    for phase in ("forward", "backward"):
        graph = report.graphs[phase].graph
        assert not graph.find_nodes(op="call_function", target=torch.ops.aten.constant_pad_nd.default)
        assert not graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)
    (op,) = report.graphs["forward"].graph.find_nodes(op="call_function", target=torch.ops.fusepass.attention.default)
    q, k, v = (arg.meta["val"] for arg in op.args[:3])
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (96, 96, 64)
    (forward,) = rewrites(report, kind="attention", phase="forward")
    assert forward.detail["shape"][-1] == 96 and forward.detail["head_dim_v"] == 64


def test_the_bytes_count_each_tensor_at_its_own_width():
    """Against the same attention with values as wide as the keys: V and the output (forward), and also dO and dV
    (backward), are a third narrower; Q, K, dQ and dK alike."""
    narrow, wide = (check_fused(latent_attention, *_qkv(96, v_dim), expected=expected)
                    for v_dim, expected in ((64, ("causal", *FEATURES)), (96, ("causal",))))
    for phase in ("forward", "backward"):
        (ours,), (theirs,) = (rewrites(report, kind="attention", phase=phase) for report in (narrow, wide))
        assert ours.bytes_ideal < theirs.bytes_ideal and ours.bytes_fused < theirs.bytes_fused
    (forward,), (wide_forward,) = (rewrites(report, kind="attention", phase="forward") for report in (narrow, wide))
    # V read once and the output written once, each 32 columns of fp32 narrower per row
    assert wide_forward.bytes_ideal - forward.bytes_ideal == 2 * B * H * N * 32 * 4


def test_a_second_call_at_another_length_keeps_every_gradient():
    compiled = torch.compile(latent_attention, backend=fusepass.backend(strict=True))
    fusepass.reset()
    for n in (N, 70):
        inputs = [x.requires_grad_() for x in _qkv(96, 64, n)]
        twins = [x.detach().clone().requires_grad_() for x in inputs]
        out, expected = compiled(*inputs), latent_attention(*twins)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        for x, twin in zip(inputs, twins):
            torch.testing.assert_close(x.grad, twin.grad, rtol=1e-4, atol=1e-4)
    assert rewrites(fusepass.last_report(), kind="attention")


def test_values_wider_than_the_kernels_take():
    check_declined(plain_attention, *_qkv(24, 272), reason="V's head dim 272 outside 16..256")


def test_declined_twin():
    check_declined(DECLINED, *_qkv(24, 16), reason=DECLINED_REASON)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="latent attention's sizes need the GPU")
def test_latent_attention_in_bfloat16_on_the_gpu():
    """DeepSeek's shape, B2 H4 N1000, (192, 128), causal: the output and every gradient no farther from float32 than
    twice eager bfloat16's distance (plus a rounding), and the attention rewritten."""
    torch.manual_seed(0)
    inputs = _qkv(192, 128, n=1000, heads=4, dtype=torch.bfloat16)
    grad = torch.randn(B, 4, 1000, 128, device=DEVICE, dtype=torch.bfloat16)

    def run(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.detach(), *(x.grad for x in leaves)]

    fusepass.reset()
    # SDPA off: the floor would run it in the kernels' place where it times faster
    fused = run(torch.compile(latent_attention, backend=fusepass.backend(strict=True, sdpa=False)), torch.bfloat16)
    eager, reference = run(latent_attention, torch.bfloat16), run(latent_attention, torch.float32)
    for name, ours, theirs, wide in zip(("out", "dq", "dk", "dv"), fused, eager, reference):
        mine, eagers = relative_error(ours, wide), relative_error(theirs, wide)
        assert mine <= 2 * eagers + torch.finfo(torch.bfloat16).eps, f"{name}: {mine:.2e} against eager's {eagers:.2e}"
    assert rewrites(fusepass.last_report(), kind="attention", phase="backward")
