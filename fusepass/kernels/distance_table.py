"""Values of the distance k - q alone, tabulated once per call for the flash kernels to read.

A score term that depends on the query and key positions only through their distance (T5's log-bucketed
relative bias: a log, two conversions and a gather per score) takes Nq + Nk - 1 values per batch and head
instead of Nq · Nk; the lifted score functions read it from this table (`fusepass.attention.lift`,
`_tabulated`). The table holds what the same code computes at a (q, k) pair of each distance, so the
scores are the very values the score functions would compute.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepass.attention.score_mod import ScoreMod
from fusepass.kernels.launch import launch

BLOCK = 1024


@triton.jit
def _distance_table_kernel(Table, q_len, n_distances, heads, aux, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    batch_head = tl.program_id(1)
    r = tl.minimum(i, n_distances - 1) - (q_len - 1)  # past the end: the last distance again, not stored
    value = VALUE(r, batch_head // heads, batch_head % heads, aux)
    tl.store(Table + batch_head.to(tl.int64) * n_distances + i, value, mask=i < n_distances)


def distance_tables(mod: ScoreMod, aux: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The tables of `mod`'s values of the distance alone, [batch, heads, Nq + Nk - 1] fp32 each, in the
    order its score functions read them after `aux`."""
    tables = []
    for value, table in mod.tables:
        n_distances = table.q_len + table.kv_len - 1
        out = torch.empty(table.batch, table.heads, n_distances, dtype=torch.float32, device=device)
        launch(_distance_table_kernel, (triton.cdiv(n_distances, BLOCK), table.batch * table.heads), out,
               table.q_len, n_distances, table.heads, aux, VALUE=value, BLOCK=BLOCK)
        tables.append(out)
    return tuple(tables)
