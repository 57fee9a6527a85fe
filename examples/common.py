"""What every example shares: pick the device (Triton's interpreter on a machine without CUDA), time a
function on the GPU, print a before/after line."""
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


def compare(name: str, eager, fused, *args) -> None:
    expected, actual = eager(*args), fused(*args)
    error = ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
    if ON_GPU:
        t_eager, t_fused = milliseconds(eager, *args), milliseconds(fused, *args)
        print(f"{name}: eager {t_eager:.3f} ms, fusepass {t_fused:.3f} ms "
              f"({t_eager / t_fused:.1f}x), relative error {error:.1e}")
    else:
        print(f"{name}: relative error {error:.1e} (no GPU here: kernels ran in Triton's interpreter, "
              "untimed)")
