"""``torch.ops.fusepass.attention``: the fused attention as a torch.library custom op with its own backward.

The graph calls it with the tensors the user's Q, K and V were viewed from (``layout``), the tensors the
score functions read (``aux``), a seed tensor (dropout) and the name of its ``AttentionSpec``, which holds
everything static: the layouts, the lifted score functions, shapes and dtypes. AOTAutograd sees an opaque
op with a fake implementation and a registered backward (itself a custom op), so the N×N probabilities
never exist, forward or backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fusepass.attention.layout import OperandLayout
from fusepass.attention.lift import Lifted
from fusepass.attention.score_mod import ScoreMod
from fusepass.codegen.modules import load_module
from fusepass.kernels.flash_bwd import flash_attention_backward
from fusepass.kernels.flash_fwd import FlashForwardExtra, flash_attention_forward
from fusepass.report import profile
from fusepass.report.records import Rewrite


@dataclass
class Profiled:
    module: torch.fx.GraphModule  # (q, k, v sources, *aux, *extra inputs) -> the matmul with V's output
    # (the same inputs, the output's gradient) -> their gradients: the unfused backward, traced (the op runs
    # below autograd, where the module could not be differentiated)
    forward_backward: torch.fx.GraphModule | None
    output_shape: tuple[int, ...]  # of the matmul with V (the op's output is laid out [B, H, Nq, D])
    forward: Rewrite
    backward: Rewrite | None
    forward_done: bool = False
    backward_done: bool = False


@dataclass
class AttentionSpec:
    name: str
    q: OperandLayout
    k: OperandLayout
    v: OperandLayout
    lifted: Lifted
    out_dtype: torch.dtype
    dropout_p: float
    aux_strides: list[tuple[int, ...]]
    # FUSEPASS_PROFILE: the replaced ops, which the op is then also given the inputs of (after the aux
    # tensors the score functions read), and the records the times go into.
    unfused: Profiled | None = None
    _mod: ScoreMod | None = field(default=None, repr=False)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        batch, heads, q_len, _ = self.q.size
        return batch, heads * self.q.group, q_len, self.v.size[3]

    @property
    def mod(self) -> ScoreMod:
        """The score functions, compiled on first use (``triton.jit`` reads them from a file)."""
        if self._mod is None:
            module = load_module(self.lifted.source)
            fns = {k: getattr(module, v) for k, v in self.lifted.functions.items()}
            self._mod = ScoreMod(
                name=self.name, score=fns["score"], score_grad=fns["score_grad"], keep=fns.get("keep"),
                fill=fns.get("fill"), fill_grad=fns.get("fill_grad"), fill_bound=self.lifted.fill_bound,
                has_aux_grad=any(self.lifted.aux_needs_grad),
                keep_uses_batch="b" in self.lifted.keep_uses, keep_uses_head="h" in self.lifted.keep_uses,
                keep_reads_aux=self.lifted.keep_reads_aux)
        return self._mod


_specs: dict[str, AttentionSpec] = {}


def register(spec: AttentionSpec) -> str:
    _specs[spec.name] = spec
    return spec.name


def _views(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: list[torch.Tensor]):
    for tensor, strides in zip(aux, spec.aux_strides):
        if tuple(tensor.stride()) != strides:
            raise RuntimeError(f"fusepass attention {spec.name}: a score input has strides {tensor.stride()}, "
                               f"compiled for {strides}")
    return spec.q.view(q), spec.k.view(k), spec.v.view(v)


def _seed(seed: torch.Tensor) -> int:
    return int(seed.item()) if seed.numel() else 0


@torch.library.custom_op("fusepass::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: list[torch.Tensor], seed: torch.Tensor,
              spec: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, H, Nq, D], lse, log of the row sums, rows recomputed without tile skipping)."""
    s = _specs[spec]
    q4, k4, v4 = _views(s, q, k, v, aux)

    def forward():
        return flash_attention_forward(q4, k4, v4, s.mod, tuple(aux[:len(s.aux_strides)]), dropout_p=s.dropout_p,
                                       seed=_seed(seed), out_dtype=s.out_dtype)

    out, lse, extra = forward()
    if s.unfused is not None and not s.unfused.forward_done:
        s.unfused.forward_done = True
        profile.measure(s.unfused.forward, forward, lambda: s.unfused.module(q, k, v, *aux))
    fallback = extra.fallback_rows if extra.fallback_rows is not None else lse.new_empty(0, dtype=torch.int8)
    return out, lse, extra.log_sum, fallback


@attention.register_fake
def _attention_fake(q, k, v, aux, seed, spec):
    s = _specs[spec]
    shape = s.out_shape
    out = q.new_empty(shape, dtype=s.out_dtype)
    lse = q.new_empty(shape[:3], dtype=torch.float32)
    fallback = q.new_empty(shape[:3] if s.lifted.functions.get("keep") else (0,), dtype=torch.int8)
    return out, lse, q.new_empty(shape[:3], dtype=torch.float32), fallback


@torch.library.custom_op("fusepass::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, log_sum: torch.Tensor, fallback: torch.Tensor,
                       aux: list[torch.Tensor], seed: torch.Tensor, spec: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of the sources of q, k, v and of every aux tensor (zeros where none flows)."""
    s = _specs[spec]
    q4, k4, v4 = _views(s, q, k, v, aux)
    read = tuple(aux[:len(s.aux_strides)])
    needs = _aux_needs_grad(s, len(aux))
    extra = FlashForwardExtra(log_sum, fallback if fallback.numel() else None, None)

    def backward():
        # fp32 accumulators for the aux tensors a gradient flows to; an empty stand-in for the others
        aux_grad = tuple(torch.zeros(a.shape, dtype=torch.float32, device=a.device) if n else a.new_empty(0)
                         for a, n in zip(read, needs))
        return flash_attention_backward(grad_out, q4, k4, v4, out, lse, extra, s.mod, read, aux_grad,
                                        dropout_p=s.dropout_p, seed=_seed(seed)), aux_grad

    (dq4, dk4, dv4), aux_grad = backward()
    if s.unfused is not None and s.unfused.backward is not None and not s.unfused.backward_done:
        s.unfused.backward_done = True
        profile.measure_backward(s.unfused.backward, backward,
                                 lambda: s.unfused.forward_backward(q, k, v, *aux,
                                                                    grad_out.reshape(s.unfused.output_shape)),
                                 s.unfused.forward.measured_unfused_ms or 0.0)
    grads = []
    for source, layout, grad4 in ((q, s.q, dq4), (k, s.k, dk4), (v, s.v, dv4)):
        # The layout's strides are the source's: the gradient takes them too.
        grad = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device=source.device)
        if not layout.covers(source):
            grad.zero_()
        layout.view(grad).copy_(grad4)
        grads.append(grad)
    aux_grads = [g.to(a.dtype) for g, a in zip(aux_grad, read)] + [a.new_empty(0) for a in aux[len(read):]]
    return grads[0], grads[1], grads[2], aux_grads


def _aux_needs_grad(spec: AttentionSpec, count: int) -> list[bool]:
    """Which aux inputs get a gradient: those the score functions read and a gradient flows to (the
    inputs only profiling passes get none)."""
    needs = list(spec.lifted.aux_needs_grad)
    return needs + [False] * (count - len(needs))


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, log_sum, fallback, aux, seed, spec):
    needs = _aux_needs_grad(_specs[spec], len(aux))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            [torch.empty_like(a) if n else a.new_empty(0) for a, n in zip(aux, needs)])


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, aux, seed, spec = inputs
    out, lse, log_sum, fallback = output
    ctx.save_for_backward(q, k, v, out, lse, log_sum, fallback, seed, *aux)
    ctx.spec = spec


def _backward(ctx: Any, grad_out: torch.Tensor, *unused: Any):
    q, k, v, out, lse, log_sum, fallback, seed, *aux = ctx.saved_tensors
    dq, dk, dv, daux = attention_backward(grad_out.contiguous(), q, k, v, out, lse, log_sum, fallback, list(aux),
                                          seed, ctx.spec)
    return dq, dk, dv, [g if g.numel() else None for g in daux], None, None


attention.register_autograd(_backward, setup_context=_setup_context)
