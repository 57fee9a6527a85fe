"""A keep that compares a value of the query position alone with one of the key position alone (document ids)
is separable (ScoreMod.separable_keep): its block map classifies each tile from the two sides' ranges of values
instead of evaluating every element. Only FULL and EMPTY must be exact there (a PARTIAL tile is evaluated element
by element), so such maps are checked against the exact ones, and the attention against eager, on ids that are
sorted (documents) and ids that are not (the ranges then meet where no pair is equal)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import DEVICE, check, last_attention, random_tensor


from fusepass.flash.blockmap import EMPTY, FULL, SEPARABLE_TILES, build_block_map, launch_separable_kinds
from fusepass.flash.score_mod import ScoreMod, SeparableKeep

FULL_KIND, EMPTY_KIND = FULL.value, EMPTY.value  # constexprs in the kernels

B, H, N, D = 2, 3, 45, 16


def same_document(q, k, v, ids):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(ids[:, None, :, None] != ids[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def same_document_where(q, k, v, ids):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = torch.where(ids[:, None, :, None] == ids[:, None, None, :], s, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def other_documents(q, k, v, ids):
    """Keys of other documents only (keep = ids differ); a row whose ids are all one value is fully masked."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(ids[:, None, :, None] == ids[:, None, None, :], torch.finfo(s.dtype).min)
    return torch.softmax(s, dim=-1) @ v


def same_document_causal(q, k, v, ids):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    s = s.masked_fill(ids[:, None, :, None] != ids[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def packed_causal(q, k, v, ids):
    """Documents packed into one sequence for causal language modelling, as one mask: same document and causal."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    same = ids[:, None, :, None] == ids[:, None, None, :]
    return torch.softmax(s.masked_fill(~(same & causal), float("-inf")), dim=-1) @ v


def same_document_bias(q, k, v, ids):
    """The ids compared in an additive mask (a bias of 0 or -inf): not lifted as a separable keep."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    bias = torch.zeros(ids.shape[0], 1, ids.shape[1], ids.shape[1], device=q.device)
    bias = bias.masked_fill(ids[:, None, :, None] != ids[:, None, None, :], float("-inf"))
    return torch.softmax(s + bias, dim=-1) @ v


def sorted_ids(documents: int) -> torch.Tensor:
    return torch.sort(torch.randint(0, documents, (B, N), device=DEVICE), dim=-1).values


def interleaved_ids() -> torch.Tensor:
    """Ids that are not sorted: every tile's ranges meet, though some tiles hold no equal pair."""
    return torch.randint(0, 3, (B, N), device=DEVICE) * 2 + torch.arange(N, device=DEVICE) % 2


@pytest.mark.parametrize("fn, equal", [
    (same_document, True), (same_document_where, True), (other_documents, False), (same_document_causal, True),
    (packed_causal, True), (same_document_bias, None),
])
@pytest.mark.parametrize("ids", ["sorted", "interleaved"])
def test_separable_keeps_compute_what_eager_does(fn, equal, ids):
    torch.manual_seed(0)
    q, k, v = (random_tensor((B, H, N, D), torch.float32) for _ in range(3))
    document_ids = sorted_ids(4) if ids == "sorted" else interleaved_ids()
    check(fn, q, k, v, document_ids, backward=True, rtol=1e-4, atol=1e-4)
    mod = last_attention().mod
    assert (None if mod.separable_keep is None else mod.separable_keep.equal) == equal


def test_float_ids_are_not_separable():
    q, k, v = (random_tensor((B, H, N, D), torch.float32) for _ in range(3))
    check(same_document, q, k, v, sorted_ids(4).float(), rtol=1e-4, atol=1e-4)
    assert last_attention().mod.separable_keep is None


@pytest.mark.parametrize("fn", [same_document, other_documents, same_document_causal, packed_causal])
@pytest.mark.parametrize("documents", [1, 3, 40])
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 16)])
def test_separable_maps_are_exact_where_they_say_full_or_empty(fn, documents, block_m, block_n):
    torch.manual_seed(documents)
    q, k, v = (random_tensor((B, H, N, D), torch.float32) for _ in range(3))
    ids = sorted_ids(documents)
    check(fn, q, k, v, ids, rtol=1e-4, atol=1e-4)
    mod = last_attention().mod
    assert mod.separable_keep is not None
    for document_ids in (ids, interleaved_ids()):
        separable, exact = (build_block_map(m, (document_ids,), B, H, N, N, block_m, block_n, DEVICE).kind
                            for m in (mod, replace(mod, separable_keep=None)))
        assert torch.equal(separable == FULL_KIND, exact == FULL_KIND)
        assert not (separable == EMPTY_KIND)[exact != EMPTY_KIND].any()
        if document_ids is ids and fn in (same_document, other_documents):
            # Sorted ids: a tile whose ranges meet holds an equal pair, so every kind is exact. (Joined with a
            # causal mask, a tile PARTIAL under both may keep nothing.)
            assert torch.equal(separable, exact)


# Hand-written separable keeps over ids [batch, n] (aux: the ids and their batch stride), for any shape.
@triton.jit
def _query_ids(b, h, q_idx, aux):
    return tl.load(aux[0] + b * aux[1] + q_idx)


@triton.jit
def _key_ids(b, h, kv_idx, aux):
    return tl.load(aux[0] + b * aux[1] + kv_idx)


@triton.jit
def _same_ids(b, h, q_idx, kv_idx, aux):
    return _query_ids(b, h, q_idx, aux) == _key_ids(b, h, kv_idx, aux)


@triton.jit
def _other_ids(b, h, q_idx, kv_idx, aux):
    return _query_ids(b, h, q_idx, aux) != _key_ids(b, h, kv_idx, aux)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(equal=st.booleans(), n=st.integers(1, 70), m=st.integers(1, 70),
       tiles=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
       program=st.sampled_from([SEPARABLE_TILES, (1, 1, 1), (2, 4, 1), (4, 2, 2)]),
       ids=st.lists(st.integers(0, 4), min_size=140, max_size=140), sort=st.booleans())
def test_separable_kinds_fuzzed(equal, n, m, tiles, program, ids, sort):
    """On any ids, query and key lengths, tiles and blocks per program of the ranges kernel: FULL where and only
    where every element is kept, EMPTY only where none is."""
    document_ids = torch.tensor(ids, device=DEVICE).view(2, 70)
    if sort:
        document_ids = torch.sort(document_ids, dim=-1).values
    keep = _same_ids if equal else _other_ids
    mod = ScoreMod(name=f"fuzzed_{equal}", score=None, score_grad=None, keep=keep, keep_uses_batch=True,
                   keep_reads_aux=True, separable_keep=SeparableKeep(equal, _query_ids, _key_ids))
    aux = (document_ids, 70)
    exact = build_block_map(replace(mod, separable_keep=None), aux, 2, 1, n, m, *tiles, DEVICE).kind
    separable = torch.full_like(exact, -1)
    launch_separable_kinds(separable, mod.separable_keep, aux, n, m, *tiles, tiles=program)
    assert torch.equal(separable == FULL_KIND, exact == FULL_KIND)
    assert not (separable == EMPTY_KIND)[exact != EMPTY_KIND].any()
    if sort and n == m:
        # Sorted, the two sides' ids are the same sequence: a tile whose ranges meet holds an equal pair.
        assert torch.equal(separable, exact)


def cross_documents(q, k, v, q_ids, kv_ids):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(q_ids[:, None, :, None] != kv_ids[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def per_head_documents(q, k, v, ids):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(ids[:, :, :, None] != ids[:, :, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def same_flag(q, k, v, flags):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = torch.where(flags[:, None, :, None] == flags[:, None, None, :], s, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("form", ["cross", "per head", "bool"])
def test_other_separable_forms(form):
    """Ids of queries and keys from two tensors of their own lengths (cross-attention), ids per head (the map
    then has a head axis), and bools compared."""
    torch.manual_seed(0)
    q = random_tensor((B, H, N, D), torch.float32)
    kv_len = N + 8 if form == "cross" else N
    k, v = (random_tensor((B, H, kv_len, D), torch.float32) for _ in range(2))
    if form == "cross":
        fn, ids = cross_documents, (sorted_ids(3), torch.sort(torch.randint(0, 3, (B, kv_len), device=DEVICE)).values)
    elif form == "per head":
        fn, ids = per_head_documents, (torch.sort(torch.randint(0, 4, (B, H, N), device=DEVICE)).values,)
    else:
        fn, ids = same_flag, (torch.rand(B, N, device=DEVICE) > 0.5,)
    check(fn, q, k, v, *ids, backward=True, rtol=1e-4, atol=1e-4)
    mod = last_attention().mod
    assert mod.separable_keep is not None and mod.keep_uses_head == (form == "per head")
