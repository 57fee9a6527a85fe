"""The row kernel: a fused group holding row reductions (``reduction``), XBLOCK rows of its root shape a program.

A row is the root's last dimension; the outer dimensions, flattened, number the rows. Values come in two
spaces: a row's (``[XBLOCK, 1]``: a reduction's result, what is computed from results and loads that do not move
along the row) and the whole tile's (``[XBLOCK, RBLOCK]``). Rows up to ``PERSISTENT_MAX`` long are held whole:
every value is computed once, in program order. Longer rows are walked in RBLOCK-wide chunks, one walk per level
of reduction, and a last walk writes the outputs of the whole tile: values of a walk are recomputed in the next,
loads come again, which costs reads of the row, never writes. A sum of ``exp(v − max(v))`` (a softmax's, a
log-sum-exp's) is taken in the walk of the maximum, each lane's sum rescaled as its maximum grows (the online
softmax), where both are computed in fp32 or wider: one read of the row fewer.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusepass.codegen.operands import TRITON_DTYPE, Operand, held_dtype, round_to, to_stored
from fusepass.codegen.translate import translate
from fusepass.elementwise.coords import strides_at
from fusepass.elementwise.kernel import (INT32_MAX, LaunchPlan, PointwiseLauncher, compiled_kernel,
                                         contiguous_strides, jit_text, kernel_params, offset, resolved_root)
from fusepass.elementwise.lower import Lowered, output_map
from fusepass.elementwise.program import Program, Ref
from fusepass.elementwise import column_total, reduction
from fusepass.elementwise.reduction import ROW_REDUCTIONS
from fusepass.runtime.device import interpreting
from fusepass.runtime.launch import BoundLaunch
from fusepass.runtime.sizes import cdiv, next_power_of_2

# Rows up to reduction.PERSISTENT_MAX long are held whole in registers (4096 fp32 values at 8 warps: 16 a thread);
# longer ones are walked in chunks of LOOP_BLOCK.
LOOP_BLOCK = 2048
PROGRAM_TILE = 2048  # elements a program holds (16 a thread at 4 warps): short rows take several a program
# Short rows in a kernel without column sums, by RBLOCK: the rows a program holds and its warps. One warp's
# reductions are warp shuffles, with no shared memory and no barrier (Inductor's rule for rows up to 1024); rows of
# 1024 ran fastest at two warps a row, softmax's most (bench/row_tiles.py, bench/NOTES.md). Other rows: PROGRAM_TILE.
SHORT_ROWS = {256: (4, 1), 512: (2, 1), 1024: (1, 2)}

# Torch's maximum and minimum propagate NaN; Triton's reductions of tl.maximum need not.
COMBINE = '''@triton.jit
def _max_nan(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _min_nan(a, b):
    return tl.where((a < b) | (a != a), a, b)


'''
NEUTRAL = {"sum": "0.0", "mean": "0.0", "amax": 'float("-inf")', "amin": 'float("inf")'}
COMBINER = {"amax": "_max_nan", "amin": "_min_nan"}
COLUMN = torch.ops.prims.iota.default  # a step giving each lane its column (the class of a row of classes)
COLUMN_SPACES = ("column", "column_kept")  # a column sum's outputs (lower.OutputLayout)
ROW_SPACES = ("row", "row_dropped")  # a row's own values: one a row
# A column sum's program walks its rows one tile at a time, each tile's loads waited for before the next: more
# programs a multiprocessor keep more bytes in flight, and write more partial sums (bench/column_sums.py).
COLUMN_PROGRAMS_PER_SM = 2
# Tiles of that walk Triton's pipeliner keeps in flight (`tl.range(..., num_stages=)`: on sm_80 and later each
# tile's loads go to shared memory by asynchronous copies, issued stages − 1 tiles ahead); 1 walks as written.
# Fewer where a stage's tiles would pass COLUMN_STAGE_BYTES: a program holds stages × its loads' tiles there.
COLUMN_STAGES = 3  # timed fastest of 1 to 3 (bench/column_sums.py; bench/NOTES.md)
COLUMN_STAGE_BYTES = 96 * 1024
# Warps of a column walk's program that holds one row 4096 or more wide. At 8 its registers reach ~128 a thread
# (Gemma's 2304-wide RMSNorm backward: 127, offline), two programs a multiprocessor; at 16 they halve (64), and a
# multiprocessor keeps twice the warps in flight: to be timed (bench/column_sums.py --warps 8,16).
COLUMN_WIDE_ROW_WARPS = 8


def _neutral(kind: str, dtype: torch.dtype) -> str:
    """The kind's neutral element in a reduction's held dtype (a count's is an integer zero)."""
    return NEUTRAL[kind] if dtype.is_floating_point else "0"


@dataclass(frozen=True)
class RowVariant:
    """What the source depends on beyond the program: which root dims each operand moves along."""

    rank: int  # the root's: rows over dims 0..rank-2, the row along dim rank-1
    load_dims: tuple[tuple[bool, ...], ...]
    load_base: tuple[bool, ...]
    output_dims: tuple[tuple[bool, ...], ...]
    wide: bool
    looped: bool
    stages: int = 1  # a column sum's row walk's pipeline stages (`column_stages`)


def _row_values(program: Program, variant: RowVariant) -> tuple[dict[Ref, bool], dict[Ref, int]]:
    """Which values are a row's (not moving along it), and each value's level: the reductions it follows."""
    last = variant.rank - 1
    in_row: dict[Ref, bool] = {}
    level: dict[Ref, int] = {}
    for k, load in enumerate(program.loads):
        ref = Ref("load", k)
        in_row[ref] = load.by_value or not variant.load_dims[k][last]
        level[ref] = 0
    for j, step in enumerate(program.steps):
        ref, args = Ref("step", j), _step_refs(step)
        if step.target in ROW_REDUCTIONS:
            in_row[ref], level[ref] = True, level[args[0]] + 1
        elif step.target == COLUMN:
            in_row[ref], level[ref] = False, 0
        else:
            in_row[ref] = all(in_row[a] for a in args)
            level[ref] = max((level[a] for a in args), default=0)
    return in_row, level


def _step_refs(step: Any) -> list[Ref]:
    return _refs(step.args) + _refs(tuple(v for _, v in step.kwargs))


def _refs(args: tuple[Any, ...]) -> list[Ref]:
    found: list[Ref] = []
    for a in args:
        if isinstance(a, Ref):
            found.append(a)
        elif isinstance(a, tuple):
            found += _refs(a)
    return found


def _depends(program: Program, roots: list[Ref]) -> set[Ref]:
    """`roots` and every value they are computed from."""
    seen: set[Ref] = set()
    stack = list(roots)
    while stack:
        ref = stack.pop()
        if ref in seen:
            continue
        seen.add(ref)
        if ref.kind == "step":
            stack += _step_refs(program.steps[ref.index])
    return seen


def column_invariant(program: Program, load_dims: tuple[tuple[bool, ...], ...]) -> set[Ref]:
    """Values of a column sum's row walk that no row changes: loads moving along the row alone (a norm's weight), the
    scalars passed by value, the column, and what is computed from these alone. The walk loads and computes them once,
    before its first row, so its pipeline stages hold only the rows' tiles."""
    found: set[Ref] = set()
    for k, load in enumerate(program.loads):
        dims = load_dims[k]
        if load.by_value or (dims[-1] and not any(dims[:-1])):
            found.add(Ref("load", k))
    for j, step in enumerate(program.steps):
        if step.target == COLUMN or (step.target not in ROW_REDUCTIONS and
                                     all(a in found for a in _step_refs(step))):
            found.add(Ref("step", j))
    return found


def _online_sums(program: Program, level: dict[Ref, int]) -> dict[Ref, Ref]:
    """Each sum of ``exp(v − m)`` whose ``m`` is the maximum of the same ``v`` (sum → maximum), where the
    subtraction and the exponential round to nothing narrower than they are held in."""
    found = {}
    for j, step in enumerate(program.steps):
        if ROW_REDUCTIONS.get(step.target) != "sum":
            continue
        exp = step.args[0]
        if not isinstance(exp, Ref) or exp.kind != "step" or program.steps[exp.index].target != torch.ops.aten.exp.default:
            continue
        sub = program.steps[exp.index].args[0]
        if not isinstance(sub, Ref) or sub.kind != "step" or program.steps[sub.index].target != torch.ops.aten.sub.Tensor:
            continue
        v, m = program.steps[sub.index].args[:2]
        if not (isinstance(v, Ref) and isinstance(m, Ref) and m.kind == "step" and
                ROW_REDUCTIONS.get(program.steps[m.index].target) == "amax" and program.steps[m.index].args[0] == v):
            continue
        dtypes = {program.steps[r.index].dtype for r in (exp, sub, m, Ref("step", j))}
        if len(dtypes) == 1 and held_dtype(dtypes.pop()) in (torch.float32, torch.float64) and \
                level[Ref("step", j)] == level[m] + 1:
            found[Ref("step", j)] = m
    return found


def row_kernel_source(name: str, program: Program, spaces: tuple[str, ...], variant: RowVariant,
                      passes: dict[int, int] | None = None) -> str:
    """The kernel's source; `passes`, where given, counts the times it reads each load (once per walk that
    computes from it)."""
    q, last = variant.rank, variant.rank - 1
    params = kernel_params(program, q, variant.load_dims, variant.load_base, variant.output_dims)
    params += ["XBLOCK: tl.constexpr", "RBLOCK: tl.constexpr"]

    columns = [i for i, space in enumerate(spaces) if space in COLUMN_SPACES]
    if columns:
        params.insert(-2, "row_steps")
    wide = ".to(tl.int64)" if variant.wide else ""
    rows = " * ".join(f"n{d}" for d in range(last)) or "1"
    block = f"(tl.program_id(0){wide} * row_steps + rs)" if columns else f"tl.program_id(0){wide}"
    body = [f"x = {block} * XBLOCK + tl.arange(0, XBLOCK)[:, None]", f"row_mask = x < {rows}"]
    rest = "x"
    for d in range(last - 1, 0, -1):
        body += [f"c{d} = {rest} % n{d}", f"x{d} = {rest} // n{d}"]
        rest = f"x{d}"
    if last > 0:
        body.append(f"c0 = {rest}")

    in_row, level = _row_values(program, variant)
    tile = interpreting()  # see kernel.kernel_source: the interpreter broadcasts scalars where they are read
    names: dict[Ref, str] = {}

    rounded: set[Ref] = set()  # steps whose results round as eager materializes them

    def operand(ref: Ref) -> Operand:
        dtype = program.loads[ref.index].dtype if ref.kind == "load" else program.steps[ref.index].dtype
        zero_dim = program.loads[ref.index].zero_dim if ref.kind == "load" else program.steps[ref.index].zero_dim
        return Operand(names[ref], dtype, zero_dim, ref.kind == "load" or ref in rounded)

    def resolve(a: Any) -> Any:
        if isinstance(a, Ref):
            return operand(a)
        if isinstance(a, tuple):
            return tuple(resolve(x) for x in a)
        return a

    def emit(ref: Ref, suffix: str, lines: list[str], hoisted: bool = False) -> None:
        """The statement computing `ref` under the name it gets in this walk (`suffix`); `hoisted`: ahead of a
        column sum's row walk, where only the columns are known."""
        var = f"{'l' if ref.kind == 'load' else 't'}{ref.index}{suffix}"
        if ref.kind == "load":
            k, load = ref.index, program.loads[ref.index]
            if load.by_value:
                value = f"l{k}_value"
            else:
                if passes is not None:
                    passes[k] = passes.get(k, 0) + 1
                dims = variant.load_dims[k]
                mask = "col_mask" if hoisted else "mask" if not in_row[ref] else ("row_mask" if any(dims) else "")
                value = f"tl.load(l{k}_ptr + {offset(f'l{k}', dims, variant.load_base[k])}" \
                        f"{f', mask={mask}' if mask else ''})"
                if held_dtype(load.dtype) != load.dtype:
                    value += f".to({TRITON_DTYPE[held_dtype(load.dtype)]})"
            if tile and in_row[ref]:
                value = f"tl.broadcast_to({value}, [XBLOCK, 1])"
        else:
            step = program.steps[ref.index]
            if step.target in ROW_REDUCTIONS:
                raise AssertionError("reductions are emitted by their walk")
            if step.target == COLUMN:
                value = f"c{last}.to(tl.int64)"
                lines.append(f"{var} = {value}")
                names[ref] = var
                return
            result = translate(step.target, resolve(step.args), {k: resolve(v) for k, v in step.kwargs},
                               step.dtype)
            value = result.expr
            if result.rounded:
                rounded.add(ref)
        lines.append(f"{var} = {value}")
        names[ref] = var

    reductions = [Ref("step", j) for j, s in enumerate(program.steps) if s.target in ROW_REDUCTIONS]
    order = [Ref("load", k) for k in range(len(program.loads))] + [Ref("step", j)
                                                                   for j in range(len(program.steps))]
    col = f"c{last}"

    def chunk() -> list[str]:
        """The head of a walk's loop body: this chunk's columns and masks."""
        return [f"{col} = r0 + tl.arange(0, RBLOCK)[None, :]", f"col_mask = {col} < n{last}",
                "mask = row_mask & col_mask"]

    def reduce(ref: Ref, values: str) -> str:
        """A reduction's row value of the tile `values` (masked lanes hold the kind's neutral element), rounded to
        its dtype as eager writes it."""
        step = program.steps[ref.index]
        kind = ROW_REDUCTIONS[step.target]
        if kind in ("sum", "mean"):
            total = f"tl.sum({values}, axis=1, keep_dims=True)"
            return round_to(f"({total} / n{last})" if kind == "mean" else total, step.dtype)
        return f"tl.reduce({values}, 1, {COMBINER[kind]}, keep_dims=True)"

    def reduced_input(ref: Ref) -> str:
        """The reduction's input in this walk, in the reduction's held dtype, masked lanes neutral."""
        step = program.steps[ref.index]
        source = step.args[0]
        value = names[source]
        acc = held_dtype(step.dtype)
        if held_dtype(operand(source).dtype) != acc:
            value = f"({value}).to({TRITON_DTYPE[acc]})"
        return f"tl.where(col_mask, {value}, {_neutral(ROW_REDUCTIONS[step.target], acc)})"

    done: set[Ref] = set()

    def emit_rows(upto: int) -> None:
        """Row values of levels up to `upto` not yet computed, in program order."""
        for ref in order:
            if ref not in done and in_row[ref] and level[ref] <= upto and ref not in reductions:
                if ref.kind == "load" or all(a in done for a in _step_refs(program.steps[ref.index])):
                    emit(ref, "", body)
                    done.add(ref)

    columns_head = [f"{col} = tl.arange(0, RBLOCK)[None, :]", f"col_mask = {col} < n{last}"]
    ahead: list[str] = []  # a column sum's values no row changes, computed before its row walk
    if columns:
        invariant = column_invariant(program, variant.load_dims)
        ahead += columns_head
        for ref in order:
            if ref in invariant:
                emit(ref, "", ahead, hoisted=True)
                done.add(ref)
    if not variant.looped:
        body += columns_head + ["mask = row_mask & col_mask"]
        for ref in order:
            if ref in done:
                continue
            if ref in reductions:
                body.append(f"t{ref.index} = {reduce(ref, reduced_input(ref))}")
                names[ref] = f"t{ref.index}"
            else:
                emit(ref, "", body)
            done.add(ref)
    else:
        emit_rows(0)
        online = _online_sums(program, level)
        for walk in range(max((level[r] for r in reductions), default=0)):
            todo = [r for r in reductions if level[r] == walk + 1 and r not in done]
            beside = {total: m for total, m in online.items() if m in todo}  # sums taken in this walk
            for ref in todo + list(beside):
                step = program.steps[ref.index]
                body.append(f"acc{ref.index} = tl.full([XBLOCK, RBLOCK], "
                            f"{_neutral(ROW_REDUCTIONS[step.target], held_dtype(step.dtype))}, "
                            f"{TRITON_DTYPE[held_dtype(step.dtype)]})")
            if todo:
                loop = chunk()
                needed = _depends(program, [program.steps[r.index].args[0] for r in todo])
                row_names = dict(names)  # the walk's values are its loop's own
                for ref in order:
                    if ref in needed and ref not in done:
                        emit(ref, f"_w{walk}", loop)
                for ref in todo:
                    kind = ROW_REDUCTIONS[program.steps[ref.index].target]
                    value = reduced_input(ref)
                    if kind in ("sum", "mean"):
                        loop.append(f"acc{ref.index} = acc{ref.index} + {value}")
                        continue
                    totals = [total for total, m in beside.items() if m == ref]
                    if totals:
                        loop += [f"v{ref.index} = {value}", f"m{ref.index} = acc{ref.index}"]
                        value = f"v{ref.index}"
                    loop.append(f"acc{ref.index} = {COMBINER[kind]}(acc{ref.index}, {value})")
                    if totals:  # the smaller of the old maximum and the value, at the new maximum
                        loop.append(f"e{ref.index} = tl.exp(tl.minimum(m{ref.index}, v{ref.index}) - acc{ref.index})")
                    for total in totals:
                        # A lane's sum so far at its new maximum (lanes with none hold 0): where the value is the new
                        # maximum, the sum rescaled plus exp(0); else the sum plus the value's exp. One exponential a
                        # value, where the sum rescaled and the value's exp each took one; the same roundings.
                        loop.append(f"acc{total.index} = tl.where(acc{ref.index} == float('-inf'), 0.0, "
                                    f"tl.where(v{ref.index} > m{ref.index}, acc{total.index} * e{ref.index} + 1.0, "
                                    f"acc{total.index} + e{ref.index}))")
                body.append(f"for r0 in range(0, n{last}, RBLOCK):")
                body += [f"    {line}" for line in loop]
                names.clear()
                names.update(row_names)
            for ref in todo:
                body.append(f"t{ref.index} = {reduce(ref, f'acc{ref.index}')}")
                names[ref] = f"t{ref.index}"
                done.add(ref)
            for total, m in beside.items():  # the lanes' sums at the row's maximum
                body.append(f"t{total.index} = "
                            f"{reduce(total, f'acc{total.index} * tl.exp(acc{m.index} - t{m.index})')}")
                names[total] = f"t{total.index}"
                done.add(total)
            emit_rows(walk + 1)

    def add_up(i: int) -> str:
        """A column sum's input added to the program's sums (rows past the last, columns past the row: 0)."""
        ref, _ = program.outputs[i]
        return f"col{i} = col{i} + tl.where(mask, {names[ref]}, 0.0).to({TRITON_DTYPE[_column_dtype(program, i)]})"

    def store(i: int) -> str:
        ref, dtype = program.outputs[i]
        row_output = spaces[i] != "root"
        value = f"tl.broadcast_to({names[ref]}, {'[XBLOCK, 1]' if row_output else '[XBLOCK, RBLOCK]'})"
        if held_dtype(dtype) != dtype:
            value = to_stored(value, held_dtype(dtype), dtype)
        dims = variant.output_dims[i]
        if row_output:  # written once per row: the column's coordinate is not a row's
            dims = tuple(moves and d != last for d, moves in enumerate(dims))
        where = offset(f"o{i}", dims, False)
        if where == "0":  # one row (a root of rank 1): the offset still takes the value's shape
            where = "x * 0" if row_output else f"x * 0 + c{last} * 0"
        return f"tl.store(o{i}_ptr + {where}, {value}, mask={'row_mask' if row_output else 'mask'})"

    row_outputs = [i for i, space in enumerate(spaces) if space in ROW_SPACES]
    tile_outputs = [i for i, space in enumerate(spaces) if space == "root"]
    body += [store(i) for i in row_outputs]
    if not variant.looped:
        body += [store(i) for i in tile_outputs] + [add_up(i) for i in columns]
    elif tile_outputs:  # walked rows: a last walk writes them
        loop = chunk()
        needed = _depends(program, [program.outputs[i][0] for i in tile_outputs])
        for ref in order:
            if ref in needed and ref not in done:
                emit(ref, "_out", loop)
        loop += [store(i) for i in tile_outputs]
        body.append(f"for r0 in range(0, n{last}, RBLOCK):")
        body += [f"    {line}" for line in loop]
    if columns:  # the program's rows, XBLOCK at a time, then its sums of each column
        assert not variant.looped, "a column sum's rows are held whole"
        stages = variant.stages
        walk = "range(0, row_steps)" if stages == 1 else f"tl.range(0, row_steps, num_stages={stages})"
        body = [f"col{i} = tl.zeros([XBLOCK, RBLOCK], {TRITON_DTYPE[_column_dtype(program, i)]})" for i in columns] + \
            ahead + [f"for rs in {walk}:"] + [f"    {line}" for line in body] + \
            [f"{col} = tl.arange(0, RBLOCK)[None, :]"] + \
            [f"tl.store(o{i}_ptr + tl.program_id(0) * o{i}_s0 + {col} * o{i}_s{last}, "
             f"tl.sum(col{i}, axis=0, keep_dims=True), mask={col} < n{last})" for i in columns]
    # The leading sizes (rows, a sequence's length among them) and the row steps count rows only, and a row's own
    # values (a norm's statistics, read or written one a row) are never loaded or stored along a row: no access
    # along a row depends on their divisibility, which Triton would otherwise compile a kernel for at a new length.
    row_strides = [f"l{k}_s{d}" for k, dims in enumerate(variant.load_dims) if not dims[last]
                   for d, moves in enumerate(dims) if moves]
    row_strides += [f"o{i}_s{d}" for i, dims in enumerate(variant.output_dims) if spaces[i] in ROW_SPACES
                    for d, moves in enumerate(dims) if moves]
    return COMBINE + jit_text(name, params, body,
                              unspecialized=[f"n{d}" for d in range(last)] + ["row_steps"] + row_strides)


def walked_bytes(lowered: Lowered, input_bytes: list[int], device: torch.device) -> int:
    """What a kernel of `lowered` moves beyond reading each input once and writing each output once: the loads a
    walked row's later walks read again, and the column sums' partial sums (written, then read by the launcher).
    0 where the root's sizes are not known when it compiles."""
    root = lowered.root_shape
    if not all(isinstance(n, int) for n in root):
        return 0
    q, length, rows = len(root), root[-1], math.prod(root[:-1])
    spaces = tuple(out.space for out in lowered.outputs)
    extra = 0
    if length > reduction.PERSISTENT_MAX:
        load_dims = tuple(tuple(any(row[d] for row in a.map) for d in range(q)) for a in lowered.accesses)
        variant = RowVariant(q, load_dims, (False,) * len(load_dims),
                             tuple((True,) * q for _ in spaces), False, True)
        passes: dict[int, int] = {}
        row_kernel_source("counted", lowered.program, spaces, variant, passes)
        extra += sum((n - 1) * input_bytes[lowered.accesses[k].input] for k, n in passes.items())
    columns = [i for i, space in enumerate(spaces) if space in COLUMN_SPACES]
    if columns:
        _, _, programs = _row_grid(rows, length, True, device)
        extra += sum(2 * programs * length * _column_dtype(lowered.program, i).itemsize for i in columns)
    return extra


def row_layout(lowered: Lowered, device: torch.device) -> str | None:
    """How the kernel of `lowered` lays its rows out, in words (a reduction's record keeps it; a profiled kernel
    far from its roofline shows it): the tile a program holds and the share of its lanes past the row's end, or
    the chunks a long row is walked in; a column walk's rows a program, one after another. None where the root's
    sizes are not known when it compiles."""
    root = lowered.root_shape
    if not all(isinstance(n, int) for n in root):
        return None
    rows, length = math.prod(root[:-1]), root[-1]
    columns = any(out.space in COLUMN_SPACES for out in lowered.outputs)
    xblock, row_steps, programs = _row_grid(rows, length, columns, device)
    rblock = row_block(length)
    warps = _warps(xblock, rblock, columns)
    if length > reduction.PERSISTENT_MAX:
        return f"rows of {length} walked in chunks of {rblock}, {warps} warps"
    layout = f"rows of {length} held {xblock} x {rblock} a program, {warps} warp{'s' * (warps != 1)}"
    if rblock > length:
        layout += f" ({1 - length / rblock:.0%} of the lanes past the row)"
    if columns:
        layout += (f"; column sums by {programs} program{'s' * (programs != 1)}, "
                   f"{row_steps} tile{'s' * (row_steps != 1)} of {xblock} row{'s' * (xblock != 1)} each, "
                   "one after another")
    return layout


def row_block(length: int) -> int:
    """RBLOCK for rows of `length`: the row held whole (the next power of two), or the chunk a long row is walked in."""
    return LOOP_BLOCK if length > reduction.PERSISTENT_MAX else next_power_of_2(max(length, 1))


def _short_rows(rblock: int, columns: bool) -> tuple[int, int] | None:
    """(rows, warps) of a program of rows of RBLOCK `rblock` where `SHORT_ROWS` lays them out, else None."""
    return None if columns else SHORT_ROWS.get(rblock)


def _row_grid(rows: int, length: int, columns: bool, device: torch.device) -> tuple[int, int, int]:
    """Rows a program takes at once (XBLOCK), the times it does (a group with column sums: each program adds up
    several blocks of rows), and the programs."""
    rblock, most = row_block(length), next_power_of_2(max(rows, 1))
    short = _short_rows(rblock, columns)
    if length > reduction.PERSISTENT_MAX:
        xblock = 1
    elif short:
        xblock = min(most, short[0])
    else:
        xblock = min(most, max(1, PROGRAM_TILE // rblock))
    row_blocks = cdiv(rows, xblock)
    row_steps = max(1, cdiv(row_blocks, column_programs(device))) if columns else 1
    return xblock, row_steps, cdiv(row_blocks, row_steps)


def column_stages(program: Program, load_dims: tuple[tuple[bool, ...], ...]) -> int:
    """The stages of a column sum's row walk (`COLUMN_STAGES`), fewer where the tiles it loads a row step (of at
    most `reduction.PERSISTENT_MAX` elements: a held row, or PROGRAM_TILE of shorter ones) would pass
    COLUMN_STAGE_BYTES. A row's own values (a norm's statistics) are a few elements; what no row changes is loaded
    before the walk (`column_invariant`)."""
    invariant = column_invariant(program, load_dims)
    walked = [load for k, load in enumerate(program.loads) if Ref("load", k) not in invariant and load_dims[k][-1]]
    tile_bytes = max(PROGRAM_TILE, reduction.PERSISTENT_MAX) * sum(load.dtype.itemsize for load in walked)
    return max(1, min(COLUMN_STAGES, COLUMN_STAGE_BYTES // max(tile_bytes, 1)))


def row_warps(xblock: int, rblock: int) -> int:
    """Warps of a program holding an XBLOCK × RBLOCK tile: 8 for one long row, 4 for several short ones (their
    reductions' barriers span fewer warps; bench/row_tiles.py)."""
    return 8 if xblock == 1 and rblock >= 2048 else 4


def _warps(xblock: int, rblock: int, columns: bool) -> int:
    """A program's warps: `SHORT_ROWS`' for short rows, COLUMN_WIDE_ROW_WARPS for a column walk holding one wide
    row, else `row_warps`."""
    short = _short_rows(rblock, columns)
    if short:
        return short[1]
    return COLUMN_WIDE_ROW_WARPS if columns and xblock == 1 and rblock >= 4096 else row_warps(xblock, rblock)


def _column_dtype(program: Program, i: int) -> torch.dtype:
    """What a column sum adds up in: float32, float64 where its input or output is."""
    ref, dtype = program.outputs[i]
    held = program.loads[ref.index].dtype if ref.kind == "load" else program.steps[ref.index].dtype
    return torch.float64 if torch.float64 in (held, dtype) else torch.float32


def _space_shape(root: tuple[int, ...], space: str) -> tuple[int, ...]:
    if space == "column":
        return root[-1:]
    if space == "column_kept":
        return (1,) * (len(root) - 1) + root[-1:]
    return root if space == "root" else root[:-1] + (1,) if space == "row" else root[:-1]


def column_programs(device: torch.device) -> int:
    """Programs a group with column sums runs: each adds up its share of the rows, the launcher their sums."""
    if device.type != "cuda":
        return 4
    return COLUMN_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


class RowLauncher(PointwiseLauncher):
    """Runs one fused group holding row reductions or column sums: the pointwise launcher with the row kernel's
    plan. A column sum's kernel output is each program's sums of the columns (float32, P × the row's length),
    which `ColumnSums.finish` adds up: deterministic, where atomic adds into one row would not be."""

    def _plan(self, inputs: Sequence[torch.Tensor]) -> LaunchPlan:
        lowered = self.lowered
        accesses = lowered.accesses
        root = resolved_root(lowered, inputs)
        q = len(root)
        spaces = tuple(out.space for out in lowered.outputs)
        columns = [i for i, space in enumerate(spaces) if space in COLUMN_SPACES]
        shapes = tuple(_space_shape(root, out.space) for out in lowered.outputs)
        rows, length = math.prod(root[:-1]), root[-1]
        looped = length > reduction.PERSISTENT_MAX
        rblock = row_block(length)
        xblock, row_steps, programs = _row_grid(rows, length, bool(columns), self.device)
        # A column sum's output is contiguous; the kernel writes its programs' partial sums (`ColumnSums`).
        out_strides = self._written_strides(tuple(
            contiguous_strides(shape, range(len(shape)) if i in columns else out.stride_order)
            for i, (shape, out) in enumerate(zip(shapes, lowered.outputs))))
        scratch = ColumnSums(tuple(columns), programs, length,
                             tuple(_column_dtype(lowered.program, i) for i in columns)) if columns else None
        if rows == 0:  # nothing to compute: empty outputs (column sums of no rows: zeros), no launch
            return LaunchPlan(None, shapes, out_strides, (0,), scratch=scratch)
        int_args: list[int] = list(root)
        load_dims, load_base, extents = [], [], [rows * length]
        for access in accesses:
            if access.by_value:
                load_dims.append((False,) * q)
                load_base.append(False)
                continue
            x = inputs[access.input]
            strides, base = strides_at(access.map, x.stride(), q)
            load_dims.append(tuple(s != 0 for s in strides))
            load_base.append(base != 0)
            int_args += [s for s in strides if s != 0] + ([base] if base else [])
            extents.append(sum((n - 1) * abs(s) for n, s in zip(root, strides)) + abs(base))
        output_dims = []
        for i, (out, strides) in enumerate(zip(lowered.outputs, out_strides)):
            if i in columns:  # by program (along dim 0) and column
                output_dims.append(tuple(d in (0, q - 1) for d in range(q)))
                int_args += [length, 1]
                extents.append(programs * length)
                continue
            at_root, _ = strides_at(output_map(out.space, q), strides, q)
            output_dims.append(tuple(s != 0 for s in at_root))
            int_args += [s for s in at_root if s != 0]
            extents.append(sum((n - 1) * abs(s) for n, s in zip(root, at_root)))
        if columns:
            int_args.append(row_steps)
        num_warps = _warps(xblock, rblock, bool(columns))
        stages = column_stages(lowered.program, tuple(load_dims)) if columns else 1
        variant = RowVariant(q, tuple(load_dims), tuple(load_base), tuple(output_dims), max(extents) > INT32_MAX,
                             looped, stages)
        kernel = compiled_kernel(self.__name__, lowered.program, (variant, spaces),
                                 lambda: row_kernel_source(self.__name__, lowered.program, spaces, variant))
        launch = BoundLaunch(kernel, len(accesses) + len(out_strides), bound_args=tuple(int_args), XBLOCK=xblock,
                             RBLOCK=rblock, num_warps=num_warps)
        return LaunchPlan(launch, shapes, out_strides, (programs,), scratch=scratch)


@dataclass(frozen=True)
class ColumnSums:
    """The row kernel writes each column sum as its programs' partial sums, `programs` × `length` in `dtypes` (one
    per column output, `columns`), which `finish` adds up (`column_total`), rounded once to the output's dtype.
    The partials of the sums of one dtype lie one after another in one buffer: one launch adds up several."""

    columns: tuple[int, ...]
    programs: int
    length: int
    dtypes: tuple[torch.dtype, ...]

    def written(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        written = list(outputs)
        for dtype, columns in self._by_dtype.items():
            buffer = torch.empty((len(columns), self.programs, self.length), dtype=dtype, device=outputs[0].device)
            for i, partials in zip(columns, buffer):
                written[i] = partials
        return tuple(written)

    def finish(self, written: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        for columns in self._by_dtype.values():
            first = written[columns[0]]
            buffer = first.as_strided((len(columns), self.programs, self.length),
                                      (self.programs * self.length, self.length, 1))
            column_total.add_up(buffer, [outputs[i].view(self.length) for i in columns])

    @functools.cached_property  # asked on every launch: a plan's sums, grouped once
    def _by_dtype(self) -> dict[torch.dtype, list[int]]:
        grouped: dict[torch.dtype, list[int]] = {}
        for i, dtype in zip(self.columns, self.dtypes):
            grouped.setdefault(dtype, []).append(i)
        return grouped
