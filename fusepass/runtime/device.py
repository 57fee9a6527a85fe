"""Where kernels run: compiled for a CUDA device, or through Triton's interpreter (``TRITON_INTERPRET=1``, set
before fusepass is imported) on the CPU. The one check of which, for host code and for jit code alike."""
from __future__ import annotations

import os

import triton.language as tl


# As fusepass's kernels were made at its import: Triton's decorator chose then whether each runs interpreted, so a
# TRITON_INTERPRET=1 set later cannot run them (each would fail at its first call into a compiled-mode helper).
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    return _INTERPRETING


def interpreter_asked_late() -> bool:
    """Whether TRITON_INTERPRET=1 was set after fusepass was imported (it is not in effect)."""
    return not _INTERPRETING and os.environ.get("TRITON_INTERPRET") == "1"


# The same for jit code, where branches on it compile away: the interpreter's quirks are worked around only
# there (its bf16 dots multiply bit patterns, triton-lang/triton#11584; it truncates fp32 → bf16 instead of
# rounding).
INTERPRETED = tl.constexpr(interpreting())
