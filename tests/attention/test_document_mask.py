"""Document ids (`attention.document_mask`): which attentions have them (ids compared equal or unequal, alone or
joined with a causal mask; not a padding mask, not under dropout), each side's ids evaluated per call, whether the
mask joined is causal at a call's lengths, and a training step sending its backward to the sm_90 kernel with them
(here a stand-in: the kernel runs on an sm_90 GPU only, tests/flash/test_hopper_backward.py)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, check, last_attention, random_tensor, sm90_backward_stand_in, spec_of

from fusepass.attention.document_mask import document_ids, document_masked
from fusepass.flash import hopper_backward

B, H, T, D = 2, 2, 37, 16


def scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def documents(q, k, v, ids):
    s = scores(q, k).masked_fill(ids[:, None, :, None] != ids[:, None, None, :], float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def other_documents(q, k, v, ids):  # a key kept where its document is another
    s = scores(q, k).masked_fill(ids[:, None, :, None] == ids[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def packed_causal(q, k, v, ids):
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (ids[:, None, :, None] == ids[:, None, None, :]) & (i[None, :] <= i[:, None])
    return torch.softmax(scores(q, k).masked_fill(~keep, float("-inf")), dim=-1) @ v


def packed_causal_filled(q, k, v, ids):  # the fill where the documents differ or the key is past the query
    i = torch.arange(q.shape[-2], device=q.device)
    dropped = (ids[:, None, :, None] != ids[:, None, None, :]) | (i[None, :] > i[:, None])
    return torch.softmax(scores(q, k).masked_fill(dropped, float("-inf")), dim=-1) @ v


def documents_or_never(q, k, v, ids):  # a constant joined by `|`: its code is a Python bool
    never = torch.zeros((), dtype=torch.bool, device=q.device)
    return torch.softmax(scores(q, k).masked_fill((ids[:, None, :, None] != ids[:, None, None, :]) | never,
                                                  float("-inf")), dim=-1) @ v


def packed_window(q, k, v, ids):  # a mask joined that is not causal
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (ids[:, None, :, None] == ids[:, None, None, :]) & (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 5)
    return torch.softmax(scores(q, k).masked_fill(~keep, float("-inf")), dim=-1) @ v


def padded(q, k, v, ids):
    keep = torch.arange(k.shape[-2], device=q.device)[None, :] < ids[:, :1]
    return torch.softmax(scores(q, k).masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1) @ v


def dropped(q, k, v, ids):
    s = scores(q, k).masked_fill(ids[:, None, :, None] != ids[:, None, None, :], float("-inf"))
    return F.dropout(torch.softmax(s, dim=-1), p=0.25) @ v


def qkv(dtype=torch.float32):
    return [random_tensor((B, H, T, D), dtype) for _ in range(3)]


def ids():
    return torch.sort(torch.randint(0, 4, (B, T), device=DEVICE), dim=-1).values + 10


@pytest.mark.parametrize("fn, expected", [
    (documents, True), (other_documents, True), (packed_causal, True), (packed_causal_filled, True),
    (documents_or_never, True), (packed_window, True), (padded, False), (dropped, False)],
    ids=["documents", "other-documents", "packed-causal", "packed-causal-filled", "documents-or-never",
         "packed-window", "padding", "dropout"])
def test_document_ids_are_found(fn, expected):
    """Each computes eager's function, forward and backward; the spec says whether its mask is of document ids."""
    # (dropout's elements dropped are not eager's to compare: the form alone is checked)
    assert document_masked(spec_of(fn, *qkv(), ids(), exact=fn is not dropped)) == expected


def test_each_sides_ids():
    """`document_ids` of a lifted document mask: each side's ids, the rows' and the keys', as the tensor holds them
    (ids past 2^32 among them), at lengths no block divides."""
    inputs = [*qkv(), ids()]
    check(documents, *inputs, backward=True)
    call = last_attention()
    held = torch.randint(-2**40, 2**40, (B, T), device=DEVICE)
    rows, cols = document_ids(call.mod.separable_keep, call.spec.kernel_aux((held,)), B, T, T, torch.device(DEVICE))
    assert torch.equal(rows, held) and torch.equal(cols, held)


def test_a_training_steps_backward_takes_the_ids(monkeypatch):
    """A document mask's backward goes to the sm_90 kernel, where it serves it, with both sides' ids, the block map at
    its tiles, and which heads hold a row that keeps no key (here a stand-in that fails: the replaced ops run, with a
    warning, and compute eager's gradients)."""
    held = ids()
    held[1, :3] = 99  # a document of three tokens
    called = sm90_backward_stand_in(monkeypatch, documents, *qkv(torch.float16), held)
    found = called["documents"]
    assert called["causal"] is False
    assert torch.equal(found.rows, held) and torch.equal(found.cols, held) and found.equal
    assert (found.block_map.block_m, found.block_map.block_n) == (hopper_backward.BLOCK_M, hopper_backward.BLOCK_N)
    assert found.dense.shape == (B, H) and not found.dense.any()  # every row keeps its own key


def test_packed_documents_backward_takes_the_ids_and_the_causal_mask(monkeypatch):
    """Documents packed for causal training: the sm_90 backward takes the ids with the causal mask, checked causal at
    the call's lengths."""
    held = ids()
    called = sm90_backward_stand_in(monkeypatch, packed_causal, *qkv(torch.float16), held)
    assert called["causal"] is True and torch.equal(called["documents"].cols, held)
    assert last_attention()._documents_causal_at == {(T, T): True}


def test_a_mask_joined_that_is_not_causal_is_not_served(monkeypatch):
    """The ids joined with a window: no causal mask at any length, so the Triton backward serves it (nothing is
    asked of the sm_90 kernel) and the gradients are eager's."""
    monkeypatch.setattr(hopper_backward, "serves", lambda *args: True)
    monkeypatch.setattr(hopper_backward, "available", lambda device: True)
    monkeypatch.setattr(hopper_backward, "hopper_backward", None)  # called, it would fail
    check(packed_window, *qkv(torch.float16), ids(), backward=True)
    assert last_attention()._documents_causal_at == {(T, T): None}


def test_the_joined_mask_is_checked_only_where_the_kernel_can_run():
    """Where the sm_90 kernel cannot run (here: no sm_90 GPU), a training step evaluates nothing of the joined mask."""
    if hopper_backward.available(torch.device(DEVICE)):
        pytest.skip("the sm_90 kernel can run here")
    check(packed_causal, *qkv(), ids(), backward=True)
    assert last_attention()._documents_causal_at == {}
