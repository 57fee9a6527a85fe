"""The sizes the score functions read: a loaded tensor's strides and the bounds of its positions, a gathered
table's extent, a distance table's offsets. Literals where the attention's sizes are fixed; where they vary (an
attention planned again at each new length under symbolic sizes, `attention/dynamic.py`), run-time values that
follow the tensors in the aux tuple, so that every length's plan has the same source, and with it the same jit
functions and the flash kernels compiled for them (`codegen.modules.load_module`)."""
from __future__ import annotations

# Where a size's slot in the aux tuple goes: known once every tensor the chain reads is.
SIZE_SLOT = "@size{}@"


class Sizes:
    def __init__(self, passed: bool) -> None:
        self.passed = passed  # whether sizes are run-time values
        self.values: list[int] = []  # the run-time values, in their order in the aux tuple

    def text(self, value: int) -> str:
        """Code for the size `value`: the literal, or the next slot of the aux tuple, which holds it at this plan.
        A slot per use, never shared by equal values: the source must not depend on which sizes coincide."""
        if not self.passed:
            return str(value)
        self.values.append(value)
        return f"aux[{SIZE_SLOT.format(len(self.values) - 1)}]"

    def placed(self, source: str, aux_count: int) -> str:
        """`source` with each size's slot in the aux tuple: after the `aux_count` tensors the chain reads."""
        for i in range(len(self.values)):
            source = source.replace(SIZE_SLOT.format(i), str(aux_count + i))
        return source
