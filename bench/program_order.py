"""How much an attention kernel's launch order leaves the GPU idle at its end (causal masks, and the dK/dV kernel
under the suite's document mask): a model, not a measurement.

    python bench/program_order.py

The GPU starts a kernel's programs in launch order, each as soon as a slot (an SM's room for one more program)
frees. Taking each program's time as its tile count, the kernel ends when its last program does; against the
total work spread evenly over the slots, the excess is the tail the order leaves. The flash kernels' grids run
one (batch, head) pair's programs after another (its blocks longest first, for a causal mask); grouping the
pairs (`FlashConfig.head_group`, `fusepass.flash.tiles.grouped_program`) starts long programs of every group early.
Slots: the H200's 132 SMs times the programs one SM holds at the kernels' registers (1 at 8 warps and ~255
registers, 2 at 4 warps).
"""
from __future__ import annotations

import heapq
import random

from harness import keep

SMS = 132


def excess(work: list[int], slots: int) -> float:
    """The kernel's time over the even spread of its work, programs started in the order of `work`."""
    ends = [0] * slots
    for tiles in work:
        heapq.heappush(ends, heapq.heappop(ends) + tiles)
    return max(ends) / (sum(work) / slots) - 1


def launch_order(per_pair: list[int], pairs: int, head_group: int) -> list[int]:
    """Tile counts in launch order: `per_pair` the programs of one pair, in its order; pairs in groups."""
    order = []
    for first in range(0, pairs, head_group):
        for tiles in per_pair:
            order += [tiles] * min(head_group, pairs - first)
    return order


def document_columns(seed: int = 0, n: int = 8192, block: int = 64, documents: int = 8) -> list[int]:
    """Per kv block of a document mask (sorted random ids, as bench/attention.py draws them), the q blocks
    its column lists: those of the documents it holds."""
    generator = random.Random(seed)
    ids = sorted(generator.randrange(documents) for _ in range(n))
    first = {d: ids.index(d) for d in set(ids)}
    last = {d: n - 1 - ids[::-1].index(d) for d in set(ids)}
    columns = []
    for start in range(0, n, block):
        held = ids[start:start + block]
        columns.append(last[held[-1]] // block - first[held[0]] // block + 1)
    return columns


def main() -> None:
    document = document_columns()
    kernels = {  # per (batch, head) pair, its programs' tile counts in launch order; pairs; slots
        "forward, B2 H16 N8192, 128 x 128": ([i + 1 for i in reversed(range(64))], 32, SMS),
        "dQ, B2 H16 N8192, 128 x 64": ([2 * (i + 1) for i in reversed(range(64))], 32, SMS),
        "dK/dV, B2 H16 N8192, 64 x 64": ([128 - j for j in range(128)], 32, 2 * SMS),
        "dK/dV, B2 H16 KV4 N8192 (4 heads per program)": ([4 * (128 - j) for j in range(128)], 8, 2 * SMS),
        "forward, B8 H16 N2048, 64 x 64": ([i + 1 for i in reversed(range(32))], 128, 3 * SMS),
        "dK/dV, document, B2 H16 N8192, 64 x 64": (document, 32, 2 * SMS),
        "dK/dV, document, B2 H16 KV4 N8192 (4 heads per program)": ([4 * c for c in document], 8, 2 * SMS),
    }
    groups = (1, 2, 4, 8, 16)
    rows = [{"kernel": name, **{f"head_group {g}": f"{100 * excess(launch_order(work, pairs, g), slots):.1f} %"
                                for g in groups}} for name, (work, pairs, slots) in kernels.items()]
    print(keep("program-order-model", ["kernel", *[f"head_group {g}" for g in groups]], rows,
               notes="Causal masks, and a document mask of 8 sorted random ids per position (one draw, the same for "
                     "every pair); idle time at the kernel's end over its evenly spread work, modelled on the CPU."))


if __name__ == "__main__":
    main()
