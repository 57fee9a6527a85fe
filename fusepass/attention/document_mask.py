"""Document ids (a key kept where its id equals the query's, or where it differs): which attentions have them, and
each row's and key's id evaluated per call.

An attention whose scores are a positive constant times q · k, with a -inf fill where a separable keep does not hold
(``rows(b, q) == cols(b, kv)``, or ``!=``; `lift.values.Separable`), alone or joined with a causal mask (packed
documents), computes softmax(q kᵀ · scale + bias) v with a bias of 0 or -inf from the two sides' ids (and the
positions): the sm_90 backward serves it
(`hopper_backward.DocumentIds`), reading each side's ids that `document_ids` writes from the call's aux tensors and
walking the block map's lists of q blocks per kv block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepass.attention.key_mask import scaled_and_masked
from fusepass.attention.plan import AttentionSpec
from fusepass.attention.sdpa_floor import sdpa_causal
from fusepass.runtime.launch import launch

_BLOCK = 256  # ids a program of `_ids_kernel`


def document_masked(spec: AttentionSpec) -> bool:
    """Whether `spec` is `key_mask.scaled_and_masked` with a separable keep, the same for every head, alone or joined
    with a mask of the positions alone (a causal mask: packed documents), which a call checks is causal at its
    lengths (`documents_causal`)."""
    separable = spec.lifted.separable
    return (scaled_and_masked(spec) and separable is not None and not separable.inverted
            and "h" not in spec.lifted.keep_uses and separable.others_uses <= {"q", "k"})


def documents_causal(separable, aux: tuple, q_len: int, kv_len: int, device: torch.device) -> bool | None:
    """Of a `document_masked` spec's separable keep (`ScoreMod.separable_keep`): False where no other mask is joined
    with the ids, True where the one joined is the causal mask at these lengths (`sdpa_floor.sdpa_causal`, one
    evaluation of it), else None."""
    if separable.others is None:
        return False
    return sdpa_causal(separable.others.keep, aux, q_len, kv_len, device) or None


@triton.jit(do_not_specialize=["n"])
def _ids_kernel(Ids, n, aux, SIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Ids[b, i] = SIDE(b, 0, i, aux) as int64 (head 0: the keep does not vary with it). Program (block, batch)."""
    b = tl.program_id(1)
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    ids = SIDE(b, 0, tl.minimum(at, n - 1), aux).to(tl.int64)
    tl.store(Ids + b * n + at, ids, mask=inside)


def document_ids(separable, aux: tuple, batch: int, q_len: int, kv_len: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the q rows' ids [batch, q_len], the keys' [batch, kv_len]), int64, of a `document_masked` spec's separable
    keep (`ScoreMod.separable_keep`) from this call's `aux` (`AttentionSpec.kernel_aux`); `batch` 1 where the keep
    does not vary with it."""
    rows = torch.empty(batch, q_len, dtype=torch.int64, device=device)
    cols = torch.empty(batch, kv_len, dtype=torch.int64, device=device)
    for ids, side, n in ((rows, separable.rows, q_len), (cols, separable.cols, kv_len)):
        launch(_ids_kernel, (triton.cdiv(n, _BLOCK), batch), ids, n, aux, SIDE=side, BLOCK=_BLOCK)
    return rows, cols
