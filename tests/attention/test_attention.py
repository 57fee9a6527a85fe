"""Attention however it is written: rewritten into the fused kernel, forward and backward equal to eager."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention.forms.test_alibi import bloom_alibi
from support import DEVICE, SUMMED_GRADIENT_FP32, last_attention, random_tensor, record_block_map_builds, rewrites
from support import check as check_exactly

import fusepass
from fusepass.attention import call, op

B, H, NQ, NK, D = 2, 3, 37, 45, 24
# Scores of a few units in fp32: rounding differences of 1e-7 grow through exp to about 1e-5.
FP32 = dict(rtol=1e-4, atol=1e-4)


def check(fn, *inputs, **kwargs):
    if not any(isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16) for x in inputs):
        kwargs = {**FP32, **kwargs}
    return check_exactly(fn, *inputs, **kwargs)


def qkv(dtype=torch.float32, b=B, h=H, nq=NQ, nk=NK, d=D, kv_heads=None):
    q = random_tensor((b, h, nq, d), dtype)
    k = random_tensor((b, kv_heads or h, nk, d), dtype)
    v = random_tensor((b, kv_heads or h, nk, d), dtype)
    return q, k, v


def attention_rewrite(report) -> fusepass.Rewrite:
    (rewrite,) = rewrites(report, kind="attention", phase="forward")
    return rewrite


def assert_no_quadratic_tensor(report, nq=NQ, nk=NK):
    """No value of the rewritten graphs is as large as one head's N×N scores."""
    for phase, gm in report.graphs.items():
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            for v in val if isinstance(val, (tuple, list)) else (val,):
                if isinstance(v, torch.Tensor) and v.dim() >= 2:
                    assert tuple(v.shape[-2:]) != (nq, nk), f"{phase}: {node} is {tuple(v.shape)}"


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_plain_attention(dtype):
    report = check(plain, *qkv(dtype), backward=True, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    rewrite = attention_rewrite(report)
    assert rewrite.ops[0] == "aten.matmul" and "aten.softmax" in rewrite.ops
    assert rewrite.bytes_fused < rewrite.bytes_unfused
    assert_no_quadratic_tensor(report)


def causal_masked_fill(q, k, v):
    n = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_triangle_mask(dtype):
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    report = check(causal_masked_fill, *qkv(dtype, nk=NQ), backward=True, **tol)
    assert "mask" in attention_rewrite(report).features or "causal" in attention_rewrite(report).features


def bmm_folded_heads(q, k, v):
    b, h, n, d = q.shape
    qq, kk, vv = (t.reshape(b * h, -1, d) for t in (q, k, v))
    s = torch.bmm(qq, kk.transpose(1, 2)) / math.sqrt(d)
    i = torch.arange(n, device=q.device)
    s = s.masked_fill(i[None, :, None] < i[None, None, :], float("-inf"))
    return torch.bmm(torch.softmax(s, dim=-1), vv).view(b, h, n, d).transpose(1, 2)


def test_bmm_with_heads_folded_into_the_batch():
    check(bmm_folded_heads, *qkv(nk=NQ), backward=True)


def einsum_gqa_interleave(q, k, v):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q * q.shape[-1] ** -0.5, k)
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.einsum("bhqk,bhkd->bqhd", p, v)


def repeat_kv(x, group):
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, group, n, d).reshape(b, h * group, n, d)


def llama_style_gqa(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def bmm_gqa(q, k, v):
    """GQA through bmm: K and V repeated, then batch and heads folded into bmm's batch."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).reshape(b * h, -1, d) for x in (k, v))
    s = torch.bmm(q.reshape(b * h, n, d), k.transpose(1, 2)) * d ** -0.5
    return torch.bmm(torch.softmax(s, dim=-1), v).view(b, h, n, d)


@pytest.mark.parametrize("fn", [einsum_gqa_interleave, llama_style_gqa, bmm_gqa])
def test_grouped_query_attention_reads_shared_heads(fn):
    q, k, v = qkv(h=4, kv_heads=2)
    report = check(fn, q, k, v, backward=True)
    rewrite = attention_rewrite(report)
    assert "gqa" in rewrite.features and rewrite.detail["kv_heads"] == 2
    graph = report.graphs["forward"].graph
    assert not any(getattr(n.target, "overloadpacket", None) in (torch.ops.aten.repeat_interleave,
                                                                  torch.ops.aten.expand) for n in graph.nodes)


def test_multi_query_by_broadcasting():
    q, k, v = qkv(kv_heads=1)
    report = check(plain, q, k, v, backward=True)
    assert "gqa" in attention_rewrite(report).features


def packed_projection(x, weight):
    b, n, _ = x.shape
    q, k, v = (x @ weight).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1) @ v


def test_q_k_v_sliced_from_one_packed_projection():
    # Each view reads a third of the projection's output: its gradient is zero elsewhere.
    x, weight = random_tensor((B, NQ, 8), torch.float32), random_tensor((8, 3 * H * D), torch.float32, low=-0.3,
                                                                         high=0.3)
    report = check(packed_projection, x, weight, backward=True)
    assert attention_rewrite(report)


def test_alibi_with_baddbmm():
    slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=DEVICE)
    report = check(bloom_alibi, *qkv(nk=NQ), slopes, backward=True, **SUMMED_GRADIENT_FP32)  # the slopes learn
    assert "alibi" in attention_rewrite(report).features
    # The bias reads the slopes, the mask only positions: its block map is cached, not rebuilt per call.
    assert not last_attention().mod.keep_reads_aux


def t5_bias(q, k, v, table):
    n_q, n_k = q.shape[-2], k.shape[-2]
    context = torch.arange(n_q, device=q.device)[:, None]
    memory = torch.arange(n_k, device=q.device)[None, :]
    relative = memory - context
    buckets = (relative > 0).to(torch.long) * 8
    distance = torch.abs(relative)
    large = 4 + (torch.log(distance.float().clamp(min=1) / 4) / math.log(32 / 4) * 4).to(torch.long)
    buckets = buckets + torch.where(distance < 4, distance, torch.clamp(large, max=7))
    bias = F.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)
    s = q @ k.transpose(-1, -2) + bias
    return torch.softmax(s.float(), dim=-1).type_as(s) @ v


def test_t5_relative_bias_with_a_learnable_table():
    table = random_tensor((16, H), torch.float32)
    report = check(t5_bias, *qkv(), table, backward=True, **SUMMED_GRADIENT_FP32)
    assert "relative_bias" in attention_rewrite(report).features


def sliding_window(q, k, v):
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    distance = i[:, None] - i[None, :]
    keep = (distance >= 0) & (distance < 8)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = torch.where(keep, s, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_sliding_window():
    check(sliding_window, *qkv(nk=NQ), backward=True)


def softcap_causal(q, k, v):
    n = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = torch.tanh(s / 5.0) * 5.0
    s = s + torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
    return torch.softmax(s, dim=-1) @ v


def subsequent_mask_added(q, k, v):  # nn.Transformer.generate_square_subsequent_mask, added to the scores
    n = q.shape[-2]
    mask = torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, dim=-1) @ v


def test_an_added_triangle_of_minus_infinity_is_a_mask_whose_empty_tiles_are_skipped():
    report = check(subsequent_mask_added, *qkv(nk=NQ), backward=True)
    assert "causal" in attention_rewrite(report).features
    assert "keep" in last_attention().spec.lifted.functions


def repeated_positions_mask(q, k, v):  # T5's decoder mask: positions repeated over the batch and rows, compared
    b, _, n, _ = q.shape
    ids = torch.arange(n, device=q.device)
    causal = ids[None, None, :].repeat(b, n, 1) <= ids[None, :, None]
    bias = (1.0 - causal[:, None].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v


def test_positions_repeated_along_their_size_one_dims_are_computed_not_loaded():
    check(repeated_positions_mask, *qkv(nk=NQ), backward=True)
    lifted = last_attention().spec.lifted
    assert not lifted.aux
    assert "keep" in lifted.functions  # (1 - bool) · min: a mask, its empty tiles skipped


def bias_with_the_mask_folded_in(q, k, v, bias):  # T5's decoder: the mask added to the bias, then to the scores
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    position_bias = bias + (1.0 - keep.to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(q @ k.transpose(-1, -2) + position_bias, dim=-1) @ v


@pytest.mark.parametrize("backward", [True, False], ids=["learned bias", "fixed bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_mask_added_to_a_bias_before_the_scores_is_split_off(dtype, backward):
    report = check(bias_with_the_mask_folded_in, *qkv(dtype, nk=NQ), random_tensor((H, NQ, NQ), dtype),
                   backward=backward)
    assert "causal" in attention_rewrite(report).features
    # fp16's minimum (-65504) is within reach of the scores: its tiles are computed, not skipped
    assert ("keep" in last_attention().spec.lifted.functions) == (dtype == torch.float32)


def integer_padding_added(q, k, v, attention_mask):  # BERT: the mask an int tensor, which may hold other values
    extended = (1.0 - attention_mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + extended, dim=-1) @ v


def test_a_loaded_integer_times_a_fill_is_not_taken_for_a_mask():
    attention_mask = (torch.arange(NK, device=DEVICE) < torch.tensor([[NK - 5], [NK]], device=DEVICE)).long()
    check(integer_padding_added, *qkv(), attention_mask, backward=True)
    assert "keep" not in last_attention().spec.lifted.functions


def tiled_bias(q, k, v, bias):  # a bias repeated along a longer dim: read from the repeat's result
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias.repeat(1, 1, 1, 3), dim=-1) @ v


def test_a_repeat_that_tiles_a_dim_is_loaded_as_it_is_written():
    check(tiled_bias, *qkv(), random_tensor((B, H, NQ, NK // 3), torch.float32), backward=True)
    (aux,) = last_attention().spec.lifted.aux
    assert "repeat" in str(aux.target)


def test_softcap_with_an_additive_triangle():
    report = check(softcap_causal, *qkv(nk=NQ), backward=True)
    assert "softcap" in attention_rewrite(report).features


def padded_causal(q, k, v, keep):
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & keep[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    additive = additive.masked_fill(~allowed, torch.finfo(q.dtype).min)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + additive
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_left_padded_batch_fully_masked_rows_match_eager(dtype):
    keep = torch.ones(B, NQ, dtype=torch.bool, device=DEVICE)
    keep[0, :5] = False  # left padding: the first rows of batch 0 see no key at all
    report = check(padded_causal, *qkv(dtype, nk=NQ), keep, backward=True)
    assert "padding_mask" in attention_rewrite(report).features
    assert last_attention().mod.keep_reads_aux  # the mask reads `keep`: mapped on every call


def offset_scores(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) + 2.0 ** 20, dim=-1) @ v


def test_rows_far_from_zero_keep_their_weights_exact():
    """Scores near 2^20, exact in fp32 (q and k on a grid of halves): the forward's fused exponent rounds
    m · log2(e) by up to ~0.04, a factor every weight of the row shares; unless log_sum accounts for it, the
    backward's recomputed weights are off by as much."""
    q, k = (torch.randint(-2, 3, (B, H, NQ, D), device=DEVICE).float() / 2 for _ in range(2))
    v = random_tensor((B, H, NQ, D), torch.float32)
    check(offset_scores, q, k, v, backward=True)


def minus_inf_padding(q, k, v, keep):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_rows_masked_with_minus_inf_are_nan_like_eager():
    keep = torch.ones(B, NK, dtype=torch.bool, device=DEVICE)
    keep[1] = False
    q, k, v = qkv()
    out = torch.compile(minus_inf_padding, backend="fusepass")(q, k, v, keep)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    torch.testing.assert_close(out[0], minus_inf_padding(q, k, v, keep)[0], rtol=1e-5, atol=1e-5)


def bert_additive_mask(q, k, v, mask):
    extended = (1.0 - mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min  # a float mask
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s + extended
    return torch.matmul(F.dropout(F.softmax(s, dim=-1), 0.0, training=False), v)


def test_bert_style_float_mask():
    mask = torch.rand(B, NK, device=DEVICE) > 0.3  # bool here (no gradient), float inside
    check(bert_additive_mask, *qkv(), mask, backward=True)


def dense_bias(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.2 + bias, dim=-1) @ v


def test_dense_bias_input_gets_its_gradient():
    bias = random_tensor((1, H, NQ, NK), torch.float32)
    report = check(dense_bias, *qkv(), bias, backward=True)
    assert "bias" in attention_rewrite(report).features


@pytest.mark.parametrize("shape", [(1, H, 1, NK), (B, 1, NQ, 1)], ids=["per key", "per query"])
def test_a_bias_broadcast_over_queries_or_keys_gets_its_gradient_summed(shape):
    # Summed over the axis it is broadcast on, which the dK/dV kernel's [kv, q] tiles hold the other way round.
    bias = random_tensor(shape, torch.float32)
    check(dense_bias, *qkv(), bias, backward=True)
    assert "q_idx.shape[0] == 1" in last_attention().spec.lifted.source  # the summing path ran


def document_mask(q, k, v, segments):
    same = segments[:, :, None] == segments[:, None, :]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~same[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_document_mask_from_segment_ids():
    segments = torch.sort(torch.randint(0, 4, (B, NQ), device=DEVICE), dim=-1).values
    report = check(document_mask, *qkv(nk=NQ), segments, backward=True)
    # The ids are read at key positions and at query positions: a document mask, not a padding mask.
    assert attention_rewrite(report).features == ("document",)


def test_a_mask_reading_tensors_is_mapped_once_per_forward_and_backward(monkeypatch):
    built = record_block_map_builds(monkeypatch)
    segments = torch.sort(torch.randint(0, 4, (B, NQ), device=DEVICE), dim=-1).values
    q, k, v = (t.requires_grad_() for t in qkv(nk=NQ))
    compiled = torch.compile(document_mask, backend=fusepass.backend(strict=True))
    out = compiled(q, k, v, segments)
    built.clear()
    out = compiled(q, k, v, segments)
    assert len(built) == 1  # the forward's map, which the op returns for the backward
    spec = last_attention()
    returned = op.run_attention(q.detach(), k.detach(), v.detach(), [segments], torch.empty(0), spec.spec.name)[5]
    assert [tuple(t.shape) for t in returned] == spec.map_shapes(q)
    built.clear()
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    # Only kernels whose tiles the forward's map does not serve map the mask at theirs (at D128 on a GPU the
    # forward's map serves both backward kernels: see test_one_map_serves_the_forward_and_both_backward_kernels).
    tiles, kinds_at, _ = spec.passed_map(q)
    served = {(tiles.block_m, tiles.block_n), (kinds_at, tiles.block_n)}
    assert not served & {(block_m, block_n) for block_m, block_n, _ in built}


def test_backward_kernels_tiling_alike_read_one_map(monkeypatch):
    """Where the dQ and dK/dV kernels tile alike (both 64 × 64 at D ≤ 64 on a GPU) and unlike the forward, a
    mask that reads tensors is mapped once per backward, and the gradients are eager's."""
    from fusepass.flash import backward as flash_bwd
    from fusepass.flash.config import BackwardConfigs, FlashConfig

    alike = FlashConfig(16, 32, num_warps=1, num_stages=1)
    monkeypatch.setattr(flash_bwd, "backward_configs", lambda *args: BackwardConfigs(alike, alike))
    built = record_block_map_builds(monkeypatch)
    segments = torch.sort(torch.randint(0, 4, (B, NQ), device=DEVICE), dim=-1).values
    check(document_mask, *qkv(nk=NQ), segments, backward=True)
    forward_tiles = built[0]
    assert forward_tiles != (16, 32, 16) and built.count((16, 32, 16)) == 1


def test_one_map_serves_the_forward_and_both_backward_kernels(monkeypatch):
    """Where the dK/dV kernel's q blocks divide the forward's (at D128 on a GPU: 64 and 128 rows, both 64 wide),
    a mask that reads tensors is mapped once per forward+backward: the forward's map has its kinds and cols
    lists at the dK/dV kernel's q blocks, its rows lists at its own; the gradients are eager's."""
    from fusepass.flash import backward as flash_bwd, config as flash_config, forward as flash_fwd
    from fusepass.flash.config import BackwardConfigs, FlashConfig

    tall, short = FlashConfig(32, 16, num_warps=1, num_stages=1), FlashConfig(16, 16, num_warps=1, num_stages=1)
    for module in (flash_fwd, call):
        monkeypatch.setattr(module, "forward_config", lambda *args: tall)
    for module in (flash_config, flash_bwd):
        monkeypatch.setattr(module, "backward_configs", lambda *args: BackwardConfigs(short, tall))
    built = record_block_map_builds(monkeypatch)
    segments = torch.sort(torch.randint(0, 4, (B, NQ), device=DEVICE), dim=-1).values
    check(document_mask, *qkv(nk=NQ), segments, backward=True)
    assert set(built) == {(32, 16, 16)}


def test_the_tiles_past_head_dim_128(monkeypatch):
    """The GPU's tiles past head dim 128 (Gemma 2's 256: forward 128 × 64, dK/dV 32 × 128 in two launches, dQ
    128 × 32), through the interpreter: each kernel at tiles of its own, so each maps a mask that reads tensors at
    its own, sizes no tile divides; the gradients are eager's."""
    from fusepass.flash import backward as flash_bwd, config as flash_config, forward as flash_fwd

    forward = flash_config._forward_tiles(256, torch.bfloat16, True)
    backward = flash_config._backward_tiles(256, torch.bfloat16, True)
    assert (forward.block_m, forward.block_n, backward.dkdv.block_m, backward.dkdv.block_n, backward.dq.block_m) == \
        (128, 64, 32, 128, 128) and backward.apart
    for module in (flash_fwd, call):
        monkeypatch.setattr(module, "forward_config", lambda *args: forward)
    for module in (flash_config, flash_bwd):
        monkeypatch.setattr(module, "backward_configs", lambda *args: backward)
    built = record_block_map_builds(monkeypatch)
    n = 150
    segments = torch.sort(torch.randint(0, 4, (1, n), device=DEVICE), dim=-1).values
    check(document_mask, *qkv(b=1, h=2, nq=n, nk=n), segments, backward=True)
    assert set(built) == {(128, 64, 128), (32, 128, 32), (128, 32, 128)}


def scaled_by_a_tensor(q, k, v, temperature):
    return torch.softmax((q @ k.transpose(-1, -2)) * temperature, dim=-1) @ v


def test_scale_as_a_zero_dim_tensor_that_learns():
    temperature = torch.tensor(0.3, device=DEVICE)
    # Its gradient sums ~10^4 products of scores (up to ~10^3) with cancellation: the order of that fp32 sum
    # alone moves it by ~1e-3.
    check(scaled_by_a_tensor, *qkv(), temperature, backward=True, rtol=1e-3, atol=3e-3)


def test_cross_attention():
    report = check(plain, *qkv(nq=19, nk=53), backward=True)
    assert "cross" in attention_rewrite(report).features


@pytest.mark.parametrize("d", [16, 80, 96])
def test_head_dims(d):
    check(causal_masked_fill, *qkv(d=d, nk=NQ), backward=True)


def two_layers_one_mask(x, wq, wk, wv):
    n = x.shape[-2]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
    for _ in range(2):
        q, k, v = x @ wq, x @ wk, x @ wv
        s = (q @ k.transpose(-1, -2)).masked_fill(mask, -1e9)
        x = torch.softmax(s, dim=-1) @ v
    return x


def test_one_mask_shared_by_two_layers():
    x = random_tensor((B, NQ, D), torch.float32)
    w = [random_tensor((D, D), torch.float32) * 0.05 for _ in range(3)]
    report = check(two_layers_one_mask, x, *w, backward=True)
    assert len(rewrites(report, kind="attention", phase="forward")) == 2


# --- what must not be rewritten -------------------------------------------------------------------------


def probabilities_returned(q, k, v):
    p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return p @ v, p


def softmax_over_queries(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v


def scores_returned(q, k, v):
    s = q @ k.transpose(-1, -2)
    return torch.softmax(s, dim=-1) @ v, s.sum()


def scores_with_a_row_reduction(q, k, v):
    s = q @ k.transpose(-1, -2)
    s = s - s.amax(dim=-1, keepdim=True)
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("fn, reason", [
    (probabilities_returned, "probabilities also used"),
    (softmax_over_queries, "not the key axis"),
    (scores_returned, "scores also used"),
    (scores_with_a_row_reduction, "amax"),
])
def test_declined_attention_stays_exact_and_says_why(fn, reason):
    report = check(fn, *qkv(), backward=True)
    assert not rewrites(report, kind="attention")
    (hotspot,) = [h for h in report.hotspots if h.kind == "attention"]
    assert reason in hotspot.reason
    assert hotspot.location.startswith("tests/attention/test_attention.py:")


# --- dropout ---------------------------------------------------------------------------------------------


def dropout_attention(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return F.dropout(torch.softmax(s, dim=-1), p=0.25, training=True) @ v


def test_dropout_in_kernel_matches_its_own_backward():
    n = 32
    q = random_tensor((B, H, n, n), torch.float32).requires_grad_()
    k = random_tensor((B, H, n, n), torch.float32).requires_grad_()
    eye = torch.eye(n, device=DEVICE).expand(B, H, n, n).contiguous().requires_grad_()
    out = torch.compile(dropout_attention, backend="fusepass")(q, k, eye)  # V = I: out is the dropped P
    assert "dropout" in attention_rewrite(fusepass.last_report()).features
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(n), dim=-1)
    dropped = out == 0
    assert abs(dropped.float().mean().item() - 0.25) < 0.05
    torch.testing.assert_close(out[~dropped], (p / 0.75)[~dropped], rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, eye), grad)
    torch.testing.assert_close(dv, out.transpose(-1, -2) @ grad, rtol=1e-5, atol=1e-5)
    d_p = grad * out / p.detach()  # the gradient reaching P through the kept, rescaled entries
    d_s = p.detach() * (d_p - (d_p * p.detach()).sum(-1, keepdim=True)) / math.sqrt(n)
    torch.testing.assert_close(dq, d_s @ k.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk, d_s.transpose(-1, -2) @ q.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(mode):
    with mode():
        report = check(causal_masked_fill, *qkv(nk=NQ))
    assert rewrites(report, kind="attention")
    assert not rewrites(report, kind="attention", phase="backward")


def test_one_batch_and_one_head():
    attention_rewrite(check(plain, *qkv(b=1, h=1), backward=True))


def test_plain_matrices():
    q, k, v = (t[0, 0] for t in qkv(b=1, h=1))  # 2-D: [N, D]
    attention_rewrite(check(plain, q, k, v, backward=True))



LAID_OUT_BIASES = {  # a learned additive bias given to the compiled code laid out by strides of its own
    "permuted": ((NQ, NK, H), lambda raw: raw.permute(2, 0, 1).unsqueeze(0)),
    "sliced": ((1, H, NQ + 5, NK + 7), lambda raw: raw[:, :, :NQ, :NK]),
    "broadcast over heads": ((1, 1, NQ, NK), lambda raw: raw.expand(1, H, NQ, NK)),
}


def biased(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.2 + bias, dim=-1) @ v


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("layout", LAID_OUT_BIASES)
def test_a_learned_bias_laid_out_by_its_strides_gets_its_gradient(layout, dynamic):
    """The bias's gradient accumulates at the offsets its values are read from. A bias permuted before the
    compiled code (or before an attention planned under symbolic sizes: T5's position bias, permuted from
    [Nq, Nk, H] and shared by every layer) had its gradient added up in a contiguous buffer, in the wrong places."""
    shape, lay_out = LAID_OUT_BIASES[layout]
    q, k, v = (x.requires_grad_() for x in qkv())
    raw = random_tensor(shape, torch.float32).requires_grad_()
    fusepass.reset()
    compiled = torch.compile(lambda *args: biased(*args), backend=fusepass.backend(strict=True), dynamic=dynamic)
    out = compiled(q, k, v, lay_out(raw))
    expected = biased(q, k, v, lay_out(raw))
    torch.testing.assert_close(out, expected, **FP32)
    grad = torch.randn_like(out)
    leaves = (q, k, v, raw)
    for a, e in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(expected, leaves, grad)):
        torch.testing.assert_close(a, e, **FP32)
    assert attention_rewrite(fusepass.last_report())
