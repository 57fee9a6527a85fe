"""A mask of the keys alone (padding): which attentions have one, and its keep per key, evaluated per call.

An attention whose scores are a positive constant times q · k, with a -inf fill where a keep that varies with the
batch and the key position alone (a padding mask read from lengths or a mask tensor) does not hold, computes
softmax(q kᵀ · scale + bias) v with a bias per (batch, key) of 0 or -inf: the sm_90 backward serves it
(`hopper_backward`), reading one byte per key that `kept_keys` writes from the call's aux tensors, and skipping
the key blocks that keep none.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusepass.attention.plan import AttentionSpec
from fusepass.runtime.launch import launch


def scaled_and_masked(spec: AttentionSpec) -> bool:
    """Whether `spec`'s function is softmax(q kᵀ · scale, where its keep holds, else -inf) v, eager's weights rounded
    once (no dropout, no tables, no gradient to what the keep reads): the sm_90 backward's form after the Triton
    forward, whatever the keep."""
    lifted = spec.lifted
    return ("keep" in lifted.functions and lifted.linear_scale is not None and lifted.fill_bound == -math.inf
            and not lifted.tables and not spec.dropout_p and not any(lifted.aux_needs_grad))


def key_masked(spec: AttentionSpec) -> bool:
    """Whether `spec` is `scaled_and_masked` with a keep of the batch and key positions alone."""
    lifted = spec.lifted
    return (scaled_and_masked(spec) and lifted.separable is None and "k" in lifted.keep_uses
            and lifted.keep_uses <= {"b", "k"})


@triton.jit(do_not_specialize=["kv_len"])
def _kept_keys_kernel(Kept, Walks, kv_len, aux, KEEP: tl.constexpr, BLOCK: tl.constexpr):
    """Kept[b, key] = KEEP at (b, key), 1 or 0 (query position and head 0: the keep varies with neither); Walks[b,
    block of BLOCK keys] 1 where the block keeps a key or the batch none (its rows' softmax is NaN, as eager's: a
    backward that skips a block keeping no key would give its keys a gradient of 0 instead). Program: a batch."""
    b = tl.program_id(0)
    n_blocks = tl.cdiv(kv_len, BLOCK)
    any_kept = tl.full([], 0, tl.int32)
    for block in range(n_blocks):
        keys = block * BLOCK + tl.arange(0, BLOCK)[None, :]
        inside = keys < kv_len
        kept = KEEP(b, 0, tl.zeros([1, 1], tl.int32), tl.minimum(keys, kv_len - 1), aux) & inside
        tl.store(Kept + b * kv_len + keys, kept.to(tl.int8), mask=inside)
        walk = tl.max(kept.to(tl.int32))
        tl.store(Walks + b * n_blocks + block, walk.to(tl.int8))
        any_kept = tl.maximum(any_kept, walk)
    if any_kept == 0:
        for block in range(n_blocks):
            tl.store(Walks + b * n_blocks + block, tl.full([], 1, tl.int8))


def kept_keys(keep, aux: tuple, batch: int, kv_len: int, block: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """([batch, kv_len] int8: 1 where `keep`, the score functions' keep of a `key_masked` spec, holds for the key;
    [batch, blocks of `block` keys] int8: 1 where a backward walks the block, see `_kept_keys_kernel`), from this
    call's `aux` (`AttentionSpec.kernel_aux`); `batch` 1 where the keep does not vary with it."""
    kept = torch.empty(batch, kv_len, dtype=torch.int8, device=device)
    walks = torch.empty(batch, triton.cdiv(kv_len, block), dtype=torch.int8, device=device)
    launch(_kept_keys_kernel, (batch,), kept, walks, kv_len, aux, KEEP=keep, BLOCK=block)
    return kept, walks
