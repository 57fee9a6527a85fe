"""Terms of the distance alone, tabulated (the kernels' distance tables: fusepass/flash/distance_table.py).

Index code tracks which values depend on the positions only through ``k - q``. One that enters E and takes more
than a few statements per score (T5's log-bucketed bias: a log, conversions and a gather) is evaluated once per
call at each distance, into a ``[B, H, Nq + Nk - 1]`` fp32 table the score functions read as one more aux tensor:
the table holds what the same code computes at a valid (q, k) pair of each distance, so the scores do not change.
An element of a learnable table gathered at a function of the distance is read so too, its gradient summed per
distance."""
from __future__ import annotations

from dataclasses import replace

import torch

from fusepass.attention.lift.index_code import IndexCode, jit_function, load_text
from fusepass.attention.lift.sizes import Sizes
from fusepass.attention.lift.values import Canon, Code, GradLeaf
from fusepass.flash.score_mod import DistanceTable

# A value of the distance k - q alone whose code is longer than this many statements is read from a table of
# its values per distance instead (one statement: the distance, an offset and a load, a coalesced read of a
# few hundred bytes per tile). T5's log-bucketed bias takes ~20 statements per score, ALiBi's slope × distance 4.
TABULATE_ABOVE = 8
# Where a distance table's slot in the aux tuple goes: known once every tensor and size the chain reads is.
TABLE_SLOT = "@table{}@"
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # held as fp32: the table stores them exactly


class DistanceTables:
    def __init__(self, canon: Canon, name: str, code: IndexCode, sizes: Sizes) -> None:
        self.canon = canon
        self.sizes = sizes
        self.name = name  # the stem of the tables' functions' names
        self.code = code
        self.tables: list[DistanceTable] = []
        self.sources: list[str] = []  # the jit functions that fill them

    def tabulated(self, code: Code) -> Code | None:
        """A value of the distance k - q alone that enters E, read from a table of its values per distance
        where its own code is longer (T5's bucket: a log, conversions and a gather per score): the table
        holds the very values that code computes, evaluated once per distance."""
        if not (code.relative and {"q", "k"} <= code.uses and code.dtype in TABLE_DTYPES and code.mask is None):
            return None
        if len(self.code.closure(code.expr)) <= TABULATE_ABOVE:
            return None
        table = self._table(code.expr, code.uses)
        if table is None:
            return None
        slot, offset = table
        return Code(self.code.let(load_text(slot, offset, None)), code.dtype, code.uses, span=code.span)

    def gathered(self, index: int, offset: str, mask: str | None, uses: frozenset[str], relative: bool,
                 dtype: torch.dtype) -> GradLeaf | None:
        """An element of a table a gradient flows to, gathered at a function of the distance alone (a learnable
        relative-position bias), read from a table of its values per distance. Its gradient is summed per
        distance there, then added to the table's entries once per distance: per score, the atomic adds spread
        over Nq + Nk - 1 entries per head instead of contending for the few entries of the table."""
        if not (relative and {"q", "k"} <= uses and dtype in TABLE_DTYPES):
            return None
        table = self._table(load_text(index, offset, mask), uses, grad_of=(index, offset))
        if table is None:
            return None
        slot, table_offset = table
        return GradLeaf(index, table_offset, None, uses, slot=slot)

    def _table(self, value: str, uses: frozenset[str], grad_of: tuple[int, str] | None = None
               ) -> tuple[str, str] | None:
        """A table of the index expression `value` (a function of the distance alone) per distance: its slot in
        the aux tuple and the offset that reads it at a tile's positions; None where it would pass 2^31
        entries. `grad_of`: (aux index, offset) of the tensor element `value` loads, where its gradient is
        summed per distance and then added there."""
        c = self.canon
        batch, heads = (c.batch if "b" in uses else 1), (c.heads if "h" in uses else 1)
        distances = c.q_len + c.kv_len - 1
        if batch * heads * distances >= 2 ** 31:
            return None
        t = len(self.tables)
        # Evaluated at a valid (q, k) pair of each distance: what the code reads tensors at.
        at_distance = ["q_idx = tl.maximum(-r, 0)", "kv_idx = tl.maximum(r, 0)"]
        table = DistanceTable(f"{self.name}_distance{t}", batch, heads, c.q_len, c.kv_len)
        self.sources.append(jit_function(table.function, "r, b, h, aux", at_distance + self.code.closure(value),
                                         f"return ({value}).to(tl.float32)"))
        if grad_of is not None:
            table = replace(table, grad_of=grad_of[0], offset_function=f"{table.function}_offset")
            self.sources.append(jit_function(table.offset_function, "r, b, h, aux",
                                             at_distance + self.code.closure(grad_of[1]), f"return {grad_of[1]}"))
        self.tables.append(table)
        # The terms along the key axis first: they add per position vector, then one subtraction per score.
        start = [self.sizes.text(c.q_len - 1)] + [f"h * {self.sizes.text(distances)}"] * (heads > 1) + \
            [f"b * {self.sizes.text(heads * distances)}"] * (batch > 1)
        return TABLE_SLOT.format(t), f"((kv_idx + ({' + '.join(start)})) - q_idx)"

    def placed(self, source: str, aux_count: int) -> str:
        """`source` with each table's slot in the aux tuple: after its first `aux_count` entries (the tensors the
        chain reads and the sizes)."""
        for t in range(len(self.tables)):
            source = source.replace(TABLE_SLOT.format(t), str(aux_count + t))
        return source
