"""The ops an attention rewrite replaced, kept at hand: what runs if its kernels fail to build or run (a warning and
a hotspot; ``strict`` raises), and what ``FUSEPASS_PROFILE`` times the kernels against."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from fusepass.report import profile
from fusepass.report.records import Rewrite


@dataclass
class Unfused:
    """The ops the rewrite replaced, as a module of the op's inputs (q, k, v sources, aux, then anything
    else they read): what runs if the kernels fail (a warning and a hotspot; ``strict`` raises), and what
    ``FUSEPASS_PROFILE`` times the kernels against."""

    module: torch.fx.GraphModule  # -> (the matmul with V's output,)
    requires_grad: list[bool]  # per op input
    output_shape: tuple[int, ...]  # of the matmul with V
    out_perm: tuple[int, ...] | None  # its einsum order (the op's output is [B, H, Nq, D])
    on_failure: Callable[[Exception, str], None]  # (the error, "forward" or "backward")
    forward_record: Rewrite
    backward_record: Rewrite | None
    failed: bool = False
    # FUSEPASS_PROFILE as the rewrite found it: asked once, not on every call
    profiling: bool = field(default_factory=profile.requested)
    profiled_forward: bool = False
    profiled_backward: bool = False

    def fail(self, error: Exception, phase: str) -> None:
        """The kernels failed: report it (``strict`` raises here, and every later call tries the kernels again)
        and run the replaced ops from now on."""
        self.on_failure(error, phase)
        self.failed = True

    def to_canonical(self, out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The module's output laid out as the op's: [B, H, Nq, D], contiguous."""
        if self.out_perm is not None:
            out = out.permute([self.out_perm.index(i) for i in range(out.dim())])
        return out.reshape(shape).contiguous()

    def from_canonical(self, grad: torch.Tensor) -> torch.Tensor:
        """The op's output gradient laid out as the module's output."""
        if self.out_perm is None:
            return grad.reshape(self.output_shape)
        canonical = [0] * len(self.output_shape)
        for i, p in enumerate(self.out_perm):
            canonical[p] = self.output_shape[i]
        return grad.reshape(canonical).permute(self.out_perm)

    def forward(self, inputs: tuple[torch.Tensor, ...], seed: int) -> torch.Tensor:
        """The module's output; its random draws (dropout) seeded by the op's seed, so that the backward's
        second run draws the same."""
        devices = sorted({torch.cuda._utils._get_device_index(x.device) for x in inputs if x.is_cuda})
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            for index in devices:  # only the generators fork_rng restores
                torch.cuda.default_generators[index].manual_seed(seed)
            return self.module(*inputs)[0]

    def gradients(self, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, seed: int
                  ) -> list[torch.Tensor | None]:
        """Gradients of every input (None where none flows): the module run again under autograd."""
        with autograd_enabled():
            xs = [x.detach().requires_grad_(needs) for x, needs in zip(inputs, self.requires_grad)]
            wanted = [x for x in xs if x.requires_grad]
            found = iter(torch.autograd.grad(self.forward(tuple(xs), seed), wanted, self.from_canonical(grad),
                                             allow_unused=True) if wanted else ())
            return [next(found) if x.requires_grad else None for x in xs]


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Autograd inside a custom op's implementation, which runs below it: views tracked too (ADInplaceOrView),
    which autograd needs of an in-place op on a view, and the attention's layout analysis of every view."""
    excluded = torch._C._dispatch_tls_local_exclude_set() - torch._C.DispatchKeySet(
        torch._C.DispatchKey.AutogradFunctionality) - torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), \
            torch.enable_grad():
        yield


def with_strides(value: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """`value` laid out with `stride` (a copy where it is not): the layout a fake implementation promised, which
    the graph around the op was traced with."""
    if tuple(value.stride()) == tuple(stride):
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)


def contiguous_strides(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `x`'s shape."""
    return torch.empty(x.shape, device="meta").stride()
