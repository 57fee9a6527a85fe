"""Triton's interpreter converts float32 to bfloat16 by cutting the mantissa (toward zero) where the GPU rounds to
the nearest even value: a conversion without a rounding mode (`x.to(tl.bfloat16)`, the weights for their product
with V, an output's store) is biased toward zero on the CPU alone, and bf16 results there lean away from eager's,
which rounds to nearest. `round_to_nearest()` makes the interpreter's conversion the GPU's; an explicit
round-toward-zero (`fp_downcast_rounding="rtz"`) stays a cut."""
from __future__ import annotations

import numpy as np
import torch


def round_to_nearest() -> None:
    """The interpreter's float32 -> bfloat16 conversion, rounded to nearest even as the GPU's (once per process)."""
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    cut = interpreter._convert_float
    if getattr(cut, "rounds_to_nearest", False):
        return

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != ir.ROUNDING_MODE.RTZ:
            rounded = torch.from_numpy(np.ascontiguousarray(values).view(np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16)
        return cut(values, input_dtype, output_dtype, rounding_mode)

    convert.rounds_to_nearest = True
    interpreter._convert_float = convert
