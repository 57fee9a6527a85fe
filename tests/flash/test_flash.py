"""The flash-attention kernels and their block map against a float64 torch reference.

Each case pairs hand-written `@triton.jit` score functions (what the attention pass would generate) with
the same math in torch. Shapes are deliberately not multiples of the 16 × 16 interpreter tiles. Under
Triton's interpreter the cost is per program and per op, so batch × heads stays small. With a GPU present
the same tests run the compiled kernels (at the GPU tile sizes).
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from support import record_block_map_builds

from fusepass.flash import blockmap
from fusepass.flash.blockmap import (
    EMPTY, FULL, PARTIAL, BlockMap, block_map_for, build_block_map, map_shapes, packed_map_numel)
from fusepass.flash.score_mod import ScoreMod
from fusepass.flash import backward as flash_bwd, forward as flash_fwd
from fusepass.flash.backward import flash_attention_backward
from fusepass.flash.config import (
    INTERPRETER_CONFIG, SHORT_ROWS, BackwardConfigs, FlashConfig, narrow_kv_tiles)
from fusepass.flash.forward import flash_attention_forward, has_partial_tiles
from fusepass.flash.tiles import tile_operands

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32_MIN = float(torch.finfo(torch.float32).min)
# Constants the score functions read (jit functions see only tl.constexpr globals).
F32_MIN_FILL = tl.constexpr(F32_MIN)
WINDOW = tl.constexpr(8)
PENALTY = tl.constexpr(2.0)


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
def quarter(s, b, h, q_idx, kv_idx, aux):
    return s * 0.25


@triton.jit
def quarter_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    return ds * 0.25


HUGE = 2.0 ** 120


@triton.jit
def huge(s, b, h, q_idx, kv_idx, aux):
    return s * 1.329227995784916e36  # HUGE


@triton.jit
def huge_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    return ds * 1.329227995784916e36


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
def key_padded(b, h, q_idx, kv_idx, aux):
    # A mask of the keys alone: KEEP's result is one row, [1, BLOCK_N], broadcast over the tile's rows.
    return tl.load(aux[1] + b * aux[2] + kv_idx) != 0


@triton.jit
def fill_neg_inf(s, b, h, q_idx, kv_idx, aux):
    return tl.full(s.shape, float("-inf"), tl.float32)


@triton.jit
def fill_f32_min(s, b, h, q_idx, kv_idx, aux):
    return tl.full(s.shape, F32_MIN_FILL, tl.float32)


@triton.jit
def constant_fill_grad(s, ds, b, h, q_idx, kv_idx, aux, aux_grad):
    return tl.zeros(ds.shape, tl.float32)


@triton.jit
def penalised(s, b, h, q_idx, kv_idx, aux):
    # A soft mask: masked-out scores are lowered, not removed (FILL reads s, so it has a gradient).
    return s * aux[0] - PENALTY


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
    head_dim_v: int | None = None  # V's, where it differs from Q's and K's (multi-head latent attention)

    @property
    def value_dim(self) -> int:
        return self.head_dim_v or self.head_dim


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
    key_valid = (torch.arange(shape.kv_len)[None, :] >= pads[:, None]).to(DEVICE)
    mask = key_valid.to(torch.int8)
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, mask, mask.stride(0)), ref=dict(scale=scale, key_valid=key_valid))


def alibi_slopes(shape: Shape) -> Inputs:
    slopes = 2.0 ** (-8.0 * torch.arange(1, shape.q_heads + 1, device=DEVICE) / shape.q_heads)
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, slopes), ref=dict(scale=scale, slopes=slopes.double()))


CAP = 5.0


def softcap_inputs(shape: Shape) -> Inputs:
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, CAP), ref=dict(scale=scale))


def learnable_bias(shape: Shape) -> Inputs:
    bias = torch.randn(shape.batch, shape.q_heads, shape.q_len, shape.kv_len).to(DEVICE)
    scale = shape.head_dim ** -0.5
    return Inputs(aux=(scale, bias, *bias.stride()), aux_grad=(torch.zeros_like(bias),),
                  ref=dict(scale=scale, bias=bias.double().requires_grad_()))


def masked(name, keep, fill, score=scaled, score_grad=scaled_grad, **flags) -> ScoreMod:
    fill_fn = fill_neg_inf if fill == -math.inf else fill_f32_min
    return ScoreMod(name, score, score_grad, keep=keep, fill=fill_fn, fill_grad=constant_fill_grad,
                    fill_bound=fill, **flags)


# A fill with no upper bound: no tile may be skipped, every row takes the all-tiles fallback.
SOFT_CAUSAL = ScoreMod("t_causal", scaled, scaled_grad, keep=causal, fill=penalised, fill_grad=scaled_grad,
                       fill_bound=math.inf)


def where(keep, scores, fill):
    return torch.where(keep, scores, torch.tensor(fill, dtype=torch.float64))


def is_causal(i):
    return i.kv <= i.q


def in_window(i):
    return (i.kv <= i.q) & (i.kv > i.q - WINDOW.value)


def left_padded(i, r):
    return (i.kv <= i.q) & r["key_valid"][i.b, i.kv]


CASES = {
    "plain": Case(ScoreMod("t_plain", scaled, scaled_grad), lambda s, i, r: s * r["scale"], scale_only),
    "causal_inf": Case(masked("t_causal", causal, -math.inf),
                       lambda s, i, r: where(is_causal(i), s * r["scale"], -math.inf), scale_only),
    "causal_min": Case(masked("t_causal", causal, F32_MIN),
                       lambda s, i, r: where(is_causal(i), s * r["scale"], F32_MIN), scale_only),
    # SCORE(s) = s / 4, declared: full tiles fold the scale into the exponent.
    "plain_linear": Case(ScoreMod("t_plain_linear", quarter, quarter_grad, linear_scale=0.25),
                         lambda s, i, r: s * 0.25, scale_only),
    "causal_linear": Case(masked("t_causal_linear", causal, F32_MIN, score=quarter, score_grad=quarter_grad,
                                 linear_scale=0.25),
                          lambda s, i, r: where(is_causal(i), s * 0.25, F32_MIN), scale_only),
    "causal_soft": Case(SOFT_CAUSAL,
                        lambda s, i, r: torch.where(is_causal(i), s * r["scale"], s * r["scale"] - PENALTY.value),
                        scale_only),
    # keep_uses_head gives the map a head axis (the window is the same for every head): exercises its indexing.
    "window_min": Case(masked("t_window", sliding_window, F32_MIN, keep_uses_head=True),
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
    "key_pad_min": Case(masked("t_key_pad", key_padded, F32_MIN, keep_uses_batch=True, keep_reads_aux=True),
                        lambda s, i, r: where(r["key_valid"][i.b, i.kv], s * r["scale"], F32_MIN), left_padding),
}


# ---- reference and helpers ---------------------------------------------------------------------------------

def make_qkv(shape: Shape, dtype: torch.dtype, layout: str = "bhnd"):
    """q, k, v, do; layout "bnhd" gives [B, H, N, D] views of [B, N, H, D] storage."""
    def make(heads, length, head_dim):
        if layout == "bnhd":
            return torch.randn(shape.batch, length, heads, head_dim).to(DEVICE, dtype).transpose(1, 2)
        return torch.randn(shape.batch, heads, length, head_dim).to(DEVICE, dtype)
    return (make(shape.q_heads, shape.q_len, shape.head_dim), make(shape.kv_heads, shape.kv_len, shape.head_dim),
            make(shape.kv_heads, shape.kv_len, shape.value_dim), make(shape.q_heads, shape.q_len, shape.value_dim))


def positions(batch, heads, q_len, kv_len) -> Index:
    def arange(n, *view):
        return torch.arange(n, device=DEVICE).view(*view)
    return Index(arange(batch, -1, 1, 1, 1), arange(heads, 1, -1, 1, 1), arange(q_len, -1, 1), arange(kv_len, 1, -1))


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


def run_flash(case: Case, inputs: Inputs, q, k, v, do, forward_map=None, **dropout) -> dict:
    out, lse, extra = flash_attention_forward(q, k, v, case.mod, inputs.aux, block_map=forward_map,
                                              out_dtype=q.dtype, **dropout)
    dq, dk, dv = flash_attention_backward(do, q, k, v, out, lse, extra, case.mod, inputs.aux, inputs.aux_grad,
                                          **dropout)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, extra=extra)


TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # relative and absolute


def assert_matches(got: dict, expected: dict, dtype: torch.dtype):
    tol = TOLERANCE[dtype]
    for name in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(got[name].double(), expected[name].detach(), rtol=tol, atol=tol,
                                   equal_nan=True, msg=lambda m: f"{name}: {m}")


# ---- forward and backward against the reference ------------------------------------------------------------

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

MATRIX = [
    # case, dtype, shape (B, Hq, Hkv, Nq, Nk, D), layout
    ("plain", f32, Shape(1, 4, 2, 37, 53, 24), "bhnd"),  # GQA, cross attention
    # MQA, head dim padded to 128, strided views; rows of 200 bytes take pointer loads (no tensor descriptors)
    ("plain", bf16, Shape(1, 2, 1, 37, 29, 100), "bnhd"),
    ("causal_inf", f32, Shape(1, 2, 2, 45, 45, 80), "bnhd"),
    ("causal_min", f16, Shape(1, 4, 2, 37, 53, 24), "bhnd"),
    ("causal_min", f32, Shape(1, 2, 2, 5, 20, 16), "bhnd"),  # fewer queries than one tile, smallest head dim
    ("causal_soft", f32, Shape(1, 2, 1, 37, 53, 24), "bhnd"),
    ("plain_linear", f32, Shape(1, 2, 1, 37, 53, 24), "bhnd"),
    ("causal_linear", bf16, Shape(1, 2, 2, 45, 61, 32), "bhnd"),
    ("window_min", f32, Shape(1, 2, 1, 53, 53, 24), "bhnd"),
    ("alibi_causal", bf16, Shape(1, 4, 2, 37, 37, 24), "bhnd"),
    ("softcap", f32, Shape(1, 2, 2, 37, 53, 24), "bhnd"),
    ("bias_grad", f32, Shape(2, 2, 1, 37, 53, 24), "bhnd"),
    ("key_pad_min", f32, Shape(2, 2, 1, 37, 37, 24), "bhnd"),  # KEEP of one row: FULL tiles counted per row
    # Lengths that are multiples of every tile: a KEEP reading aux by position sees unclamped positions
    ("key_pad_min", f32, Shape(2, 2, 1, 48, 64, 24), "bhnd"),
    # Fewer keys than one tile: their positions clamped (`tail_placement`); elsewhere the last kv tile is shifted
    ("key_pad_min", f32, Shape(2, 2, 1, 37, 11, 24), "bhnd"),
    # V of its own head dim: q·k in two parts (96 = 64 + 32, 48 = 32 + 16) beside narrower values, GQA; wider values
    ("causal_inf", f32, Shape(1, 4, 2, 37, 37, 96, head_dim_v=64), "bhnd"),
    ("causal_min", bf16, Shape(1, 2, 1, 70, 70, 48, head_dim_v=32), "bnhd"),
    ("plain", f32, Shape(1, 2, 2, 29, 45, 32, head_dim_v=48), "bnhd"),
]


@pytest.mark.parametrize("name, dtype, shape, layout", MATRIX,
                         ids=[f"{m[0]}-{str(m[1])[6:]}-D{m[2].head_dim}-Dv{m[2].value_dim}" for m in MATRIX])
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


@pytest.mark.parametrize("name, forward_block_m, dq_block_m, kind_block_m, length", [
    ("left_pad_min", None, None, None, 37), ("left_pad_inf", None, None, None, 37),
    ("left_pad_min", 32, None, None, 37), ("left_pad_min", None, 32, None, 37), ("left_pad_min", 32, 32, 16, 37), ("left_pad_inf", 32, 32, 16, 37),
    ("left_pad_min", None, None, None, 48), ("left_pad_min", 32, 32, 16, 64)])
def test_fully_masked_rows(monkeypatch, name, forward_block_m, dq_block_m, kind_block_m, length):
    """Rows keeping no key (left padding under a causal mask) are recomputed over all tiles, forward and
    backward: finfo.min fills average V uniformly, -inf fills give NaN, both exactly as eager. With
    `forward_block_m` the forward runs on taller tiles than the backward, which then maps the forward's
    fallback rows onto its own q blocks; with `dq_block_m` the dQ kernel's q blocks are taller than the dK/dV
    kernel's, each flagging two of them; with `kind_block_m` as well, the forward's map serves both backward
    kernels (its rows lists at 32 rows for the dQ kernel, its kinds and cols lists at 16 for dK/dV). At a `length`
    that every tile divides, the dK/dV kernel's walk past its list takes the block past the last, whose positions
    are then the last block's (`tile_positions`)."""
    if dq_block_m is not None:
        tiles = BackwardConfigs(INTERPRETER_CONFIG, replace(INTERPRETER_CONFIG, block_m=dq_block_m))
        monkeypatch.setattr(flash_bwd, "backward_configs", lambda *args: tiles)
    torch.manual_seed(0)
    shape = Shape(2, 2, 1, length, length, 24)
    case = CASES[name]
    inputs = case.make_inputs(shape)
    q, k, v, do = make_qkv(shape, f32)
    forward_map = None if forward_block_m is None else build_block_map(
        case.mod, inputs.aux, shape.batch, shape.q_heads, shape.q_len, shape.kv_len, forward_block_m, 16, DEVICE,
        kind_block_m=kind_block_m)
    built = record_block_map_builds(monkeypatch)
    got = run_flash(case, inputs, q, k, v, do, forward_map=forward_map)
    assert_matches(got, reference(case, inputs.ref, q, k, v, do), f32)
    assert kind_block_m is None or not built  # the forward's map served both backward kernels

    fully_masked = ~inputs.ref["key_valid"][:, None, :shape.q_len].expand(-1, shape.q_heads, -1)
    assert torch.equal(got["extra"].fallback_rows.bool(), fully_masked)
    if case.mod.fill_bound == F32_MIN:
        uniform = v.mean(2, keepdim=True).expand(-1, shape.q_heads, shape.q_len, -1)
        torch.testing.assert_close(got["out"][fully_masked], uniform[fully_masked], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got["out"].isnan().all(-1), fully_masked)
        assert not got["out"][~fully_masked].isnan().any()


@pytest.mark.parametrize("dkdv, dq", [((16, 32), (32, 32)), ((32, 16), (16, 16))], ids=["short-dkdv", "tall-dkdv"])
def test_unmasked_backward_tiles(monkeypatch, dkdv, dq):
    """Without a mask the backward's two kernels tile apart (as at D ≤ 64 on the GPU: dK/dV 32 × 128, dQ
    64 × 128): kv blocks wider than q chunks, and dK/dV q chunks that need not divide the dQ kernel's q blocks
    (they flag rows a mask recomputed, and there is none), with GQA and sizes no tile divides."""
    tiles = BackwardConfigs(replace(INTERPRETER_CONFIG, block_m=dkdv[0], block_n=dkdv[1]),
                            replace(INTERPRETER_CONFIG, block_m=dq[0], block_n=dq[1]))
    monkeypatch.setattr(flash_bwd, "backward_configs", lambda *args: tiles)
    torch.manual_seed(0)
    shape = Shape(1, 4, 2, 45, 53, 24)
    case = CASES["plain"]
    inputs = case.make_inputs(shape)
    q, k, v, do = make_qkv(shape, f32)
    assert_matches(run_flash(case, inputs, q, k, v, do), reference(case, inputs.ref, q, k, v, do), f32)


@pytest.mark.parametrize("name, kv_len", [("plain", 48), ("plain_linear", 64), ("plain", 53)])
def test_unmasked_kernels_without_partial_tiles(name, kv_len):
    """Without a mask and with kv_len a multiple of the kv tiles, the kernels are built without their PARTIAL
    loops (no tile can reach past kv_len); with a ragged kv_len, with them."""
    torch.manual_seed(0)
    shape = Shape(1, 4, 2, 37, kv_len, 24)
    case = CASES[name]
    assert has_partial_tiles(case.mod, kv_len, INTERPRETER_CONFIG.block_n) == (kv_len % 16 != 0)
    inputs = case.make_inputs(shape)
    q, k, v, do = make_qkv(shape, f32)
    assert_matches(run_flash(case, inputs, q, k, v, do), reference(case, inputs.ref, q, k, v, do), f32)


@pytest.mark.parametrize("name", ["plain", "causal_min", "left_pad_min"])
def test_grouped_programs(monkeypatch, name):
    """Programs taken in groups of (batch, head) pairs (FlashConfig.head_group) compute what the grid's own
    order computes, bit for bit: every (block, head, batch) exactly once. 8 query-head pairs in groups of 3
    (the last of 2) for the forward and dQ kernels, 4 kv-head pairs (GQA) in groups of 3 and 1 for dK/dV."""
    torch.manual_seed(0)
    shape = Shape(2, 4, 2, 45, 37, 24)
    case = CASES[name]
    inputs = case.make_inputs(shape)
    q, k, v, do = make_qkv(shape, f32)
    device_forward, device_backward = flash_fwd.forward_config, flash_bwd.backward_configs

    def run_grouped(head_group):
        # The device's own tiles, only the program order changed: results are bit for bit only at equal tiles.
        def forward_config(*args):
            return replace(device_forward(*args), head_group=head_group)

        def backward_configs(*args):
            configs = device_backward(*args)
            return BackwardConfigs(replace(configs.dkdv, head_group=head_group),
                                   replace(configs.dq, head_group=head_group))

        monkeypatch.setattr(flash_fwd, "forward_config", forward_config)
        monkeypatch.setattr(flash_bwd, "backward_configs", backward_configs)
        return run_flash(case, inputs, q, k, v, do)

    expected, got = run_grouped(1), run_grouped(3)
    for output in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(got[output], expected[output]), output


@pytest.mark.parametrize("name, dtype, shape, dropout_p", [
    ("causal_min", bf16, Shape(1, 4, 2, 45, 37, 48, head_dim_v=32), 0.0),  # GQA, q·k in parts, V of its own width
    ("left_pad_min", f32, Shape(2, 2, 1, 37, 37, 24), 0.0),  # rows the forward recomputed: flagged q blocks
    ("bias_grad", f32, Shape(2, 2, 1, 37, 53, 24), 0.0),  # an aux gradient, dK's launch's only
    ("causal_min", f32, Shape(1, 2, 1, 37, 53, 24), 0.3)], ids=["gqa-parts", "fallback", "aux-grad", "dropout"])
def test_dk_and_dv_apart(monkeypatch, name, dtype, shape, dropout_p):
    """dK and dV in launches of their own (`BackwardConfigs.apart`: dV's without V, dK's with the aux gradients)
    compute what one launch computes, bit for bit, at the same tiles: each recomputes the same weights."""
    torch.manual_seed(0)
    case = CASES[name]
    inputs = case.make_inputs(shape)
    q, k, v, do = make_qkv(shape, dtype)
    dropout = dict(dropout_p=dropout_p, seed=torch.tensor([99], device=DEVICE)) if dropout_p else {}
    device_backward = flash_bwd.backward_configs

    out, lse, extra = flash_attention_forward(q, k, v, case.mod, inputs.aux, out_dtype=q.dtype, **dropout)

    def run(apart):
        monkeypatch.setattr(flash_bwd, "backward_configs", lambda *args: replace(device_backward(*args), apart=apart))
        if inputs.aux_grad is not None:
            inputs.aux_grad[0].zero_()
        grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))  # a gradient not written stays NaN
        dq, dk, dv = flash_attention_backward(do, q, k, v, out, lse, extra, case.mod, inputs.aux, inputs.aux_grad,
                                              grads=grads, **dropout)
        aux_grad = None if inputs.aux_grad is None else inputs.aux_grad[0].clone()
        return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), aux_grad

    (together, aux_together), (apart, aux_apart) = run(False), run(True)
    for output in ("dq", "dk", "dv"):
        assert torch.equal(apart[output], together[output]), output
    assert aux_together is None or torch.equal(aux_apart, aux_together)
    if not dropout_p:
        assert_matches(apart, reference(case, inputs.ref, q, k, v, do), dtype)


# ---- dropout ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["plain", "causal_min"])
def test_dropout(name):
    """The kernel's dropout mask, read back through V = identity, drops about p of the weights, is the same
    in the backward (gradients match a reference using that mask) and changes with the seed."""
    torch.manual_seed(0)
    p, seed = 0.3, torch.tensor([1234], device=DEVICE)  # the kernels read the seed from a tensor
    shape = Shape(1, 2, 1, 37, 40, 40)  # head dim = Nk, so V can be the identity
    case = CASES[name]
    inputs = case.make_inputs(shape)
    q, k, v, do = make_qkv(shape, f32)

    def dropped_weights(seed):
        identity = torch.eye(shape.kv_len, device=DEVICE).expand(1, 1, -1, -1)
        out, _, _ = flash_attention_forward(q, k, identity, case.mod, inputs.aux, dropout_p=p, seed=seed)
        return out  # out[b, h, i, j] = weight_ij · kept_ij / (1 - p)

    dropped = dropped_weights(seed)
    idx = positions(1, 1, shape.q_len, shape.kv_len)
    allowed = (is_causal(idx) if case.mod.has_mask else torch.ones((), dtype=torch.bool, device=DEVICE))
    allowed = allowed.expand(dropped.shape)
    kept = dropped != 0
    assert not kept[~allowed].any()
    assert abs(1.0 - kept[allowed].double().mean().item() - p) < 0.04

    got = run_flash(case, inputs, q, k, v, do, dropout_p=p, seed=seed)
    expected = reference(case, inputs.ref, q, k, v, do, dropout_kept=kept.double(), dropout_p=p)
    assert_matches(got, expected, f32)
    assert not torch.equal(dropped_weights(seed + 1) != 0, kept)


# ---- block map --------------------------------------------------------------------------------------------

def dense_tile_kinds(keep: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Tile kinds of a dense [..., Nq, Nk] keep mask; columns past Nk count as masked."""
    q_len, kv_len = keep.shape[-2:]
    rows = torch.arange(triton.cdiv(q_len, block_m) * block_m, device=keep.device).clamp(max=q_len - 1)
    tiles = F.pad(keep[..., rows, :], (0, -kv_len % block_n))  # rows past Nq repeat the last row
    tiles = tiles.unflatten(-1, (-1, block_n)).unflatten(-3, (-1, block_m))
    full, any_kept = tiles.all(-1).all(-2), tiles.any(-1).any(-2)
    return torch.where(full, FULL.value, torch.where(any_kept, PARTIAL.value, EMPTY.value)).to(torch.int8)


@pytest.mark.parametrize("name, group, block_m, kind_block_m", [
    ("causal_min", 1, 16, 16), ("window_min", 1, 16, 16), ("left_pad_min", 1, 16, 16), ("key_pad_min", 1, 16, 16),
    ("causal_min", 3, 16, 16), ("left_pad_min", 2, 16, 16), ("key_pad_min", 3, 16, 16),
    ("causal_min", 1, 32, 16), ("left_pad_min", 3, 32, 16), ("key_pad_min", 2, 32, 16), ("window_min", 1, 64, 16)])
def test_block_map_matches_dense_mask(monkeypatch, name, group, block_m, kind_block_m):
    """`group`: kv tiles per program of the tile-kind kernel (4 kv blocks here: a last group reaching past them).
    Rows lists of taller tiles than the kinds' and the cols lists' (`block_m` > `kind_block_m`) join the kinds of
    their rows: 37 rows make 3 kind blocks of 16, so at 32 the last rows-list block has one kind row."""
    monkeypatch.setattr(blockmap, "TILE_KIND_GROUP", group)
    shape = Shape(2, 2, 1, 37, 53, 24)
    case = CASES[name]
    inputs = case.make_inputs(shape)
    block_map = build_block_map(case.mod, inputs.aux, shape.batch, shape.q_heads, shape.q_len, shape.kv_len,
                                block_m, 16, DEVICE, kind_block_m=kind_block_m)
    map_shape = (shape.batch if case.mod.keep_uses_batch else 1, shape.q_heads if case.mod.keep_uses_head else 1,
                 shape.q_len, shape.kv_len)
    # Final scores of an all-zero score matrix are F32_MIN exactly where the mask drops an element.
    zeros = torch.zeros(map_shape, dtype=torch.float64, device=DEVICE)
    keep = case.final_scores(zeros, positions(*map_shape), inputs.ref) != F32_MIN
    kinds = dense_tile_kinds(keep, kind_block_m, 16)
    assert torch.equal(block_map.kind, kinds)
    for lists, expected in ((block_map.rows, dense_tile_kinds(keep, block_m, 16)), (block_map.cols, kinds.mT)):
        for which, kind in enumerate((FULL.value, PARTIAL.value)):
            for block in itertools.product(*map(range, expected.shape[:3])):
                listed = lists.index[block][which][: lists.count[block][which]]
                assert torch.equal(listed, (expected[block] == kind).nonzero().flatten().to(torch.int32))


def test_the_lists_kernel_is_launched_alike_at_every_length_up_to_its_block(monkeypatch):
    """Its block of tiles is at least `LIST_BLOCK_MIN`: a map's new length does not compile it again."""
    launched = []
    launch = blockmap._launch_map_kernel
    monkeypatch.setattr(blockmap, "_launch_map_kernel", lambda kernel, grid, *args, **keywords: (
        launched.append(keywords) if kernel is blockmap._tile_lists_kernel else None,
        launch(kernel, grid, *args, **keywords)))
    case = CASES["causal_min"]
    for n in (37, 100, 300):  # 3, 7 and 19 tiles of 16: each a block of its own (4, 8, 32) but for the minimum
        shape = Shape(1, 1, 1, n, n, 16)
        build_block_map(case.mod, case.make_inputs(shape).aux, 1, 1, n, n, 16, 16, DEVICE)
    assert [k["BLOCK"] for k in launched] == [blockmap.LIST_BLOCK_MIN] * 3


@pytest.mark.parametrize("name", ["causal_min", "window_min"])
def test_cached_maps_at_larger_tiles_derive_from_one_base_map(monkeypatch, name):
    """Maps of one mask at several tiles (the forward's, dQ's and dK/dV's) take one tile-kind launch, at the
    base tiles, and each is what its mask's dense kinds say: 48 keys make a last 32-wide kv tile half past the
    keys, which must not be FULL though the one of its 16-wide tiles that exists is (causal, queries 64–74)."""
    monkeypatch.setattr(blockmap, "MAP_BASE_TILE", 16)
    monkeypatch.setattr(blockmap, "_cache", type(blockmap._cache)())
    launches = []
    launch_tile_kinds = blockmap.launch_tile_kinds
    monkeypatch.setattr(blockmap, "launch_tile_kinds", lambda *a, **k: launches.append(a) or launch_tile_kinds(*a, **k))
    shape = Shape(2, 2, 1, 75, 48, 24)
    case = CASES[name]
    inputs = case.make_inputs(shape)
    map_shape = (shape.batch if case.mod.keep_uses_batch else 1, shape.q_heads if case.mod.keep_uses_head else 1,
                 shape.q_len, shape.kv_len)
    zeros = torch.zeros(map_shape, dtype=torch.float64, device=DEVICE)
    keep = case.final_scores(zeros, positions(*map_shape), inputs.ref) != F32_MIN
    for block_m, block_n, kind_block_m in ((32, 32, None), (32, 16, 16), (64, 32, 32), (16, 64, None),
                                           (16, 16, None)):
        block_map = block_map_for(case.mod, inputs.aux, shape.batch, shape.q_heads, shape.q_len, shape.kv_len,
                                  block_m, block_n, DEVICE, kind_block_m=kind_block_m)
        kinds = dense_tile_kinds(keep, kind_block_m or block_m, block_n)
        assert torch.equal(block_map.kind, kinds), (block_m, block_n, kind_block_m)
        for lists, expected in ((block_map.rows, dense_tile_kinds(keep, block_m, block_n)), (block_map.cols, kinds.mT)):
            for which, kind in enumerate((FULL.value, PARTIAL.value)):
                for block in itertools.product(*map(range, expected.shape[:3])):
                    listed = lists.index[block][which][: lists.count[block][which]]
                    assert torch.equal(listed, (expected[block] == kind).nonzero().flatten().to(torch.int32))
    assert len(launches) == 1


def test_mean_row_tiles():
    # Causal over 37 × 53 at 16 × 16: q block i of 3 lists kv blocks 0..i (1 + 2 + 3 tiles).
    causal_map = block_map_for(CASES["causal_min"].mod, (0.1,), 1, 2, 37, 53, 16, 16, DEVICE)
    assert causal_map.mean_row_tiles == 2.0


def test_short_rows_take_narrow_kv_tiles():
    def rows_of(mean_row_tiles):  # what narrow_kv_tiles asks of a block map
        return SimpleNamespace(mean_row_tiles=mean_row_tiles)
    wide = FlashConfig(128, 128, 8, 3)
    assert narrow_kv_tiles(wide, rows_of(SHORT_ROWS - 1)) == FlashConfig(128, 64, 8, 3)
    assert narrow_kv_tiles(wide, None) == FlashConfig(128, 64, 8, 3)  # rows not known without evaluating KEEP
    assert narrow_kv_tiles(wide, rows_of(SHORT_ROWS)) == wide
    assert narrow_kv_tiles(FlashConfig(128, 64, 4, 3), rows_of(1)) == FlashConfig(128, 64, 4, 3)


def test_block_map_cache():
    causal_map = block_map_for(CASES["causal_min"].mod, (0.1,), 2, 2, 37, 53, 16, 16, DEVICE)
    # Maps depend on KEEP only: the -inf variant (same name, same keep) shares it; other tiles do not.
    assert block_map_for(CASES["causal_inf"].mod, (0.1,), 2, 2, 37, 53, 16, 16, DEVICE) is causal_map
    assert block_map_for(CASES["causal_min"].mod, (0.1,), 2, 2, 37, 53, 16, 32, DEVICE) is not causal_map
    # A KEEP reading aux tensors is evaluated per call.
    shape = Shape(2, 2, 1, 37, 37, 24)
    aux = left_padding(shape).aux
    first, second = (block_map_for(CASES["left_pad_min"].mod, aux, 2, 2, 37, 37, 16, 16, DEVICE) for _ in range(2))
    assert first is not second and torch.equal(first.kind, second.kind)


@pytest.mark.parametrize("extent", [(1, 1, 3, 5, 3), (2, 3, 7, 1, 14), (1, 2, 1, 9, 1)], ids=str)
def test_a_block_map_is_views_of_one_buffer_at_aligned_offsets(extent):
    """One allocation (one tensor for the attention op to return and save); each part starts at a multiple of
    16 bytes, as its own allocation would, so Triton specializes its pointer alike; the parts do not overlap."""
    packed = torch.empty(packed_map_numel(extent), dtype=torch.int32)
    block_map = BlockMap.from_packed(16 * extent[4] // extent[2], 16, 16, packed, extent)
    parts = [block_map.kind, block_map.rows.count, block_map.rows.index, block_map.cols.count, block_map.cols.index]
    assert [tuple(t.shape) for t in parts] == map_shapes(*extent)
    spans = sorted((t.data_ptr() - packed.data_ptr(), t.numel() * t.element_size()) for t in parts)
    assert all(start % 16 == 0 for start, _ in spans) and all(t.is_contiguous() for t in parts)
    assert all(start + size <= next_start for (start, size), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] <= packed.numel() * 4


def test_tensor_descriptors_only_where_the_layout_allows():
    def descriptors(t):
        operands, used = tile_operands(((t, 16, 32),), use=True)
        return used and operands[0].strides
    # Contiguous; a dim of extent 1 takes a contiguous stride whatever its own (here 3, not 16-byte aligned).
    assert descriptors(torch.randn(2, 3, 5, 24)) == [360, 120, 24, 1]
    assert descriptors(torch.randn(6, 5, 24).as_strided((1, 3, 5, 24), (3, 120, 24, 1))) == [360, 120, 24, 1]
    # Rows of 100 bf16 (200 bytes), an unaligned base, a transposed head dim, a broadcast (stride 0) head.
    assert not descriptors(torch.randn(1, 2, 5, 100, dtype=torch.bfloat16))
    assert not descriptors(torch.randn(1, 2, 5, 25)[..., 1:])
    assert not descriptors(torch.randn(1, 2, 24, 5).transpose(-1, -2))
    assert not descriptors(torch.randn(1, 1, 5, 24).expand(1, 4, 5, 24))
    assert not tile_operands(((torch.randn(2, 3, 5, 24), 16, 32),), use=False)[1]
    # One layout at a base 4 bytes past 16-byte alignment, then at one 16 bytes past: checked per base.
    flat = torch.randn(2 * 3 * 5 * 24 + 4)
    assert not descriptors(flat[1:1 + 360 * 2].view(2, 3, 5, 24))
    operand = flat[4:4 + 360 * 2].view(2, 3, 5, 24)
    (descriptor,), used = tile_operands(((operand, 16, 32),), use=True)
    assert used and descriptor.base is operand and descriptor.block_shape == [1, 1, 16, 32]


@pytest.mark.parametrize("q_centers", [(1.0, 1.0), (0.125, 0.125), (1.0, 0.0, 0.0)],
                         ids=["past-2^125", "past-2^24", "one-head-of-three"])
def test_rows_of_huge_scores_take_the_exact_exponent(q_centers):
    """Scores near 2^120 · 36 (a declared scale of 2^120; q near 1), past 2^125 where m · log2(e) overflows, or
    near 2^120 · 4.5 (q near 1/8), where it rounds by 2^100: their rows' max is not tame, so the forward, which
    folded the scale into the exponent on full tiles, recomputes them the exact way (rows of the second kind
    came out inf before TAME was 2^24). With one head of three so (q zero elsewhere: scores 0), the dK/dV
    kernel's walk over the group's heads adds the EMPTY tiles of the flagged head's rows alone."""
    torch.manual_seed(0)
    assert HUGE == 1.329227995784916e36
    shape = Shape(1, len(q_centers), 1, 37, 53, 24)
    case = Case(masked("t_causal_huge", causal, F32_MIN, score=huge, score_grad=huge_grad, linear_scale=HUGE),
                lambda s, i, r: where(is_causal(i), s * HUGE, F32_MIN), scale_only)
    q, k, v, do = make_qkv(shape, torch.float32)
    # On a grid of 1/256 every product and partial sum of q · k is exact in float32, so the backward
    # recomputes the forward's scores bit for bit in any order of summation: a score one ulp off would move
    # its weight's exponent by 2^120 ulps (inf).
    centers = torch.tensor(q_centers, device=q.device).view(1, -1, 1, 1)
    q = torch.round(256 * (centers + 0.01 * q * (centers != 0))) / 256
    k = torch.round(256 * (1.5 + 0.01 * k)) / 256
    got = run_flash(case, case.make_inputs(shape), q, k, v, do)
    expected = reference(case, {}, q, k, v, do)
    huge_heads = torch.tensor(q_centers, device=q.device) != 0
    assert got["extra"].fallback_rows[0, huge_heads].all()
    assert not got["extra"].fallback_rows[0, ~huge_heads].any()
    # dq and dk carry the scale: 2^120 times the rounding of d s. dv holds the weights the backward recomputed.
    for name in ("out", "lse", "dv"):
        torch.testing.assert_close(got[name].double(), expected[name].detach(), rtol=1e-5, atol=1e-5)
