"""A score term of the distance k - q alone, costly per score (T5's log-bucketed bias), is read from a table
of its values per distance: the scores as eager computes them, forward and backward, and its code gone
from the score functions. An element of a learnable table gathered by distance is read so too, and its
gradient summed per distance. Cheap terms and terms that read positions otherwise stay per score."""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import SUMMED_GRADIENT_FP32, check, last_attention, random_tensor



B, H, NQ, NK, D = 2, 3, 37, 45, 16
FP32 = dict(rtol=1e-4, atol=1e-4)


def t5_bias(q, k, v, table, relative_of=lambda context, memory: memory - context, scale=None):
    context = torch.arange(q.shape[-2], device=q.device)[:, None]
    memory = torch.arange(k.shape[-2], device=q.device)[None, :]
    relative = relative_of(context, memory)
    buckets = (relative > 0).to(torch.long) * 8
    distance = relative.abs()
    large = 4 + (torch.log(distance.float().clamp(min=1) / 4) / math.log(32 / 4) * 4).to(torch.long)
    buckets = buckets + torch.where(distance < 4, distance, large.clamp(max=7))
    bias = F.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)
    if scale is not None:
        bias = bias * scale[:, None, None, None]
    s = q @ k.transpose(-1, -2) + bias.to(q.dtype)
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def inputs(dtype=torch.float32, q_len=NQ, kv_len=NK):
    return [random_tensor(shape, dtype) for shape in ((B, H, q_len, D), (B, H, kv_len, D), (B, H, kv_len, D))]


def spec():
    return last_attention()


def score_source() -> str:
    return inspect.getsource(getattr(spec().mod.score, "fn", spec().mod.score))


@pytest.mark.parametrize("relative_of", [
    lambda context, memory: memory - context,
    lambda context, memory: -(context - memory),
    lambda context, memory: (memory + 3) - (context + 3),
], ids=["k-q", "-(q-k)", "shifted"])
def test_t5_bias_is_read_from_a_table_per_distance(relative_of):
    table = random_tensor((16, H), torch.float32)  # no gradient flows to it: captured, not an input
    report = check(lambda q, k, v: t5_bias(q, k, v, table, relative_of), *inputs(), backward=True, **FP32)
    (rewrite,) = [r for r in report.rewrites if r.kind == "attention" and r.phase == "forward"]
    assert "distance_table" in rewrite.features
    (distance_table,) = spec().spec.lifted.tables
    assert (distance_table.batch, distance_table.heads, distance_table.q_len, distance_table.kv_len) == (1, H, NQ, NK)
    source = score_source()
    assert "tl.log" not in source and "aux[1]" in source, source


def test_a_table_varies_with_the_batch_where_the_term_does():
    table = random_tensor((16, H), torch.bfloat16)
    scale = random_tensor((B,), torch.bfloat16)
    check(lambda q, k, v: t5_bias(q, k, v, table, scale=scale), *inputs(torch.bfloat16), backward=True)
    (distance_table,) = spec().spec.lifted.tables
    assert (distance_table.batch, distance_table.heads) == (B, H)


def alibi(q, k, v, slopes):
    i = torch.arange(q.shape[-2], device=q.device)
    bias = slopes[:, None, None] * (i[None, None, :] - i[None, :, None])
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_learnable_table_is_read_per_distance_and_its_gradient_summed_per_distance(dtype):
    table = random_tensor((16, H), dtype)
    check(t5_bias, *inputs(dtype), table, backward=True, **(SUMMED_GRADIENT_FP32 if dtype == torch.float32 else {}))
    (distance_table,) = spec().spec.lifted.tables
    assert distance_table.grad_of == 0 and distance_table.offset_function
    source = score_source()
    assert "tl.log" not in source, source


@pytest.mark.parametrize("case", ["cheap", "not a distance"])
def test_terms_stay_per_score(case):
    q, k, v = inputs()
    if case == "cheap":  # ALiBi: a slope times the distance costs less than a table read
        slopes = random_tensor((H,), torch.float32)
        check(lambda q, k, v: alibi(q, k, v, slopes), q, k[:, :, :NQ], v[:, :, :NQ], backward=True, **FP32)
    else:
        table = random_tensor((16, H), torch.float32)
        check(lambda q, k, v: t5_bias(q, k, v, table, lambda context, memory: memory - 2 * context), q, k, v,
              backward=True, **FP32)
    assert not spec().spec.lifted.tables


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(q_coef=st.integers(-2, 2), k_coef=st.integers(-2, 2), shift=st.integers(-3, 3))
def test_only_functions_of_the_distance_are_tabulated(q_coef, k_coef, shift):
    """Buckets of q_coef·q + k_coef·k + shift: a table exactly where that is a multiple of k - q (not 0), and
    the scores as eager computes them either way."""
    torch._dynamo.reset()  # else Dynamo makes the coefficients symbolic from the second example on
    table = random_tensor((16, H), torch.float32)

    def relative_of(context, memory):
        return context * q_coef + memory * k_coef + shift

    # shorter than the other tests' (fewer tiles for each example to run), still not multiples of the tiles
    check(lambda q, k, v: t5_bias(q, k, v, table, relative_of), *inputs(q_len=21, kv_len=29), backward=True, **FP32)
    assert bool(spec().spec.lifted.tables) == (q_coef == -k_coef != 0)
