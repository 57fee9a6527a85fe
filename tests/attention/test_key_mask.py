"""Masks of the keys alone (`attention.key_mask`): which attentions have one (padding from lengths or from a mask
tensor; not a causal mask joined with it, document ids, an additive float mask, a finite fill, dropout), each key's
keep evaluated per call against eager's mask, and a training step sending its backward to the sm_90 kernel with that
keep (here a stand-in: the kernel runs on an sm_90 GPU only, tests/flash/test_hopper_backward.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from support import DEVICE, random_tensor, sm90_backward_stand_in, spec_of

from fusepass.attention.key_mask import kept_keys, key_masked

B, H, T, D = 3, 2, 37, 16


def scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def from_lengths(q, k, v, lengths):
    keep = torch.arange(k.shape[-2], device=q.device)[None, :] < lengths[:, None]
    s = scores(q, k).masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def from_mask_tensor(q, k, v, mask):  # 1 where a token is real, 0 where padding, as tokenizers give it
    return torch.softmax(scores(q, k).masked_fill(mask[:, None, None, :] == 0, float("-inf")), dim=-1) @ v


def causal_and_padded(q, k, v, lengths):
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (i[None, :] <= i[:, None])[None] & (i[None, :] < lengths[:, None])[:, None, :]
    return torch.softmax(scores(q, k).masked_fill(~keep[:, None], float("-inf")), dim=-1) @ v


def documents(q, k, v, ids):
    s = scores(q, k).masked_fill(ids[:, None, :, None] != ids[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def additive(q, k, v, mask):  # BERT's: (1 - mask) · finfo.min added, a bias rather than a keep
    bias = (1.0 - mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(scores(q, k) + bias, dim=-1) @ v


def finite_fill(q, k, v, mask):  # a row's scores near the fill would weigh it
    return torch.softmax(scores(q, k).masked_fill(mask[:, None, None, :] == 0, -1e9), dim=-1) @ v


def dropped(q, k, v, mask):
    return F.dropout(torch.softmax(scores(q, k).masked_fill(mask[:, None, None, :] == 0, float("-inf")), dim=-1),
                     p=0.25) @ v


def qkv(dtype=torch.float32):
    return [random_tensor((B, H, T, D), dtype) for _ in range(3)]


def lengths():
    return torch.tensor([T, 1, 20], device=DEVICE)


def mask():
    keep = torch.rand(B, T, device=DEVICE) < 0.7
    keep[:, 0] = True  # every row keeps a key: the finite fill's rows stay away from it
    return keep.long()


@pytest.mark.parametrize("fn, extra, keyed", [
    (from_lengths, lengths, True), (from_mask_tensor, mask, True),
    (causal_and_padded, lengths, False), (documents, lambda: torch.randint(0, 3, (B, T), device=DEVICE), False),
    (additive, mask, False), (finite_fill, mask, False), (dropped, mask, False)],
    ids=["lengths", "mask-tensor", "causal-and-padded", "documents", "additive", "finite-fill", "dropout"])
def test_masks_of_the_keys_alone_are_found(fn, extra, keyed):
    """Each computes eager's function, forward and backward; the spec says whether its mask is of the keys alone."""
    # (dropout's elements dropped are not eager's to compare: the form alone is checked)
    assert key_masked(spec_of(fn, *qkv(), extra(), exact=fn is not dropped)) == keyed


@triton.jit
def _keep_below_length(b, h, q_idx, kv_idx, aux):
    return kv_idx < tl.load(aux[0] + b)


@triton.jit
def _keep_from_mask(b, h, q_idx, kv_idx, aux):
    return tl.load(aux[0] + b * aux[1] + kv_idx) != 0


@pytest.mark.parametrize("kv_len, block", [(300, 128), (37, 16), (256, 128)])
def test_each_keys_keep_and_the_blocks_a_backward_walks(kv_len, block):
    """`kept_keys` at lengths no block divides: a key's keep is eager's mask; a block is walked where it keeps a key,
    or its batch keeps none (whose softmax is NaN, as eager's: the backward must not skip it)."""
    device = torch.device(DEVICE)
    length = torch.tensor([kv_len, 0, block, 1, kv_len - 1], device=device)
    expected = torch.arange(kv_len, device=device)[None, :] < length[:, None]
    kept, walks = kept_keys(_keep_below_length, (length,), 5, kv_len, block, device)
    assert torch.equal(kept.bool(), expected)
    blocks = triton.cdiv(kv_len, block)
    padded = torch.zeros(5, blocks * block, dtype=torch.bool, device=device)
    padded[:, :kv_len] = expected
    walked = padded.view(5, blocks, block).any(-1) | ~expected.any(-1, keepdim=True)
    assert torch.equal(walks.bool(), walked)
    assert walks[1].all()  # the batch of no key walks all

    mask = torch.rand(5, kv_len, device=device) < 0.05
    kept, walks = kept_keys(_keep_from_mask, (mask.to(torch.int8), kv_len), 5, kv_len, block, device)
    assert torch.equal(kept.bool(), mask)


def test_a_training_steps_backward_takes_the_keys_keep(monkeypatch):
    """A padded attention's backward goes to the sm_90 kernel, where it serves it, with each key's keep and the blocks
    to walk (here a stand-in that fails: the replaced ops run, with a warning, and compute eager's gradients)."""
    length = lengths()
    kept, walks = sm90_backward_stand_in(monkeypatch, from_lengths, *qkv(torch.float16), length)["kept"]
    assert torch.equal(kept.bool(), torch.arange(T, device=DEVICE)[None, :] < length[:, None])
    assert walks.shape == (B, 1) and walks.all()
