"""Timings on the running GPU that decide between two ways of computing one thing (a padded matmul or not, the
fused attention or SDPA), on random operands laid out as the graph's."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


_GENERATORS: dict[torch.device, torch.Generator] = {}


def timing_generator(device: torch.device) -> torch.Generator:
    """fusepass's own random generator on `device`. Drawing from the default one would move the user's random
    stream (a compiled program's first call would leave different dropout masks and `randn`s after it than eager
    does), and would fail while another thread captures a CUDA graph: a capture holds the default generator."""
    generator = _GENERATORS.get(device)
    if generator is None:
        generator = _GENERATORS.setdefault(device, torch.Generator(device=device))
    return generator


def random_like(t: torch.Tensor) -> torch.Tensor:
    """Random values in `t`'s shape, strides, dtype and device (a transposed or broadcast operand stays one)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    with unset_fake_temporarily():
        return torch.randn(extent, dtype=t.dtype, device=t.device, generator=timing_generator(t.device)) \
            .as_strided(t.shape, t.stride())


def median_ms(step: Callable[[], object], warmup: int = 5, rep: int = 20) -> float:
    """The median time of `step` on the running GPU, ms (`warmup` and `rep`: ms spent warming up and timing)."""
    import triton.testing

    return triton.testing.do_bench(step, warmup=warmup, rep=rep, return_mode="median")
