"""Integer arithmetic of launches on the host: grids, tile counts, padded extents.

Triton's ``cdiv`` and ``next_power_of_2`` are constexpr functions (usable inside kernels too): a host call
unwraps its arguments as constexprs, which costs far more than the arithmetic, and an attention call makes
several of them. These are the same functions in plain Python.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
