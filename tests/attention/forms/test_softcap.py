"""Logit soft-capping (Gemma 2, Grok-1): the scores squashed smoothly into (-cap, cap) by cap · tanh(s / cap)
before the causal mask and the softmax. The tanh and its derivative are computed per score in the kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention.forms.common import check_declined, check_fused, qkv
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.attention.lift import emit
from fusepass.codegen.operands import Operand
from fusepass.codegen.translate import translate

aten = torch.ops.aten

N = 23


def gemma2_softcap(q, k, v, softcap=20.0):
    i = torch.arange(q.size(-2), device=q.device)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5
    scores = scores / softcap
    scores = torch.tanh(scores)
    scores = scores * softcap
    scores = scores.masked_fill(i[None, :] > i[:, None], torch.finfo(scores.dtype).min)
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def grok_softcap(q, k, v, cap=30.0):
    n = q.size(-2)
    scores = cap * torch.tanh(q @ k.transpose(-1, -2) / cap)  # Grok-1 leaves the scores unscaled
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(torch.where(causal, scores, float("-inf")), dim=-1) @ v


FEATURES = ("causal", "softcap")


def capped_relative_to_the_row_max(q, k, v, softcap=20.0):
    """The capped scores divided by their row's largest magnitude: a reduction over all keys of a row."""
    i = torch.arange(q.size(-2), device=q.device)
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * q.size(-1) ** -0.5 / softcap)
    scores = scores / scores.abs().amax(dim=-1, keepdim=True)
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


DECLINED = capped_relative_to_the_row_max
DECLINED_REASON = "the score chain has aten.amax, which has no per-tile form"
SUMMARY = "cap · tanh(s / cap) on the scores (Gemma 2, Grok-1)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [gemma2_softcap, grok_softcap])
def test_softcap(form, dtype):
    # bfloat16: the kernels' tanh is the GPU's one-instruction form there (the next test); scores of up to ~36
    # against caps of 20 and 30 put many of them where tanh saturates, where its derivative is small
    check_fused(form, *[x.to(dtype) for x in qkv(N)], expected=FEATURES)


def test_the_hardware_tanh_serves_only_values_eager_rounds_to_bfloat16():
    """A bfloat16 chain's tanh, rounded by eager to 8 bits (2^-9 of it), kept unrounded in float32 by the kernel
    (the scores: round_halves=False) and used by continuous arithmetic alone takes PTX's tanh.approx (2^-10.9); where
    the kernel rounds as eager does, a comparison sees it, or the chain is float32 or float16, the accurate form."""
    def emitted(dtype, round_halves, continuous_uses):
        return translate(aten.tanh.default, (Operand("x", dtype),), {}, dtype, round_halves=round_halves,
                         continuous_uses=continuous_uses).expr

    assert "tanh_within_bfloat16" in emitted(torch.bfloat16, False, True)
    assert "tanh_within_bfloat16" not in emitted(torch.bfloat16, True, True)
    assert "tanh_within_bfloat16" not in emitted(torch.bfloat16, False, False)
    assert "tanh_within_bfloat16" not in emitted(torch.float32, False, True)
    assert "tanh_within_bfloat16" not in emitted(torch.float16, False, True)


def test_a_tanh_a_comparison_sees_keeps_the_accurate_form():
    """Rounded to bf16 for a comparison, the hardware tanh could fall on the other side of a rounding boundary than
    eager's and flip the comparison: a score chain's tanh that reaches one (here through a product) is not a value
    the output depends on continuously."""
    def scores(s):
        t = torch.tanh(s / 20.0) * 20.0
        return torch.where(t * 2.0 > 10.0, t, -t)

    def capped(s):
        return torch.tanh(s / 20.0) * 20.0

    for fn, continuous in ((scores, False), (capped, True)):
        graph = make_fx(fn)(torch.randn(4, dtype=torch.bfloat16))
        tanh = next(n for n in graph.graph.nodes if n.target == aten.tanh.default)
        assert (tanh in emit._continuous_uses(graph)) == continuous, fn.__name__


def test_declined_twin():
    check_declined(DECLINED, *qkv(N), reason=DECLINED_REASON)
