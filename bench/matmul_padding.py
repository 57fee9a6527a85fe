"""An unaligned GEMM as cuBLAS runs it, and padded to aligned sizes (the pads included), side by side: the premise
of `fusepass/matmul/pad.py` on the running GPU, at GPT-2's LM head (8192 × 768 @ 768 × 50257) and its backward.

    PYTHONPATH=. python bench/matmul_padding.py
"""
from __future__ import annotations

import torch
from harness import keep, median_ms

from fusepass.matmul.pad import _aligned, padded_matmul

CASES = [  # (name, M, K, N): out[M, N] = a[M, K] @ b[K, N]
    ("LM head forward", 8192, 768, 50257),
    ("LM head dW", 50257, 8192, 768),
    ("LM head dX", 8192, 50257, 768),
    ("FFN 5461 up", 8192, 2048, 5461),
    ("FFN 5461 down", 8192, 5461, 2048),
    ("aligned", 8192, 768, 50304),
]


def main() -> None:
    rows = []
    for name, m, k, n in CASES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        pads = tuple(_aligned(d, torch.bfloat16) - d for d in (m, k, n))
        as_is = median_ms(lambda: a @ b)
        padded = median_ms(lambda: padded_matmul(None, a, b, pads))
        error = ((padded_matmul(None, a, b, pads).float() - (a @ b).float()).abs().max()).item()
        rows.append({"case": name, "M": m, "K": k, "N": n, "pads (m, k, n)": str(pads), "as is ms": as_is,
                     "padded ms": padded, "speedup": as_is / padded, "max |difference|": error})
    print(keep("matmul-padding", list(rows[0]), rows))


if __name__ == "__main__":
    main()
