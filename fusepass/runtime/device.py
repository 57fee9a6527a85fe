"""Where kernels run: compiled for a CUDA device, or through Triton's interpreter (``TRITON_INTERPRET=1``, read
by Triton when it is imported) on the CPU. The one check of which, for host code and for jit code alike."""
from __future__ import annotations

import os

import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# The same for jit code, where branches on it compile away: the interpreter's quirks are worked around only
# there (its bf16 dots multiply bit patterns, triton-lang/triton#11584; it truncates fp32 → bf16 instead of
# rounding).
INTERPRETED = tl.constexpr(interpreting())
