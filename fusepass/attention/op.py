"""``torch.ops.fusepass.attention``: the fused attention as a torch.library custom op with its own backward.

The graph calls it with the tensors the user's Q, K and V were viewed from (``layout``), the tensors the
score functions read (``aux``), a seed tensor (dropout) and the name of its spec (``plan.AttentionSpec``), which
holds everything static: the layouts, the lifted score functions, shapes and dtypes. AOTAutograd sees an opaque
op with a fake implementation and a registered backward (itself a custom op), so the N×N probabilities
never exist, forward or backward. What runs is `call.AttentionCall`'s.
"""
from __future__ import annotations

from typing import Any

import torch

from fusepass.attention.call import Outputs, call_named
from fusepass.attention.unfused import with_strides


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: list[torch.Tensor], seed: torch.Tensor,
                  spec: str) -> Outputs:
    return call_named(spec).forward(q, k, v, aux, seed)


def run_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, log_sum: torch.Tensor, fallback: torch.Tensor,
                           residual: torch.Tensor, block_map: list[torch.Tensor], aux: list[torch.Tensor],
                           seed: torch.Tensor, spec: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return call_named(spec).backward(grad_out, q, k, v, out, lse, log_sum, fallback, residual, block_map, aux, seed)


# The ops' implementations are also called directly by the compiled graphs (fusepass/runnable.py).
attention = torch.library.custom_op("fusepass::attention", run_attention, mutates_args=())
attention_backward = torch.library.custom_op("fusepass::attention_backward", run_attention_backward,
                                            mutates_args=())


@attention.register_fake
def _attention_fake(q, k, v, aux, seed, spec):
    call = call_named(spec)
    s = call.spec
    shape = s.out_shape
    b, h, n, d = shape
    out = q.new_empty((b, n, h, d), dtype=s.out_dtype).transpose(1, 2) if s.out_by_position else \
        q.new_empty(shape, dtype=s.out_dtype)
    lse = q.new_empty(shape[:3], dtype=torch.float32)
    fallback = q.new_empty(s.fallback_shape, dtype=torch.int8)
    block_map = [q.new_empty(shape, dtype=torch.int32) for shape in call.map_shapes(q)]
    residual = torch.empty_like(out) if call.keeps_residual() else out.new_empty(0)
    return out, lse, q.new_empty(shape[:3], dtype=torch.float32), fallback, residual, block_map


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, log_sum, fallback, residual, block_map, aux, seed, spec):
    s = call_named(spec).spec
    needs = s.aux_needs_grad(len(aux))
    # As `AttentionCall.backward` lays them out: the sources' strides (the kernels write through the op's views of
    # them; one source's gradient in its first reader's place where they share a buffer), the aux gradients
    # contiguous.
    return (*(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) if owner == i
              else x.new_empty(0) for i, (x, owner) in enumerate(zip((q, k, v), s.gradient_owners))),
            [a.new_empty(a.shape) if n else a.new_empty(0) for a, n in zip(aux, needs)])


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, aux, seed, spec = inputs
    out, lse, log_sum, fallback, residual, block_map = output
    ctx.save_for_backward(q, k, v, out, lse, log_sum, fallback, residual, seed, *block_map, *aux)
    ctx.spec = spec


def _backward(ctx: Any, grad_out: torch.Tensor, *unused: Any):
    q, k, v, out, lse, log_sum, fallback, residual, seed, *rest = ctx.saved_tensors
    n_map = 1 if call_named(ctx.spec).spec.passes_map else 0
    block_map, aux = rest[:n_map], rest[n_map:]
    s = call_named(ctx.spec).spec
    # The output's gradient laid out as the output (the kernels read both alike): no copy where it arrives so.
    dq, dk, dv, daux = attention_backward(with_strides(grad_out, out.stride()), q, k, v, out, lse, log_sum, fallback,
                                          residual, list(block_map), list(aux), seed, ctx.spec)
    # A source read by several of Q, K and V whose views tile it has its gradient in its first reader's place.
    dq, dk, dv = (g if owner == i else None for i, (g, owner) in enumerate(zip((dq, dk, dv), s.gradient_owners)))
    return dq, dk, dv, [g if g.numel() else None for g in daux], None, None


attention.register_autograd(_backward, setup_context=_setup_context)
