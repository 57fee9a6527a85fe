"""What every example shares: pick the device (Triton's interpreter on a machine without CUDA), time eager
against fusepass on the GPU, print the report."""
from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Without a GPU the kernels run through Triton's interpreter: slow, so the examples shrink.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if ON_GPU else "cpu"


def milliseconds(fn, *args) -> float:
    """Median time of ``fn(*args)`` on the GPU, after warm-up."""
    import triton.testing

    return triton.testing.do_bench(lambda: fn(*args), warmup=100, rep=500, return_mode="median")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def compare(name: str, eager, fused, *args, backward: bool = False) -> None:
    """Check ``fused`` against ``eager`` on ``args``; on a GPU time both (forward, and forward+backward)."""
    import fusepass

    fusepass.reset()
    expected, actual = eager(*args), fused(*args)
    print(f"{name}: relative error {relative_error(actual, expected):.1e}")
    if ON_GPU:
        t_eager, t_fused = milliseconds(eager, *args), milliseconds(fused, *args)
        print(f"  forward:          eager {t_eager:8.3f} ms   fusepass {t_fused:8.3f} ms   {t_eager / t_fused:5.1f}x")
        if backward:
            grad = torch.randn_like(expected)
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

            def step(fn):
                return lambda: torch.autograd.grad(fn(*args), inputs, grad)

            t_eager, t_fused = milliseconds(step(eager)), milliseconds(step(fused))
            print(f"  forward+backward: eager {t_eager:8.3f} ms   fusepass {t_fused:8.3f} ms   "
                  f"{t_eager / t_fused:5.1f}x")
    else:
        print("  (no GPU here: kernels ran in Triton's interpreter at a small size, untimed)")
    for report in fusepass.reports():
        print(report)


def qkv(batch: int, heads: int, length: int, head_dim: int, kv_heads: int | None = None,
        dtype: torch.dtype = torch.bfloat16):
    """Random Q, K, V in [B, H, N, D] that require gradients."""
    dtype = dtype if ON_GPU else torch.float32
    shapes = [(batch, heads, length, head_dim)] + [(batch, kv_heads or heads, length, head_dim)] * 2
    return [torch.randn(s, device=DEVICE, dtype=dtype, requires_grad=True) for s in shapes]


def size(gpu: int, cpu: int) -> int:
    return gpu if ON_GPU else cpu
