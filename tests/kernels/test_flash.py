"""The flash-attention kernels and their block map against a float64 torch reference.

Each case pairs hand-written `@triton.jit` score functions (what the attention pass would generate) with
the same math in torch. Shapes are deliberately not multiples of the 16 × 16 interpreter tiles. Under
Triton's interpreter the cost is per program and per op, so batch × heads stays small.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import triton
import triton.language as tl

from fusepass.attention.blockmap import EMPTY, FULL, PARTIAL, block_map_for, build_block_map
from fusepass.attention.score_mod import ScoreMod
from fusepass.kernels.flash_bwd import flash_attention_backward
from fusepass.kernels.flash_fwd import flash_attention_forward

F32_MIN = float(torch.finfo(torch.float32).min)
WINDOW = 8


@pytest.fixture(autouse=True)
def _quiet_overflow():
    # The interpreter runs on numpy, which warns when (finfo.min - max) · log2(e) overflows to -inf.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)
        yield


# ---- score functions: aux[0] is always the softmax scale ---------------------------------------------------

@triton.jit
def scaled(s, b, h, q_idx, kv_idx, aux):
    return s * aux[0]


@triton.jit
def scaled_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    return ds * aux[0]


@triton.jit
def causal(b, h, q_idx, kv_idx, aux):
    return kv_idx <= q_idx


@triton.jit
def sliding_window(b, h, q_idx, kv_idx, aux):
    return (kv_idx <= q_idx) & (kv_idx > q_idx - WINDOW)


@triton.jit
def causal_left_padded(b, h, q_idx, kv_idx, aux):
    # aux = (scale, key_valid [B, Nk] int8, its batch stride)
    return (kv_idx <= q_idx) & (tl.load(aux[1] + b * aux[2] + kv_idx) != 0)


@triton.jit
def fill_neg_inf(s, b, h, q_idx, kv_idx, aux):
    return tl.full(s.shape, float("-inf"), tl.float32)


@triton.jit
def fill_f32_min(s, b, h, q_idx, kv_idx, aux):
    return tl.full(s.shape, F32_MIN, tl.float32)


@triton.jit
def constant_fill_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    return tl.zeros(ds.shape, tl.float32)


@triton.jit
def alibi(s, b, h, q_idx, kv_idx, aux):
    # aux = (scale, slopes [Hq] fp32)
    return s * aux[0] + tl.load(aux[1] + h) * (kv_idx - q_idx).to(tl.float32)


@triton.jit
def softcap(s, b, h, q_idx, kv_idx, aux):
    # aux = (scale, cap); tanh(x) = 2 sigmoid(2x) - 1
    return (2.0 * tl.sigmoid(2.0 * s * aux[0] / aux[1]) - 1.0) * aux[1]


@triton.jit
def softcap_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    t = 2.0 * tl.sigmoid(2.0 * s * aux[0] / aux[1]) - 1.0
    return ds * aux[0] * (1.0 - t * t)


@triton.jit
def dense_bias(s, b, h, q_idx, kv_idx, aux):
    # aux = (scale, bias [B, Hq, Nq, Nk], its four strides)
    scale, bias, stride_b, stride_h, stride_q, stride_k = aux
    return s * scale + tl.load(bias + b * stride_b + h * stride_h + q_idx * stride_q + kv_idx * stride_k)


@triton.jit
def dense_bias_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    scale, bias, stride_b, stride_h, stride_q, stride_k = aux
    if aux_grad is not None:  # the bias gradient has the bias's strides
        tl.atomic_add(aux_grad[0] + b * stride_b + h * stride_h + q_idx * stride_q + kv_idx * stride_k, ds)
    return ds * scale


# ---- cases: a ScoreMod, the same math in torch, and its aux inputs ----------------------------------------

@dataclass
class Shape:
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int


@dataclass
class Inputs:
    aux: tuple  # what the kernels get
    ref: dict  # float64 tensors and constants the torch reference reads
    aux_grad: tuple | None = None


@dataclass
class Index:
    """Broadcastable [B, H, Nq, Nk] positions for the torch reference."""
    b: torch.Tensor
    h: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor


@dataclass
class Case:
    mod: ScoreMod
    final_scores: Callable  # (s, Index, ref) -> final scores, float64
    make_inputs: Callable[[Shape], Inputs]


def scale_only(shape: Shape) -> Inputs:
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale,), ref=dict(scale=scale))


def left_padding(shape: Shape) -> Inputs:
    # Batch b's keys before pads[b] are padding, so (causal) its query rows before pads[b] keep no key.
    pads = torch.tensor([5, 20])[: shape.batch]
    key_valid = torch.arange(shape.kv_len)[None, :] >= pads[:, None]
    mask = key_valid.to(torch.int8)
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, mask, mask.stride(0)), ref=dict(scale=scale, key_valid=key_valid))


def alibi_slopes(shape: Shape) -> Inputs:
    slopes = 2.0 ** (-8.0 * torch.arange(1, shape.q_heads + 1) / shape.q_heads)
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, slopes), ref=dict(scale=scale, slopes=slopes.double()))


CAP = 5.0


def softcap_inputs(shape: Shape) -> Inputs:
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, CAP), ref=dict(scale=scale))


def learnable_bias(shape: Shape) -> Inputs:
    bias = torch.randn(shape.batch, shape.q_heads, shape.q_len, shape.kv_len)
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, bias, *bias.stride()), aux_grad=(torch.zeros_like(bias),),
                  ref=dict(scale=scale, bias=bias.double().requires_grad_()))


def masked(name, keep, fill, score=scaled, score_grad=scaled_grad, **flags) -> ScoreMod:
    fill_fn = fill_neg_inf if fill == -math.inf else fill_f32_min
    return ScoreMod(name, score, score_grad, keep=keep, fill=fill_fn, fill_grad=constant_fill_grad,
                    fill_bound=fill, **flags)


def where(keep, scores, fill):
    return torch.where(keep, scores, torch.tensor(fill, dtype=torch.float64))


def is_causal(i):
    return i.kv <= i.q


def in_window(i):
    return (i.kv <= i.q) & (i.kv > i.q - WINDOW)


def left_padded(i, r):
    return (i.kv <= i.q) & r["key_valid"][i.b, i.kv]


CASES = {
    "plain": Case(ScoreMod("t_plain", scaled, scaled_grad), lambda s, i, r: s * r["scale"], scale_only),
    "causal_inf": Case(masked("t_causal", causal, -math.inf),
                       lambda s, i, r: where(is_causal(i), s * r["scale"], -math.inf), scale_only),
    "causal_min": Case(masked("t_causal", causal, F32_MIN),
                       lambda s, i, r: where(is_causal(i), s * r["scale"], F32_MIN), scale_only),
    "window_min": Case(masked("t_window", sliding_window, F32_MIN),
                       lambda s, i, r: where(in_window(i), s * r["scale"], F32_MIN), scale_only),
    "alibi_causal": Case(masked("t_alibi", causal, -math.inf, score=alibi),
                         lambda s, i, r: where(is_causal(i), s * r["scale"] + r["slopes"][i.h] * (i.kv - i.q),
                                               -math.inf),
                         alibi_slopes),
    "softcap": Case(ScoreMod("t_softcap", softcap, softcap_grad),
                    lambda s, i, r: torch.tanh(s * r["scale"] / CAP) * CAP, softcap_inputs),
    "bias_grad": Case(ScoreMod("t_bias", dense_bias, dense_bias_grad, has_aux_grad=True),
                      lambda s, i, r: s * r["scale"] + r["bias"], learnable_bias),
    "left_pad_min": Case(masked("t_left_pad", causal_left_padded, F32_MIN, keep_uses_batch=True,
                                keep_reads_aux=True),
                         lambda s, i, r: where(left_padded(i, r), s * r["scale"], F32_MIN), left_padding),
    "left_pad_inf": Case(masked("t_left_pad", causal_left_padded, -math.inf, keep_uses_batch=True,
                                keep_reads_aux=True),
                         lambda s, i, r: where(left_padded(i, r), s * r["scale"], -math.inf), left_padding),
}


# ---- reference and helpers ---------------------------------------------------------------------------------

def make_qkv(shape: Shape, dtype: torch.dtype, layout: str = "bhnd"):
    """q, k, v, do; layout "bnhd" gives [B, H, N, D] views of [B, N, H, D] storage."""
    def make(heads, length):
        if layout == "bnhd":
            return torch.randn(shape.batch, length, heads, shape.head_dim).to(dtype).transpose(1, 2)
        return torch.randn(shape.batch, heads, length, shape.head_dim).to(dtype)
    return (make(shape.q_heads, shape.q_len), make(shape.kv_heads, shape.kv_len),
            make(shape.kv_heads, shape.kv_len), make(shape.q_heads, shape.q_len))


def positions(batch, heads, q_len, kv_len) -> Index:
    return Index(torch.arange(batch).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1),
                 torch.arange(q_len).view(-1, 1), torch.arange(kv_len).view(1, -1))


def reference(case: Case, ref: dict, q, k, v, do, dropout_kept=None, dropout_p=0.0) -> dict:
    """Eager attention in float64: out, lse, dq, dk, dv (dk / dv summed over each kv head's query heads)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    idx = positions(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    final = case.final_scores(q @ k_rep.transpose(-1, -2), idx, ref)
    weights = torch.softmax(final, -1)
    if dropout_kept is not None:
        weights = weights * dropout_kept / (1.0 - dropout_p)
    out = weights @ v_rep
    out.backward(do.double())
    return dict(out=out, lse=torch.logsumexp(final, -1), dq=q.grad, dk=k.grad, dv=v.grad)


def run_flash(case: Case, inputs: Inputs, q, k, v, do, **dropout) -> dict:
    out, lse, extra = flash_attention_forward(q, k, v, case.mod, inputs.aux, out_dtype=q.dtype, **dropout)
    dq, dk, dv = flash_attention_backward(do, q, k, v, out, lse, extra, case.mod, inputs.aux, inputs.aux_grad,
                                          **dropout)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, extra=extra)


def assert_matches(got: dict, expected: dict, dtype: torch.dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(got[name].double(), expected[name].detach(), rtol=tol, atol=tol,
                                   equal_nan=True, msg=lambda m: f"{name}: {m}")


# ---- forward and backward against the reference ------------------------------------------------------------

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

MATRIX = [
    # case, dtype, shape (B, Hq, Hkv, Nq, Nk, D), layout
    ("plain", f32, Shape(1, 4, 2, 37, 53, 24), "bhnd"),  # GQA, cross attention
    ("plain", bf16, Shape(1, 2, 1, 37, 29, 100), "bnhd"),  # MQA, head dim padded to 128, strided views
    ("causal_inf", f32, Shape(1, 2, 2, 45, 45, 80), "bnhd"),
    ("causal_min", f16, Shape(1, 4, 2, 37, 53, 24), "bhnd"),
    ("window_min", f32, Shape(1, 2, 1, 53, 53, 24), "bhnd"),
    ("alibi_causal", bf16, Shape(1, 4, 2, 37, 37, 24), "bhnd"),
    ("softcap", f32, Shape(1, 2, 2, 37, 53, 24), "bhnd"),
    ("bias_grad", f32, Shape(2, 2, 1, 37, 53, 24), "bhnd"),
    ("left_pad_min", f32, Shape(2, 2, 1, 37, 37, 24), "bhnd"),
    ("left_pad_inf", f32, Shape(2, 2, 1, 37, 37, 24), "bhnd"),
]


@pytest.mark.parametrize("name, dtype, shape, layout", MATRIX,
                         ids=[f"{m[0]}-{str(m[1])[6:]}-D{m[2].head_dim}" for m in MATRIX])
def test_matches_reference(name, dtype, shape, layout):
    torch.manual_seed(0)
    case = CASES[name]
    inputs = case.make_inputs(shape)
    q, k, v, do = make_qkv(shape, dtype, layout)
    got = run_flash(case, inputs, q, k, v, do)
    expected = reference(case, inputs.ref, q, k, v, do)
    assert_matches(got, expected, dtype)
    if case.mod.has_aux_grad:
        torch.testing.assert_close(inputs.aux_grad[0].double(), inputs.ref["bias"].grad, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows():
    """Rows keeping no key: finfo.min fills average V uniformly (as eager), -inf fills give NaN; the forward
    flags exactly those rows for the all-tiles fallback."""
    torch.manual_seed(0)
    shape = Shape(2, 2, 1, 37, 37, 24)
    q, k, v, do = make_qkv(shape, f32)
    inputs = left_padding(shape)
    fully_masked = ~inputs.ref["key_valid"][:, None, :shape.q_len].expand(-1, shape.q_heads, -1)

    got_min = run_flash(CASES["left_pad_min"], inputs, q, k, v, do)
    uniform = v.mean(2, keepdim=True).repeat_interleave(2, 1).expand(-1, -1, shape.q_len, -1)
    torch.testing.assert_close(got_min["out"][fully_masked], uniform[fully_masked], rtol=1e-5, atol=1e-6)
    assert torch.equal(got_min["extra"].fallback_rows.bool(), fully_masked)

    got_inf = run_flash(CASES["left_pad_inf"], inputs, q, k, v, do)
    assert torch.equal(got_inf["out"].isnan().all(-1), fully_masked)
    assert not got_inf["out"][~fully_masked].isnan().any()
