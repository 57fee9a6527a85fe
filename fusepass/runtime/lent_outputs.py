"""The gradients a backward replayed whole hands out, lent out of the CUDA graph trees' memory pool rather than
copied, and given memory of their own, before the pool is written again, only where the caller still holds them.

A replay writes the pool again, and the caller may keep a gradient past the next step (accumulated over
micro-batches), as it may keep what eager gives; Inductor's reduce-overhead mode leaves it in the pool, where the
next replay overwrites it. A copy of each gradient after each backward is safe and holds a second set of gradients
beside the pool at the end of each step. Lent instead, a gradient is a tensor on a storage of its own that points into
the pool without owning it (the trees see their own output dead, as after a copy); AccumulateGrad takes it as the
parameter's `.grad` (a `detach` of it: another tensor on the same storage), which a hook after the accumulation notes.
Before the next warm-up, recording or replay on the device (`reclaim`), each of those tensors still alive — the
gradient as lent (`torch.autograd.grad` hands it to the caller), the `.grad` made of it, kept by the parameter or by
the caller past `zero_grad` — gets memory of its own with its values (`set_` onto a copy, its version kept); a view or
`detach` the caller made of one cannot follow (torch 2.11 has no way to move a storage under its tensors) and reads,
from then on, as an error that says so. A training loop that sets its gradients to None before the next forward and
keeps none copies nothing; one that accumulates copies its gradients once a step, at the next forward.

A gradient whose parameter is not known (an input's, not a parameter's) is copied, as before. While anything is lent
the trees' pool is held (one use of it, as a recording holds it), so that a reset of the trees
(`torch._dynamo.reset`) does not give its memory back to CUDA under a kept gradient.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

# On since its GPU suite passed (bench/NOTES.md, item 000); off, each gradient is copied out of the pool after each
# backward, as before (a step then holds its gradients twice).
LEND_GRADIENTS = True

OVERWRITTEN = ("fusepass: this tensor views a gradient that a replayed backward handed out and the next replay "
               "overwrote; the parameter's .grad itself is kept, a view or detach of it is not: clone it to keep it")


@dataclass
class _Loan:
    storage: StorageWeakRef  # the lent gradient's storage, over the pool
    tensors: list[weakref.ref]  # the tensors on it: the gradient as lent, then the .grad AccumulateGrad made of it


@dataclass
class _LentOnDevice:
    loans: dict[int, _Loan] = field(default_factory=dict)  # by the lent storage's cdata
    pools: set[tuple[int, int]] = field(default_factory=set)  # the trees' pools held while anything is lent


_lent: dict[int, _LentOnDevice] = {}
# The parameters whose accumulated gradients `_note_accumulated` looks at (keyed by identity: a tensor's == is
# elementwise).
_watched: WeakIdKeyDictionary = WeakIdKeyDictionary()


def lend(gradients: Sequence[Any], leaves: Mapping[int, weakref.ref], device_index: int) -> list:
    """The `gradients` a backward's replay gave (in the pool of the calling thread's trees on CUDA device
    `device_index`), each lent where `leaves` knows, at its position, the parameter it is the gradient of (the
    forward's argument there) and `LEND_GRADIENTS` is on, copied otherwise."""
    lent = _lent.setdefault(device_index, _LentOnDevice())
    handed = []
    for i, gradient in enumerate(gradients):
        if isinstance(gradient, torch.Tensor):
            ref = leaves.get(i)
            leaf = None if ref is None else ref()
            if LEND_GRADIENTS and _is_gradient_of(gradient, leaf):
                gradient = _on_a_storage_of_its_own(gradient)
                storage = gradient.untyped_storage()
                lent.loans[storage._cdata] = _Loan(StorageWeakRef(storage), [weakref.ref(gradient)])
                _watch(leaf)
            else:
                gradient = gradient.clone()
        handed.append(gradient)
    if lent.loans:
        pool = _trees_pool(device_index)
        if pool is not None and pool not in lent.pools:
            _hold(device_index, pool)
            lent.pools.add(pool)
    return handed


def reclaim(device_index: int) -> None:
    """Give each gradient lent on the device and still held memory of its own, with its values: the pool is about
    to be written. Nothing is lent afterwards, and the pools held for it are let go."""
    lent = _lent.get(device_index)
    if lent is None:
        return
    for loan in lent.loans.values():
        for ref in loan.tensors:
            if loan.storage.expired():
                break
            tensor = ref()
            if tensor is not None and tensor.untyped_storage()._cdata == loan.storage.cdata:
                _move(tensor)
        if not loan.storage.expired():  # held elsewhere, as a view or a detach
            # Its memory is the trees' (the lent storage owns none, so nothing is freed): it only stops reading it.
            torch._C._set_storage_data_ptr_access_error_msg(loan.storage.cdata, OVERWRITTEN)
    lent.loans.clear()
    for pool in lent.pools:
        torch._C._cuda_releasePool(device_index, pool)
    lent.pools.clear()


def _watch(leaf: torch.Tensor) -> None:
    if leaf not in _watched:
        _watched[leaf] = leaf.register_post_accumulate_grad_hook(_note_accumulated)


def _note_accumulated(leaf: torch.Tensor) -> None:
    """After AccumulateGrad: where it took a lent gradient as `leaf.grad`, that tensor is on the loan too."""
    grad = leaf.grad
    if grad is None or not _lent:
        return
    cdata = grad.untyped_storage()._cdata
    for lent in _lent.values():
        loan = lent.loans.get(cdata)
        if loan is not None:
            loan.tensors.append(weakref.ref(grad))


def _is_gradient_of(gradient: torch.Tensor, leaf: Any) -> bool:
    return (isinstance(leaf, torch.Tensor) and leaf.is_leaf and leaf.requires_grad and gradient.numel() > 0
            and gradient.shape == leaf.shape and gradient.dtype == leaf.dtype and gradient.device == leaf.device)


def _on_a_storage_of_its_own(output: torch.Tensor) -> torch.Tensor:
    """A tensor viewing `output`'s elements through a storage of its own, which does not own the memory."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(output.shape, output.stride()))
    storage = torch._C._construct_storage_from_data_pointer(output.data_ptr(), output.device,
                                                            extent * output.element_size())
    return output.new_empty(0).set_(storage, 0, output.shape, output.stride())


def _move(grad: torch.Tensor) -> None:
    """`grad` (every handle on this tensor) onto memory of its own holding its values, its version kept: autograd
    would take the move for an in-place write."""
    storage = grad.untyped_storage()
    own = torch.empty(storage.nbytes(), dtype=torch.uint8, device=grad.device).untyped_storage()
    own.copy_(storage)
    version = grad._version
    with torch.no_grad():
        grad.set_(own, grad.storage_offset(), grad.shape, grad.stride())
    torch._C._autograd._unsafe_set_version_counter((grad,), (version,))


def _trees_pool(device_index: int) -> tuple[int, int] | None:
    """The memory pool of the calling thread's trees on the device (None where they do not exist)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    return None if manager is None else manager.cuda_graphs_thread_pool


def _hold(device_index: int, pool: tuple[int, int]) -> None:
    """One use of the trees' `pool` more (released by `reclaim`): a pool in use keeps its memory."""
    torch._C._cuda_beginAllocateCurrentThreadToPool(device_index, pool)
    torch._C._cuda_endAllocateToPool(device_index, pool)
